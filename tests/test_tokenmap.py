"""The compressed token map against an independent pure-Python normalizer."""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import pytest

from engramrt.config import PRESETS
from engramrt.errors import TokenizerError
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
