"""The hash contract in checkpoints: converted files record the token map's fingerprint.

Loading compares it with the map in use: a map with a swapped pair of
compressed ids (same size) is refused, the unchanged map loads (the
control), and a converted file that records none loads with a warning.
"""

from __future__ import annotations

import hashlib
import json
import struct
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engramrt.checkpoint import convert_checkpoint, load_table, load_tables, read_header, read_table
from engramrt.checkpoint.metadata import META_TOKEN_MAP
from engramrt.errors import CheckpointError, TokenizerError
from engramrt.hashing.fingerprint import fingerprint
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import TablePlacement
from engramrt.tokenmap import PROBE_TEXT, TokenMap, TokenMapWarning, load_tokenizer

from .conftest import write_deepseek_checkpoint


def _swapped(token_map: TokenMap, first: int, second: int) -> TokenMap:
    mapping = token_map.map.copy()
    mapping[token_map.map == first] = second
    mapping[token_map.map == second] = first
    return TokenMap(
        mapping, token_map.num_compressed, token_map.tokenizer_path, token_map.tokenizer_sha256
    )


def _probe_pair(token_map: TokenMap) -> tuple[int, int]:
    """Two compressed ids of the probe text (computed here, not read from a fingerprint)."""
    ids = load_tokenizer().encode(PROBE_TEXT, add_special_tokens=False).ids
    return int(token_map.map[ids[0]]), int(token_map.map[ids[3]])


def _rewrite_metadata(path, drop: str | None = None, put: dict[str, str] | None = None) -> None:
    """Edit a safetensors file's ``__metadata__`` in place (the tensor bytes stay as they are)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    if drop is not None:
        del header["__metadata__"][drop]
    header["__metadata__"].update(put or {})
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny, tiny_tables):
    """``tiny`` float tables converted once with the default (DeepSeek-V4) token map."""
    tables, packed = tiny_tables
    root = tmp_path_factory.mktemp("fingerprint")
    src = root / "src.safetensors"
    save_file(
        {f"engram.{layer}.weight": t for layer, t in zip(tiny.layer_ids, tables, strict=True)},
        str(src),
    )
    (path,) = convert_checkpoint(src, root / "out.safetensors", tiny)
    return src, path, packed


def test_conversion_records_the_fingerprint_of_the_map(converted, tiny, token_map) -> None:
    _src, path, _packed = converted
    recorded = json.loads(read_header(path).metadata[META_TOKEN_MAP])
    assert recorded == fingerprint(token_map, tiny).to_dict()
    assert recorded["compressed_vocab_size"] == 99_092
    map_bytes = token_map.map.astype("<i8").tobytes()
    assert recorded["map_sha256"] == hashlib.sha256(map_bytes).hexdigest()


def test_swapped_pair_is_refused_and_the_unchanged_map_loads(converted, tiny, token_map) -> None:
    _src, path, packed = converted
    rows = EngramLayout(tiny).column_shard(0, 1, 0).row_end
    # The control: the same map (given, or the default) loads the reference bytes.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(read_table(path, tiny, 0, token_map=token_map), packed[0][:rows])
        assert torch.equal(read_table(path, tiny, 0), packed[0][:rows])
    swapped = _swapped(token_map, *_probe_pair(token_map))
    assert swapped.num_compressed == token_map.num_compressed
    for load in (
        lambda: read_table(path, tiny, 1, token_map=swapped),
        lambda: load_table(path, tiny, 0, TablePlacement("host", device="cpu"), token_map=swapped),
        lambda: load_tables(path, tiny, TablePlacement("host", device="cpu"), token_map=swapped),
    ):
        with pytest.raises(TokenizerError) as info:
            load()
        message = str(info.value)
        assert str(path) in message
        assert f"map_sha256: {token_map.map_sha256} vs {swapped.map_sha256}" in message
        assert "probe_row_ids:" in message and "compressed_vocab_size" not in message


def test_swap_the_probe_does_not_reach_is_caught_by_the_map_hash(
    converted, tiny, token_map
) -> None:
    _src, path, _packed = converted
    used = set(token_map.map[load_tokenizer().encode(PROBE_TEXT, add_special_tokens=False).ids])
    unused = [c for c in range(token_map.num_compressed) if c not in used]
    swapped = _swapped(token_map, unused[0], unused[1])
    with pytest.raises(TokenizerError, match="map_sha256") as info:
        read_table(path, tiny, 0, token_map=swapped)
    assert "probe_row_ids" not in str(info.value)


def test_tp_files_record_and_check_it(tmp_path, converted, tiny, token_map) -> None:
    src, _path, packed = converted
    paths = convert_checkpoint(src, tmp_path / "dst", tiny, tp=2, token_map=token_map)
    assert all(META_TOKEN_MAP in read_header(p).metadata for p in paths)
    shard = EngramLayout(tiny).column_shard(1, 2, 1)
    got = read_table(tmp_path / "dst", tiny, 1, tp=2, rank=1, token_map=token_map)
    assert torch.equal(got, packed[1][shard.row_begin : shard.row_end])
    with pytest.raises(TokenizerError, match=r"engram-rank1-of-2\.safetensors .*map_sha256"):
        read_table(tmp_path / "dst", tiny, 1, tp=2, rank=1, token_map=_swapped(token_map, 3, 4))


def test_another_size_is_named(tmp_path, small, small_tables, token_map) -> None:
    """A map of another size, recorded for a synthetic config, against the default map."""
    tables, packed = small_tables
    src = tmp_path / "src.safetensors"
    save_file(
        {f"engram.{layer}.weight": t for layer, t in zip(small.layer_ids, tables, strict=True)},
        str(src),
    )
    synthetic = TokenMap(
        np.arange(token_map.vocab_size, dtype=np.int64) % small.compressed_vocab_size,
        small.compressed_vocab_size,
        token_map.tokenizer_path,
        token_map.tokenizer_sha256,
    )
    (path,) = convert_checkpoint(src, tmp_path / "out.safetensors", small, token_map=synthetic)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(read_table(path, small, 2, token_map=synthetic)[:5], packed[2][:5])
    with pytest.raises(TokenizerError) as info:
        read_table(path, small, 0)  # the default DeepSeek-V4 map
    message = str(info.value)
    assert "compressed_vocab_size: 1,000 vs 99,092" in message and "map_sha256" in message
    # A map that does not fit the config is refused at conversion too.
    with pytest.raises(TokenizerError, match="99,092"):
        convert_checkpoint(src, tmp_path / "again.safetensors", small, token_map=token_map)


def test_conversion_without_a_fitting_map_warns_and_so_does_loading(
    tmp_path, small, small_tables
) -> None:
    tables, _packed = small_tables
    src = tmp_path / "src.safetensors"
    save_file(
        {f"engram.{layer}.weight": t for layer, t in zip(small.layer_ids, tables, strict=True)},
        str(src),
    )
    with pytest.warns(TokenMapWarning, match="engram_compressed_vocab_size=1,000"):
        (path,) = convert_checkpoint(src, tmp_path / "out.safetensors", small)
    assert META_TOKEN_MAP not in read_header(path).metadata
    with pytest.warns(TokenMapWarning, match="records no token map fingerprint"):
        read_table(path, small, 0)


def test_older_conversion_loads_with_a_warning(tmp_path, converted, tiny) -> None:
    _src, path, packed = converted
    old = tmp_path / "old.safetensors"
    old.write_bytes(path.read_bytes())
    _rewrite_metadata(old, drop=META_TOKEN_MAP)
    rows = EngramLayout(tiny).column_shard(0, 1, 0).row_end
    with pytest.warns(TokenMapWarning, match=r"old\.safetensors records no token map fingerprint"):
        assert torch.equal(read_table(old, tiny, 0), packed[0][:rows])


def test_malformed_record_is_a_checkpoint_error(tmp_path, converted, tiny) -> None:
    _src, path, _packed = converted
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes())
    record = json.loads(read_header(path).metadata[META_TOKEN_MAP])
    record["map_sha256"] = 7
    _rewrite_metadata(bad, put={META_TOKEN_MAP: json.dumps(record)})
    with pytest.raises(CheckpointError, match=r"engramrt_token_map is malformed: .*map_sha256 = 7"):
        read_table(bad, tiny, 0)
    _rewrite_metadata(bad, put={META_TOKEN_MAP: "{not json"})
    with pytest.raises(CheckpointError, match="engramrt_token_map is malformed"):
        read_table(bad, tiny, 0)


def test_files_engramrt_did_not_convert_load_silently(
    tmp_path, tiny, tiny_tables, token_map
) -> None:
    """DeepSeek's files carry no hash contract: nothing to check, nothing to warn about."""
    _tables, packed = tiny_tables
    path = write_deepseek_checkpoint(tmp_path / "ds.safetensors", tiny, packed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_table(path, tiny, 0, token_map=_swapped(token_map, 3, 4))


def test_same_map_other_hash_is_refused_by_the_probe(converted, tiny, token_map) -> None:
    """Another seed keeps the map and the table shapes; only the probe's row ids see it."""
    _src, path, _packed = converted
    with pytest.raises(TokenizerError) as info:
        read_table(path, tiny.replace(hash_seed=1), 0, token_map=token_map)
    message = str(info.value)
    assert "probe_row_ids:" in message and "map_sha256" not in message


def test_recorded_map_with_a_config_it_does_not_fit(converted, tiny, token_map) -> None:
    """The map is the recorded one; the config disagrees with it: the size check's message."""
    _src, path, _packed = converted
    with pytest.raises(TokenizerError, match=r"compresses to 99,092 ids but .*=99,000"):
        read_table(path, tiny.replace(compressed_vocab_size=99_000), 0, token_map=token_map)
