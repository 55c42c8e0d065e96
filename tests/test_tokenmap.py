"""The compressed token map against an independent pure-Python normalizer."""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import pytest

from engramrt.config import PRESETS
from engramrt.errors import TokenizerError
from engramrt.hashing.fingerprint import check_fingerprint, fingerprint
from engramrt.tokenmap import TokenMap, default_tokenizer_path, load_tokenizer

# Characters Rust's char::is_whitespace accepts (the Unicode White_Space
# property); Python's str.isspace also accepts U+001C..U+001F, which the
# tokenizers Strip normalizer keeps.
_WHITE_SPACE = "".join(
    chr(c) for c in range(0x110000) if chr(c).isspace() and c not in (0x1C, 0x1D, 0x1E, 0x1F)
)


def _normalize(text: str) -> str:
    """SPEC §2 written with unicodedata and re instead of the tokenizers library."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if not unicodedata.category(c).startswith("M"))
    text = re.sub(r"[ \t\r\n]+", " ", text.lower())
    return " " if text == " " else text.strip(_WHITE_SPACE)


def test_deepseek_v4_map_matches_independent_build(token_map: TokenMap) -> None:
    tokenizer = load_tokenizer()
    keys: dict[str, int] = {}
    expected = np.empty(tokenizer.get_vocab_size(True), dtype=np.int64)
    for tid in range(expected.shape[0]):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(tid)
        else:
            key = _normalize(text) or text
        expected[tid] = keys.setdefault(key, len(keys))
    assert token_map.vocab_size == 129_280
    assert len(keys) == 99_092 == token_map.num_compressed
    np.testing.assert_array_equal(token_map.map, expected)


def test_case_and_space_variants_share_ids(token_map: TokenMap) -> None:
    tokenizer = load_tokenizer()
    ids = [tokenizer.token_to_id(t) for t in ("ĠThe", "the", "The", "ĠTHE")]
    assert all(i is not None for i in ids)
    assert len({int(token_map.map[i]) for i in ids}) == 1
    assert token_map.map[tokenizer.token_to_id("Ġdog")] != token_map.map[ids[0]]


def test_pad_id_and_config_check(token_map: TokenMap) -> None:
    cfg = PRESETS["dsv41-flash"]
    assert token_map.pad_id(cfg) == int(token_map.map[2])
    with pytest.raises(TokenizerError) as info:
        token_map.check_config(cfg.replace(compressed_vocab_size=99_000))
    assert "99,092" in str(info.value) and "99,000" in str(info.value)


def test_compress_refuses_out_of_range(token_map: TokenMap) -> None:
    assert token_map.compress([0, 1, 129_279]).tolist() == token_map.map[[0, 1, 129_279]].tolist()
    with pytest.raises(TokenizerError, match="129280"):
        token_map.compress([5, 129_280])
    with pytest.raises(TokenizerError, match="-1"):
        token_map.compress([-1])


def test_cache_is_used_and_corrupt_cache_is_rebuilt(tmp_path, monkeypatch) -> None:
    import engramrt.tokenmap as tm

    built = []
    real_build = tm.build_map
    monkeypatch.setattr(tm, "build_map", lambda tok: built.append(1) or real_build(tok))
    first = TokenMap.from_tokenizer_file(cache_dir=tmp_path)
    assert len(built) == 1
    (cache_file,) = tmp_path.glob("tokenmap-*.npz")
    again = TokenMap.from_tokenizer_file(cache_dir=tmp_path)
    assert len(built) == 1  # served from the cache
    np.testing.assert_array_equal(again.map, first.map)

    # Truncated file: rebuilt, never used.
    cache_file.write_bytes(cache_file.read_bytes()[:100])
    np.testing.assert_array_equal(TokenMap.from_tokenizer_file(cache_dir=tmp_path).map, first.map)
    assert len(built) == 2

    # A well-formed file whose contents were altered: checksum catches it.
    data = dict(np.load(cache_file))
    data["map"] = data["map"].copy()
    data["map"][7] += 1
    np.savez(cache_file, **data)
    np.testing.assert_array_equal(TokenMap.from_tokenizer_file(cache_dir=tmp_path).map, first.map)
    assert len(built) == 3


def test_cache_is_keyed_by_tokenizer_contents(tmp_path) -> None:
    import json

    src = json.loads(default_tokenizer_path().read_text(encoding="utf-8"))
    # Two ids whose texts normalize alike in the original are made distinct.
    src["added_tokens"][0]["content"] = "<engramrt-test-token>"
    other = tmp_path / "tok" / "tokenizer.json"
    other.parent.mkdir()
    other.write_text(json.dumps(src), encoding="utf-8")
    a = TokenMap.from_tokenizer_file(cache_dir=tmp_path / "c")
    b = TokenMap.from_tokenizer_file(other, cache_dir=tmp_path / "c")
    assert a.tokenizer_sha256 != b.tokenizer_sha256
    assert len(list((tmp_path / "c").glob("tokenmap-*.npz"))) == 2


def test_missing_and_malformed_tokenizer(tmp_path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        TokenMap.from_tokenizer_file(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        TokenMap.from_tokenizer_file(tmp_path, use_cache=False)


# The hash contract ----------------------------------------------------------


def _swapped(token_map: TokenMap, first: int, second: int) -> TokenMap:
    """The map with compressed ids ``first`` and ``second`` exchanged (same size, same file hash)."""
    mapping = token_map.map.copy()
    mapping[token_map.map == first] = second
    mapping[token_map.map == second] = first
    return TokenMap(
        mapping, token_map.num_compressed, token_map.tokenizer_path, token_map.tokenizer_sha256
    )


def _spec_row_ids(compressed: list[int], layout, pad_id: int) -> list[list[list[int]]]:
    """SPEC §4 in Python ints, from the layout's multipliers, primes and offsets."""
    n, h = layout.max_ngram_size, layout.n_heads
    out = []
    for p in range(len(compressed)):
        values, blocked = [], False
        for k in range(n):
            blocked = blocked or p - k < 0
            values.append(pad_id if blocked else compressed[p - k])
        per_layer = []
        for li in range(layout.n_layers):
            m = [int(x) for x in layout.multipliers[li]]
            rolling, cols = values[0] * m[0], []
            for k in range(1, n):
                rolling ^= values[k] * m[k]
                for head in range(h):
                    col = (k - 1) * h + head
                    prime = int(layout.primes[li, k - 1, head])
                    cols.append(rolling % prime + int(layout.offsets[li, col]))
            per_layer.append(cols)
        out.append(per_layer)
    return out


def test_fingerprint_is_stable_and_computed_from_the_map(token_map: TokenMap, tmp_path) -> None:
    import hashlib

    from engramrt.tokenmap import PROBE_TEXT

    cfg = PRESETS["tiny"]
    first = fingerprint(token_map, cfg)
    copy = TokenMap(
        token_map.map.copy(),
        token_map.num_compressed,
        token_map.tokenizer_path,
        token_map.tokenizer_sha256,
    )
    again = fingerprint(copy, cfg)  # computed afresh, not from the per-map memo
    built = TokenMap.from_tokenizer_file(cache_dir=tmp_path)
    cached = TokenMap.from_tokenizer_file(cache_dir=tmp_path)  # served from the cache file
    assert first == again == fingerprint(built, cfg) == fingerprint(cached, cfg)
    assert (
        first.tokenizer_sha256 == hashlib.sha256(default_tokenizer_path().read_bytes()).hexdigest()
    )
    assert first.map_sha256 == hashlib.sha256(token_map.map.astype("<i8").tobytes()).hexdigest()
    assert (first.vocab_size, first.compressed_vocab_size) == (129_280, 99_092)
    assert first.probe_text == PROBE_TEXT
    # Another config keeps the map fields and changes only the probe's row ids.
    flash = fingerprint(token_map, PRESETS["dsv41-flash"])
    assert flash.map_sha256 == first.map_sha256 and flash.probe_row_ids != first.probe_row_ids


@pytest.mark.parametrize("preset", ["tiny", "dsv41-flash"])
def test_probe_row_ids_match_independent_hashing(token_map: TokenMap, preset: str) -> None:
    from engramrt.hashing import HashConstants, hash_sequence
    from engramrt.layout import EngramLayout
    from engramrt.tokenmap import PROBE_TEXT

    cfg = PRESETS[preset]
    recorded = fingerprint(token_map, cfg)
    token_ids = load_tokenizer().encode(PROBE_TEXT, add_special_tokens=False).ids
    assert list(recorded.probe_token_ids) == token_ids and len(token_ids) >= cfg.max_ngram_size
    compressed = token_map.map[token_ids]
    by_reference = hash_sequence(compressed, HashConstants.from_config(cfg, token_map))
    np.testing.assert_array_equal(np.array(recorded.probe_row_ids), by_reference)
    layout = EngramLayout(cfg)
    by_spec = _spec_row_ids(
        [int(c) for c in compressed], layout, int(token_map.map[cfg.pad_token_id])
    )
    assert np.array(recorded.probe_row_ids).tolist() == by_spec
    assert np.array(recorded.probe_row_ids).shape == (len(token_ids), cfg.n_layers, cfg.n_cols)


def test_swapped_pair_of_compressed_ids_changes_the_fingerprint(token_map: TokenMap) -> None:
    cfg = PRESETS["tiny"]
    recorded = fingerprint(token_map, cfg)
    probe = recorded.probe_token_ids
    # Two ids the probe uses: the map hash and the probe's row ids both see it.
    a, b = (int(token_map.map[t]) for t in (probe[0], probe[3]))
    swapped = _swapped(token_map, a, b)
    assert swapped.num_compressed == token_map.num_compressed
    assert not np.array_equal(swapped.map, token_map.map)
    in_use = fingerprint(swapped, cfg)
    assert in_use.tokenizer_sha256 == recorded.tokenizer_sha256
    assert in_use.compressed_vocab_size == recorded.compressed_vocab_size
    differences = recorded.differences(in_use)
    assert [line.split(":")[0] for line in differences] == ["map_sha256", "probe_row_ids"]
    assert recorded.map_sha256 in differences[0] and in_use.map_sha256 in differences[0]
    with pytest.raises(TokenizerError) as info:
        check_fingerprint(swapped, recorded, cfg, where="rows.safetensors")
    message = str(info.value)
    assert "rows.safetensors" in message and "map_sha256" in message and "probe_row_ids" in message
    assert "compressed_vocab_size" not in message  # the size agrees: not named as differing

    # Two ids the probe does not use: only the map hash catches it.
    unused = sorted(set(range(token_map.num_compressed)) - {int(token_map.map[t]) for t in probe})
    far = fingerprint(_swapped(token_map, unused[0], unused[-1]), cfg)
    assert far.probe_row_ids == recorded.probe_row_ids
    assert [line.split(":")[0] for line in recorded.differences(far)] == ["map_sha256"]

    # The control: the same map passes, whatever its file hash says.
    check_fingerprint(token_map, recorded, cfg, where="rows.safetensors")
    renamed = TokenMap(
        token_map.map.copy(), token_map.num_compressed, token_map.tokenizer_path, "0" * 64
    )
    check_fingerprint(renamed, recorded, cfg, where="rows.safetensors")


def test_fingerprint_round_trips_and_refuses_malformed_records(token_map: TokenMap) -> None:
    from engramrt.tokenmap import TokenMapFingerprint

    recorded = fingerprint(token_map, PRESETS["tiny"])
    assert TokenMapFingerprint.from_dict(recorded.to_dict()) == recorded
    for field, value, needle in [
        ("map_sha256", 5, "map_sha256 = 5; expected a str"),
        ("vocab_size", True, "vocab_size = True; expected a int"),
        ("format", 2, "format = 2; this engramrt reads format 1"),
        ("probe_row_ids", [[1, 2]], "expected [19, L, C]"),
        ("probe_token_ids", ["a"], "probe_token_ids = ['a']"),
    ]:
        record = recorded.to_dict()
        record[field] = value
        with pytest.raises(TokenizerError, match=re.escape(needle)):
            TokenMapFingerprint.from_dict(record)
