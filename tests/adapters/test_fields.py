"""Adapters field by field: hand-built engine steps, validation, and no host reads."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from engramrt.adapters import (
    from_sglang_batch,
    from_vllm_step,
    sglang_slot_cache,
    vllm_slot_cache,
)
from engramrt.config import PRESETS
from engramrt.errors import ValidationError
from engramrt.hashing import (
    DEAD,
    EMPTY,
    HashBatch,
    HashConstants,
    NgramHasher,
    hash_batch_reference,
    hash_sequence,
)

N = 4  # max_ngram_size of the tiny preset


@functools.cache
def tiny_consts() -> HashConstants:
    """The tiny preset's constants: the adapters take these (or the hasher), not a bare N."""
    from engramrt.tokenmap import TokenMap

    return HashConstants.from_config(PRESETS["tiny"], TokenMap.from_tokenizer_file())


@pytest.fixture(scope="module")
def consts(token_map) -> HashConstants:
    return HashConstants.from_config(PRESETS["tiny"], token_map)


# vLLM ----------------------------------------------------------------------------


def _vllm_step() -> dict:
    """Two real requests (positions 5..7 and 0..1), padded to 8 tokens and 4 requests.

    Block size 4: request 0 owns blocks [7, 3], request 1 owns [5]. Trailing
    boundaries are stale (one padding token each), padding slots hold the
    runner's pad slot 0, and the block table buffer has 6 rows.
    """
    bs = 4
    table = torch.tensor(
        [[7, 3, 0], [5, 0, 0], [9, 9, 9], [8, 8, 8], [2, 2, 2], [1, 1, 1]], dtype=torch.int32
    )
    positions = torch.tensor([5, 6, 7, 0, 1, 11, 12, 13])
    slots = [3 * bs + 1, 3 * bs + 2, 3 * bs + 3, 5 * bs + 0, 5 * bs + 1, 0, 0, 0, 17, 18]
    return {
        "input_ids": torch.tensor([11, 12, 13, 21, 22, 99, 98, 97]),
        "positions": positions,
        "query_start_loc": torch.tensor([0, 3, 5, 6, 7], dtype=torch.int32),
        "slot_mapping": torch.tensor(slots),
        "block_table": table,
        "block_size": bs,
        "num_tokens_unpadded": 5,
        "num_reqs_unpadded": 2,
        "pad_slot_id": 0,
    }


def test_vllm_fields() -> None:
    step = _vllm_step()
    batch = from_vllm_step(**step)
    assert batch.input_ids.data_ptr() == step["input_ids"].data_ptr()  # views, no copy
    assert batch.positions.data_ptr() == step["positions"].data_ptr()
    assert batch.query_start_loc.tolist() == [0, 3, 5, 5, 5]
    assert batch.slot_mapping is not None and batch.block_table is not None
    assert batch.slot_mapping.tolist() == [13, 14, 15, 20, 21, -1, -1, -1]
    assert batch.block_table.tolist() == step["block_table"][:4].tolist()


def test_vllm_short_buffers_are_padded() -> None:
    """A slot mapping of the real tokens only and a table of the real requests only."""
    step = _vllm_step()
    step["slot_mapping"] = step["slot_mapping"][:5]
    step["block_table"] = step["block_table"][:2]
    batch = from_vllm_step(**step)
    assert batch.slot_mapping is not None and batch.block_table is not None
    assert batch.slot_mapping.tolist() == [13, 14, 15, 20, 21, -1, -1, -1]
    assert batch.block_table.tolist() == [[7, 3, 0], [5, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_vllm_defaults_take_the_boundaries_as_given() -> None:
    step = _vllm_step()
    step["query_start_loc"] = torch.tensor([0, 3, 5, 5, 5], dtype=torch.int32)
    del step["num_tokens_unpadded"], step["num_reqs_unpadded"]
    batch = from_vllm_step(**step)
    assert batch.query_start_loc.tolist() == [0, 3, 5, 5, 5]
    assert batch.slot_mapping is not None
    assert batch.slot_mapping.tolist() == [13, 14, 15, 20, 21, -1, -1, -1]


_VLLM_INVALID = [
    ({"input_ids": torch.zeros(8)}, "input_ids has dtype torch.float32"),
    ({"positions": torch.zeros(7, dtype=torch.int64)}, r"positions has shape \[7\]"),
    ({"query_start_loc": torch.zeros(2, 3, dtype=torch.int32)}, "query_start_loc has shape"),
    ({"num_tokens_unpadded": 9}, r"num_tokens_unpadded=9 must be in \[0, 8\]"),
    ({"num_reqs_unpadded": 5}, r"num_reqs_unpadded=5 must be in \[0, 4\]"),
    ({"block_table": torch.zeros(1, 3, dtype=torch.int32)}, "block_table has 1 rows"),
    ({"block_table": torch.zeros(2, 3, dtype=torch.float32)}, "block_table has dtype"),
    (
        {"block_table": torch.tensor([[7, 3], [5, 0]], dtype=torch.int32), "block_size": 2},
        "block_table row 0 has 2 blocks of 2; position 7 needs block 3",
    ),
    ({"block_size": 0}, r"block_size=0 must be in \[1, "),
    ({"block_size": 8}, r"slot_mapping\[0\]=13 but block_table\[0\] with block_size=8"),
    (
        {"num_tokens_unpadded": 4},
        r"query_start_loc\[num_reqs_unpadded=2\]=5; expected num_tokens_unpadded=4",
    ),
    ({"slot_mapping": torch.tensor([13, 14])}, "slot_mapping has 2 entries"),
    ({"dead_mask": torch.zeros(7, dtype=torch.bool)}, r"dead_mask has shape \[7\]"),
    (
        {"lookback_token_ids": torch.zeros(2, 3, dtype=torch.int64)},
        r"lookback_token_ids has shape \[2, 3\]; expected at least 4 rows",
    ),
    (
        {"dead_mask": torch.zeros(8, dtype=torch.uint8)},
        "dead_mask has dtype torch.uint8; expected bool",
    ),
    ({"positions": torch.zeros(8, dtype=torch.int64, device="meta")}, "positions is on meta"),
    ({"num_reqs_unpadded": 2.0}, "num_reqs_unpadded=2.0 must be a Python int"),
]


@pytest.mark.parametrize(("change", "message"), _VLLM_INVALID)
def test_vllm_invalid_steps_name_the_field(change, message) -> None:
    step = {**_vllm_step(), **change}
    with pytest.raises(ValidationError, match=message):
        from_vllm_step(**step)


def test_vllm_cache_geometry_is_checked() -> None:
    with pytest.raises(ValidationError, match="block_size=4 but the SlotHashCache"):
        from_vllm_step(**_vllm_step(), cache=vllm_slot_cache(16, 8))
    with pytest.raises(ValidationError, match=r"block_table\[0, 0\]=7: .* has 4 blocks"):
        from_vllm_step(**_vllm_step(), cache=vllm_slot_cache(4, 4))
    from_vllm_step(**_vllm_step(), cache=vllm_slot_cache(8, 4))


def test_vllm_history_window_is_checked_against_the_cache() -> None:
    """Request 0 (positions 5..7, N-1 = 3) reads positions 2..4: blocks 0 and 1 of its row.

    A block id outside the cache there (not only in the chunk's own blocks)
    is refused, naming the table entry; with the hasher given, blocks before
    the window are not checked, without it every position from 0 is.
    """
    cache = vllm_slot_cache(8, 4)
    step = _vllm_step()
    step["block_table"] = step["block_table"].clone()
    step["block_table"][0, 0] = 8  # position 2..3: history of the chunk at 5
    with pytest.raises(
        ValidationError, match=r"block_table\[0, 0\]=8: request 0 reads positions 2\.\.7"
    ):
        from_vllm_step(**step, cache=cache, hasher=tiny_consts())
    step["block_table"][0, 0] = -2
    with pytest.raises(ValidationError, match=r"block_table\[0, 0\]=-2"):
        from_vllm_step(**step, cache=cache)
    # A chunk at positions 9..10 with N-1 = 3 reads from position 6 (block 1) on.
    late = _vllm_step()
    late["positions"] = torch.tensor([9, 10, 11, 0, 1, 0, 0, 0])
    late["block_table"] = torch.tensor([[-5, 3, 6], [5, 0, 0]], dtype=torch.int32)
    late["slot_mapping"] = torch.tensor([25, 26, 27, 20, 21])
    from_vllm_step(**late, cache=cache, hasher=tiny_consts())
    with pytest.raises(
        ValidationError, match=r"block_table\[0, 0\]=-5: request 0 reads positions 0\.\.11"
    ):
        from_vllm_step(**late, cache=cache)


def test_vllm_negative_slots_other_than_minus_one_are_refused() -> None:
    step = _vllm_step()
    step["slot_mapping"] = step["slot_mapping"].clone()
    step["slot_mapping"][1] = -3
    with pytest.raises(
        ValidationError, match=r"slot_mapping\[1\]=-3; expected -1 \(or pad_slot_id=0\)"
    ):
        from_vllm_step(**step)
    step["slot_mapping"][1] = -1  # not written: allowed
    from_vllm_step(**step, cache=vllm_slot_cache(8, 4))


def test_vllm_validate_false_skips_the_checks() -> None:
    step = {**_vllm_step(), "num_tokens_unpadded": 4}
    with pytest.raises(ValidationError):
        from_vllm_step(**step)
    batch = from_vllm_step(**step, validate=False)
    assert batch.query_start_loc.tolist() == [0, 3, 4, 4, 4]


def test_vllm_counts_have_unambiguous_names() -> None:
    """``num_reqs`` / ``num_actual_tokens`` are padded in vLLM's metadata: the old names
    still work, with a warning; both names at once are refused."""
    step = _vllm_step()
    counts = {"num_reqs": step.pop("num_reqs_unpadded"), "num_actual_tokens": 5}
    del step["num_tokens_unpadded"]
    with pytest.warns(DeprecationWarning) as warned:
        old = from_vllm_step(**step, **counts)
    assert sorted(str(w.message).split(")")[0] for w in warned) == [
        "from_vllm_step(num_actual_tokens=...",
        "from_vllm_step(num_reqs=...",
    ]
    assert old.query_start_loc.tolist() == [0, 3, 5, 5, 5]
    with pytest.raises(ValidationError, match="pass only num_reqs_unpadded"):
        from_vllm_step(**step, num_reqs=2, num_reqs_unpadded=2)


def test_vllm_slot_mapping_length_does_not_depend_on_optional_counts() -> None:
    step = _vllm_step()
    del step["num_tokens_unpadded"]
    step["slot_mapping"] = step["slot_mapping"][:6]
    with pytest.raises(ValidationError, match=r"slot_mapping has 6 entries; .* the 8 rows"):
        from_vllm_step(**step)
    from_vllm_step(**step, num_tokens_unpadded=5)


def test_vllm_image_token_id_marks_dead_positions() -> None:
    step = _vllm_step()
    step["input_ids"] = torch.tensor([11, 129264, 13, 21, 22, 129264, 98, 97])
    lookback = torch.tensor([[129264, 4, 5], [6, 129264, 7], [1, 2, 3], [1, 2, 3]])
    batch = from_vllm_step(**step, lookback_token_ids=lookback, image_token_id=129264)
    assert batch.dead_mask is not None and batch.lookback_dead is not None
    assert batch.dead_mask.tolist() == [False, True, False, False, False, True, False, False]
    assert batch.lookback_dead.tolist()[:2] == [[True, False, False], [False, True, False]]
    given = torch.zeros(8, dtype=torch.bool)
    given[2] = True
    both = from_vllm_step(**step, dead_mask=given, image_token_id=129264)
    assert both.dead_mask is not None
    assert both.dead_mask.nonzero().flatten().tolist() == [1, 2, 5]
    assert from_vllm_step(**step).dead_mask is None
    with pytest.raises(ValidationError, match="image_token_id=-1 must be in"):
        from_vllm_step(**step, image_token_id=-1)


def test_vllm_lookback_buffer_rows_past_the_step_are_dropped() -> None:
    step = _vllm_step()
    lookback = torch.arange(8 * 3).reshape(8, 3)  # [max_num_reqs, N-1]
    batch = from_vllm_step(**step, lookback_token_ids=lookback)
    assert batch.lookback_token_ids is not None
    assert batch.lookback_token_ids.data_ptr() == lookback.data_ptr()  # a view
    assert batch.lookback_token_ids.tolist() == lookback[:4].tolist()


def test_vllm_two_rows_of_one_request_and_dcp_are_refused() -> None:
    step = _vllm_step()
    with pytest.raises(ValidationError, match="rows 0 and 1 both belong to request 7"):
        from_vllm_step(**step, req_idx=np.array([7, 7, 3, 3]))
    from_vllm_step(**step, req_idx=np.array([7, 3, 3, 3]))  # rows past num_reqs: padding
    with pytest.raises(ValidationError, match=r"req_idx has shape \[1\]"):
        from_vllm_step(**step, req_idx=np.array([7]))
    with pytest.raises(ValidationError, match="dcp_world_size=4; only 1 is supported"):
        from_vllm_step(**step, dcp_world_size=4, validate=False)


# SGLang --------------------------------------------------------------------------


def _pool(rows: int = 4, context: int = 12, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.permutation(1000)[: rows * context].reshape(rows, context) + 1).to(
        torch.int32
    )


def _sglang_extend() -> dict:
    return {
        "input_ids": torch.tensor([11, 12, 21, 22, 23, 31, 0, 0]),
        "req_pool_indices": torch.tensor([2, 0, 1]),
        "req_to_token": _pool(),
        "hasher": tiny_consts(),
        "extend_prefix_lens": torch.tensor([6, 0, 2], dtype=torch.int32),
        "extend_seq_lens": torch.tensor([2, 3, 1], dtype=torch.int32),
        "num_actual_tokens": 6,
    }


def test_sglang_extend_fields() -> None:
    step = _sglang_extend()
    pool = step["req_to_token"]
    batch = from_sglang_batch(**step)
    assert batch.query_start_loc.tolist() == [0, 2, 5, 6]
    # Request 0 (prefix 6) is rebased by 6 - (N-1) = 3; the others start near 0.
    assert batch.positions.tolist() == [3, 4, 0, 1, 2, 2, 0, 0]
    assert batch.slot_mapping is not None and batch.block_table is not None
    want_slots = [pool[2, 6], pool[2, 7], pool[0, 0], pool[0, 1], pool[0, 2], pool[1, 2]]
    assert batch.slot_mapping.tolist() == [int(s) for s in want_slots] + [-1, -1]
    assert batch.block_table.tolist() == [
        pool[2, 3:7].tolist(),
        pool[0, 0:4].tolist(),
        pool[1, 0:4].tolist(),
    ]


def test_sglang_padded_decode_fields() -> None:
    """Two real decode requests padded to four (pool row 0, length 1, token 0)."""
    pool = _pool()
    batch = from_sglang_batch(
        input_ids=torch.tensor([5, 6, 0, 0]),
        req_pool_indices=torch.tensor([3, 1, 0, 0]),
        req_to_token=pool,
        hasher=tiny_consts(),
        seq_lens=torch.tensor([9, 2, 1, 1]),
        num_reqs=2,
        num_actual_tokens=2,
    )
    assert batch.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    assert batch.positions.tolist() == [3, 1, 0, 0]  # 8 - (9-1-3), 1 - 0
    assert batch.slot_mapping is not None and batch.block_table is not None
    assert batch.slot_mapping.tolist() == [int(pool[3, 8]), int(pool[1, 1]), -1, -1]
    assert batch.block_table[:2].tolist() == [pool[3, 5:9].tolist(), pool[1, 0:4].tolist()]


@pytest.mark.parametrize("seed", range(4))
def test_sglang_rebased_window_hashes_like_whole_pool_rows(seed, consts, token_map) -> None:
    """Rebasing positions onto an N-column window changes no row id and no cache write."""
    rng = np.random.default_rng(seed)
    n_req, context = 3, 24
    pool = torch.from_numpy(rng.permutation(200)[: 4 * context].reshape(4, context)).to(torch.int32)
    prefix = rng.integers(0, 14, n_req)
    extend = rng.integers(0, 6, n_req)
    t_len = int(extend.sum()) + 2
    step = {
        "input_ids": torch.from_numpy(rng.integers(0, token_map.vocab_size, t_len)),
        "req_pool_indices": torch.from_numpy(rng.permutation(4)[:n_req]),
        "req_to_token": pool,
        "hasher": tiny_consts(),
        "extend_prefix_lens": torch.from_numpy(prefix),
        "extend_seq_lens": torch.from_numpy(extend),
        "dead_mask": torch.from_numpy(rng.random(t_len) < 0.1),
    }
    cache = sglang_slot_cache(200)
    codes = rng.integers(0, 99_092, 200)
    codes[rng.random(200) < 0.2] = EMPTY
    codes[rng.random(200) < 0.1] = DEAD
    cache.slots.copy_(torch.from_numpy(codes))
    rebased = from_sglang_batch(**step, cache=cache)
    # The same step with true positions and whole pool rows as its block table.
    qsl = rebased.query_start_loc
    owner = torch.searchsorted(qsl[1:], torch.arange(t_len), right=True).clamp(max=n_req - 1)
    real = torch.arange(t_len) < qsl[-1]
    true_positions = torch.where(
        real, torch.from_numpy(prefix)[owner] + torch.arange(t_len) - qsl[owner], 0
    )
    whole = HashBatch(
        input_ids=rebased.input_ids,
        positions=true_positions,
        query_start_loc=qsl,
        dead_mask=rebased.dead_mask,
        slot_mapping=rebased.slot_mapping,
        block_table=pool[step["req_pool_indices"]],
    )
    cache_whole = copy.deepcopy(cache)
    got = hash_batch_reference(rebased, consts, token_map.map, cache)
    want = hash_batch_reference(whole, consts, token_map.map, cache_whole)
    np.testing.assert_array_equal(got, want)
    assert torch.equal(cache.slots, cache_whole.slots)


_SGLANG_INVALID = [
    ({"extend_seq_lens": None}, "extend_prefix_lens was given alone"),
    (
        {"extend_seq_lens": None, "extend_prefix_lens": None},
        "seq_lens and positions are None in a decode step",
    ),
    ({"req_pool_indices": torch.tensor([2, 9, 1])}, r"req_pool_indices\[1\]=9"),
    (
        {"req_pool_indices": torch.tensor([2, 0])},
        r"extend_prefix_lens has shape \[3\]; expected \[2\]",
    ),
    (
        {"extend_prefix_lens": torch.tensor([11, 0, 2], dtype=torch.int32)},
        "request 0 reaches position 12; req_to_token has only 12 positions",
    ),
    ({"num_actual_tokens": 5}, "add up to 6; expected num_actual_tokens=5"),
    ({"num_actual_tokens": 9}, r"num_actual_tokens=9 must be in \[0, 8\]"),
    ({"num_reqs": 4}, r"num_reqs=4 must be in \[0, 3\]"),
    (
        {"extend_prefix_lens": torch.tensor([6, -1, 2], dtype=torch.int32)},
        r"extend_prefix_lens\[1\]=-1; expected >= 0",
    ),
    ({"req_to_token": torch.zeros(4, 12)}, "req_to_token has dtype torch.float32"),
    ({"hasher": 4}, r"hasher=4 \(int\); expected the NgramHasher the batch will be hashed with"),
    (
        {"lookback_token_ids": torch.zeros(3, 2, dtype=torch.int64)},
        r"lookback_token_ids has shape \[3, 2\]; expected \[\d+, 3\]",
    ),
    ({"dead_mask": torch.zeros(8, dtype=torch.int64)}, "dead_mask has dtype torch.int64"),
]


@pytest.mark.parametrize(("change", "message"), _SGLANG_INVALID)
def test_sglang_invalid_batches_name_the_field(change, message) -> None:
    step = {**_sglang_extend(), **change}
    with pytest.raises(ValidationError, match=message):
        from_sglang_batch(**step)


def test_sglang_decode_checks() -> None:
    step = {
        "input_ids": torch.tensor([5, 6]),
        "req_pool_indices": torch.tensor([3, 1]),
        "req_to_token": _pool(),
        "hasher": tiny_consts(),
        "seq_lens": torch.tensor([9, 0]),
    }
    with pytest.raises(ValidationError, match=r"seq_lens\[1\]=0 in a decode step; expected >= 1"):
        from_sglang_batch(**step)
    with pytest.raises(ValidationError, match="num_actual_tokens=1 in a decode step"):
        from_sglang_batch(**{**step, "seq_lens": torch.tensor([9, 2]), "num_actual_tokens": 1})
    with pytest.raises(ValidationError, match="input_ids has 1 rows in a decode step"):
        from_sglang_batch(**{**step, "input_ids": torch.tensor([5])})


def test_sglang_duplicate_pool_rows_are_refused() -> None:
    """Two real requests in one pool row would read and write each other's history."""
    step = {**_sglang_extend(), "req_pool_indices": torch.tensor([2, 0, 2])}
    with pytest.raises(
        ValidationError, match=r"req_pool_indices\[2\]=2 is also req_pool_indices\[0\]"
    ):
        from_sglang_batch(**step)
    # Padded requests (past num_reqs) may share row 0, as CUDA-graph runners pad them.
    decode = {
        "input_ids": torch.tensor([5, 6, 0, 0]),
        "req_pool_indices": torch.tensor([3, 1, 0, 0]),
        "req_to_token": _pool(),
        "hasher": tiny_consts(),
        "seq_lens": torch.tensor([9, 2, 1, 1]),
        "num_reqs": 2,
        "num_actual_tokens": 2,
    }
    from_sglang_batch(**decode)


def test_sglang_takes_n_from_the_hasher(consts, token_map) -> None:
    """The window is the hasher's N-1: a hasher and its constants give the same batch."""
    hasher = NgramHasher(consts, token_map, backend="reference")
    by_hasher = from_sglang_batch(**{**_sglang_extend(), "hasher": hasher})
    by_consts = from_sglang_batch(**_sglang_extend())
    assert by_hasher.block_table is not None and by_consts.block_table is not None
    assert list(by_hasher.block_table.shape) == [3, consts.max_ngram_size]
    assert torch.equal(by_hasher.block_table, by_consts.block_table)
    assert torch.equal(by_hasher.positions, by_consts.positions)
    for bad in (N, "tiny"):
        with pytest.raises(ValidationError, match=r"hasher=.*expected the NgramHasher"):
            from_sglang_batch(**{**_sglang_extend(), "hasher": bad})
    step = {k: v for k, v in _sglang_extend().items() if k != "hasher"}
    with pytest.raises(ValidationError, match=r"history_window is missing"):
        from_sglang_batch(**step)
    with pytest.raises(ValidationError, match=r"history_window and hasher are both given"):
        from_sglang_batch(**step, hasher=hasher, history_window=hasher)
    # The window itself, or any id maker that declares one, gives the same batch.
    for window in (N - 1, hasher, consts):
        by_window = from_sglang_batch(**step, history_window=window)
        assert by_window.block_table is not None
        assert torch.equal(by_window.block_table, by_consts.block_table)
    with pytest.raises(ValidationError, match=r"history_window=-1 .*or its history window N-1"):
        from_sglang_batch(**step, history_window=-1)


def test_sglang_cache_is_checked() -> None:
    with pytest.raises(ValidationError, match="block_size=4; expected 1"):
        from_sglang_batch(**_sglang_extend(), cache=vllm_slot_cache(300, 4))
    with pytest.raises(ValidationError, match="the SlotHashCache has 100 slots"):
        from_sglang_batch(**_sglang_extend(), cache=sglang_slot_cache(100))
    from_sglang_batch(**_sglang_extend(), cache=sglang_slot_cache(1001))


def test_sglang_validate_false_skips_the_checks() -> None:
    step = {**_sglang_extend(), "num_actual_tokens": 5}
    with pytest.raises(ValidationError):
        from_sglang_batch(**step)
    batch = from_sglang_batch(**step, validate=False)
    assert batch.query_start_loc.tolist() == [0, 2, 5, 5]
    # A missing field is refused even then: knowing it is missing reads nothing.
    decode = {**step, "extend_prefix_lens": None, "extend_seq_lens": None}
    with pytest.raises(ValidationError, match="seq_lens is None in a decode step"):
        from_sglang_batch(**decode, validate=False)
    with pytest.raises(ValidationError, match="extend_seq_lens was given alone"):
        from_sglang_batch(**{**step, "extend_prefix_lens": None}, validate=False)


# No host reads ------------------------------------------------------------------


def _on(device: str, step: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in step.items()}


@pytest.mark.parametrize("validate", [True, False])
def test_adapters_read_no_values_meta(validate) -> None:
    """Meta tensors carry no data: any .item(), .tolist() or data-dependent shape would raise."""
    lookback = torch.zeros(8, N - 1, dtype=torch.int64)  # a [max_num_reqs, N-1] buffer
    step = _on("meta", {**_vllm_step(), "lookback_token_ids": lookback})
    vllm = from_vllm_step(**step, image_token_id=129264, validate=validate)
    assert [vllm.num_tokens, vllm.num_requests] == [8, 4]
    assert vllm.slot_mapping is not None and vllm.slot_mapping.device.type == "meta"
    assert vllm.dead_mask is not None and vllm.dead_mask.device.type == "meta"
    assert vllm.lookback_dead is not None and list(vllm.lookback_dead.shape) == [4, N - 1]
    sglang = from_sglang_batch(**_on("meta", _sglang_extend()), validate=validate)
    assert [sglang.num_tokens, sglang.num_requests] == [8, 3]
    assert sglang.block_table is not None and list(sglang.block_table.shape) == [3, N]
    decode = {k: v for k, v in _sglang_extend().items() if not k.startswith("extend")}
    decode = {**decode, "seq_lens": torch.tensor([9, 2, 1]), "num_reqs": 2, "num_actual_tokens": 2}
    from_sglang_batch(**_on("meta", decode), validate=validate)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adapters_do_not_synchronise_cuda() -> None:
    """With the sync debug mode on "error", any host synchronisation raises."""
    vllm_step = _on("cuda", _vllm_step())
    sglang_step = _on("cuda", _sglang_extend())
    cache = sglang_slot_cache(1001, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        from_vllm_step(
            **vllm_step,
            lookback_token_ids=torch.zeros(8, N - 1, dtype=torch.int64, device="cuda"),
            image_token_id=129264,
            req_idx=np.arange(4),
            cache=vllm_slot_cache(16, 4, "cuda"),
        )
        from_sglang_batch(**sglang_step, cache=cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# KV from elsewhere -----------------------------------------------------------------


def _remote_prefill_steps(engine: str, tokens: np.ndarray, lookback: list[int] | None):
    """Positions 6..7, then 8, of a request whose first 6 positions were prefilled elsewhere."""
    lb = None if lookback is None else torch.tensor([lookback])
    if engine == "vllm":
        blocks = [3, 1, 6]
        slots = [blocks[p // 4] * 4 + p % 4 for p in range(9)]

        def step(start: int, end: int, lookback_ids) -> HashBatch:
            return from_vllm_step(
                input_ids=torch.from_numpy(tokens[start:end]),
                positions=torch.arange(start, end),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                slot_mapping=torch.tensor(slots[start:end]),
                block_table=torch.tensor([blocks], dtype=torch.int32),
                block_size=4,
                lookback_token_ids=lookback_ids,
            )

        return vllm_slot_cache(8, 4), [step(6, 8, lb), step(8, 9, None)]
    pool = _pool()

    def batch(start: int, end: int, lookback_ids) -> HashBatch:
        return from_sglang_batch(
            input_ids=torch.from_numpy(tokens[start:end]),
            req_pool_indices=torch.tensor([1]),
            req_to_token=pool,
            hasher=tiny_consts(),
            extend_prefix_lens=torch.tensor([start]),
            extend_seq_lens=torch.tensor([end - start]),
            lookback_token_ids=lookback_ids,
        )

    return sglang_slot_cache(1001), [batch(6, 8, lb), batch(8, 9, None)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_kv_from_elsewhere_needs_lookback_once(engine, backend, consts, token_map) -> None:
    """Lookback ids in the first step seed the cache; the next step finds them there."""
    tokens = np.random.default_rng(5).integers(0, token_map.vocab_size, 9)
    want = hash_sequence(token_map.compress(tokens), consts)[6:9]
    # The kernel on a GPU when there is one, else under the interpreter (conftest).
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    for lookback, exact in (([int(t) for t in tokens[5:2:-1]], True), (None, False)):
        hasher = NgramHasher(consts, token_map, device, backend=backend)
        cache, steps = _remote_prefill_steps(engine, tokens, lookback)
        cache.bind(cache.num_slots, cache.block_size, device)  # a fresh cache on that device
        got = np.concatenate(
            [hasher(b.to(device), cache).cpu().numpy().astype(np.int64) for b in steps]
        )
        # Without lookback ids (the control) the history before position 6 is unknown.
        assert np.array_equal(got, want) == exact
