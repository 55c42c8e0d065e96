"""The token map's fingerprint: what a table's rows were hashed with (the hash contract).

A :class:`~engramrt.tokenmap.TokenMapFingerprint` records the tokenizer, the
map and the row ids of a probe text under a config's layout. Computing one
hashes the probe with :func:`~engramrt.hashing.hash_sequence`, the reference
that defines the row ids, so it sits here, above both the map and the hash
(the map itself imports no hashing). Converted checkpoints record it and
loading compares it with the map in use (:mod:`engramrt.checkpoint.metadata`).
"""

from __future__ import annotations

import weakref

from engramrt.config import EngramConfig
from engramrt.errors import TokenizerError
from engramrt.hashing.reference import hash_sequence
from engramrt.hashing.types import HashConstants
from engramrt.layout import EngramLayout
from engramrt.tokenmap import PROBE_TEXT, TokenMap, TokenMapFingerprint, load_tokenizer

__all__ = ["check_fingerprint", "fingerprint"]

# Per map, per (config, probe): hashing the probe encodes it with the tokenizer.
_MEMO: weakref.WeakKeyDictionary[TokenMap, dict[tuple[EngramConfig, str], TokenMapFingerprint]]
_MEMO = weakref.WeakKeyDictionary()


def fingerprint(
    token_map: TokenMap, config: EngramConfig, *, probe_text: str = PROBE_TEXT
) -> TokenMapFingerprint:
    """The fingerprint of ``token_map`` and ``config``'s layout (cached per map, config
    and probe).

    Encodes ``probe_text`` with the tokenizer at ``token_map.tokenizer_path`` and
    hashes it with :func:`~engramrt.hashing.hash_sequence`.

    Raises:
        TokenizerError: the map does not fit ``config``
            (:meth:`~engramrt.tokenmap.TokenMap.check_config`).
    """
    memo = _MEMO.setdefault(token_map, {})
    key = (config, probe_text)
    cached = memo.get(key)
    if cached is not None:
        return cached
    consts = HashConstants.from_layout(EngramLayout(config), token_map.pad_id(config))
    encoded = load_tokenizer(token_map.tokenizer_path).encode(probe_text, add_special_tokens=False)
    probe_ids = tuple(int(t) for t in encoded.ids)
    row_ids = hash_sequence(token_map.compress(probe_ids), consts)  # [T, L, C] int64
    result = TokenMapFingerprint(
        tokenizer_sha256=token_map.tokenizer_sha256,
        vocab_size=token_map.vocab_size,
        compressed_vocab_size=token_map.num_compressed,
        map_sha256=token_map.map_sha256,
        probe_text=probe_text,
        probe_token_ids=probe_ids,
        probe_row_ids=tuple(
            tuple(tuple(int(i) for i in cols) for cols in token) for token in row_ids
        ),
    )
    memo[key] = result
    return result


def check_fingerprint(
    token_map: TokenMap, recorded: TokenMapFingerprint, config: EngramConfig, *, where: str
) -> None:
    """Refuse rows ``recorded`` says were hashed with another map or hash than ``token_map``.

    Args:
        token_map: the map in use.
        recorded: the fingerprint the rows were written with.
        config: the config the rows are served with.
        where: what holds the rows, for the message (a file name).

    Raises:
        TokenizerError: a field of :attr:`TokenMapFingerprint.COMPARED`
            differs; the message names each such field with both values.
    """
    try:
        token_map.check_config(config)
    except TokenizerError as exc:
        in_use_map = (token_map.vocab_size, token_map.num_compressed, token_map.map_sha256)
        if in_use_map == (
            recorded.vocab_size,
            recorded.compressed_vocab_size,
            recorded.map_sha256,
        ):
            raise  # the map is the recorded one; the config is what disagrees
        differences = [
            f"{name}: {mine:,} vs {theirs:,}"
            if isinstance(mine, int)
            else f"{name}: {mine} vs {theirs}"
            for name, mine, theirs in zip(
                ("vocab_size", "compressed_vocab_size", "map_sha256"),
                (recorded.vocab_size, recorded.compressed_vocab_size, recorded.map_sha256),
                in_use_map,
                strict=True,
            )
            if mine != theirs
        ]
        differences.append(f"probe_row_ids: not computed ({exc})")
    else:
        differences = recorded.differences(
            fingerprint(token_map, config, probe_text=recorded.probe_text)
        )
    if differences:
        raise TokenizerError(
            f"{where} was hashed with another token map than the one in use; differing "
            f"(recorded vs in use): {'; '.join(differences)}. Recorded tokenizer sha256 "
            f"{recorded.tokenizer_sha256}; in use {token_map.tokenizer_path} (sha256 "
            f"{token_map.tokenizer_sha256}). Load it with the tokenizer it was converted with "
            f"(token_map=TokenMap.from_tokenizer_file(path)), or convert it again with this one"
        )
