"""Row ids hashed on the host (``hash_batch_host``) are the reference's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch, NgramHasher, hash_batch_reference
from engramrt.hashing.host import check_host_batch, hash_batch_host

from .test_hash_kernel import _random_batch


def _variant(batch: HashBatch, rng: np.random.Generator) -> HashBatch:
    """``batch`` with each optional field dropped at random (every combination is a contract)."""
    for name in ("dead_mask", "lookback_token_ids", "lookback_dead"):
        if rng.random() < 0.3:
            setattr(batch, name, None)
    return batch


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_host_hash_matches_reference(seed, consts, token_map) -> None:
    rng = np.random.default_rng(seed)
    batch = _variant(
        _random_batch(rng, token_map.vocab_size, consts.max_ngram_size, torch.int64), rng
    )
    want = hash_batch_reference(batch, consts, token_map.map)
    np.testing.assert_array_equal(hash_batch_host(batch, consts, token_map.map), want)
    layer = int(rng.integers(consts.n_layers))
    np.testing.assert_array_equal(
        hash_batch_host(batch, consts, token_map.map, [layer]), want[:, [layer]]
    )


def test_negative_control_a_wrong_lookback_changes_the_ids(consts, token_map) -> None:
    """The property above can fail: the host's ids follow the lookback ids they are given."""
    rng = np.random.default_rng(5)
    batch = _random_batch(rng, token_map.vocab_size, consts.max_ngram_size, torch.int64)
    batch.dead_mask = batch.lookback_dead = None
    want = hash_batch_reference(batch, consts, token_map.map)
    assert batch.lookback_token_ids is not None
    batch.lookback_token_ids = torch.where(
        batch.lookback_token_ids >= 0, (batch.lookback_token_ids + 1) % token_map.vocab_size, 7
    )
    got = hash_batch_host(batch, consts, token_map.map)
    assert (got != want).any()


def test_decode_batch_of_the_full_layout(token_map) -> None:
    """A decode step (one token per request, lookback ids) of DeepSeek-V4.1-Flash's layout."""
    from engramrt.config import PRESETS
    from engramrt.hashing import HashConstants

    consts = HashConstants.from_config(PRESETS["dsv41-flash"], token_map)
    rng = np.random.default_rng(9)
    n_req = 64
    lookback = rng.integers(0, token_map.vocab_size, (n_req, consts.max_ngram_size - 1))
    lookback[rng.random(lookback.shape) < 0.1] = -1
    batch = HashBatch(
        input_ids=torch.from_numpy(rng.integers(0, token_map.vocab_size, n_req)),
        positions=torch.from_numpy(rng.integers(0, 5, n_req)),
        query_start_loc=torch.arange(n_req + 1, dtype=torch.int32),
        lookback_token_ids=torch.from_numpy(lookback),
    )
    want = hash_batch_reference(batch, consts, token_map.map)
    np.testing.assert_array_equal(hash_batch_host(batch, consts, token_map.map), want)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_hasher_on_host_matches_hasher_on_device(id_dtype, consts, token_map, device) -> None:
    rng = np.random.default_rng(3)
    batch = _random_batch(rng, token_map.vocab_size, consts.max_ngram_size, id_dtype)
    hasher = NgramHasher(consts, token_map, device, out_dtype=torch.int64)
    on_device = hasher(batch.to(device)).cpu().numpy()
    np.testing.assert_array_equal(hasher.hash_on_host(batch), on_device)
    np.testing.assert_array_equal(hasher.hash_on_host(batch, [1]), on_device[:, [1]])
    with pytest.raises(ValidationError, match=r"layers=\[2\]; expected Engram layer positions"):
        hasher.hash_on_host(batch, [2])


def test_check_host_batch_names_what_does_not_fit(token_map) -> None:
    device_batch = HashBatch.single([5, 6, 7], start=4)
    host = HashBatch.single([5, 6, 7], start=4)
    host.lookback_token_ids = torch.tensor([[3, 2, 1]])
    check_host_batch(host, device_batch, has_history=True)  # fits
    check_host_batch(HashBatch.single([5, 6, 7], start=4), device_batch, has_history=False)
    with pytest.raises(ValidationError, match="host_batch is a list; expected a HashBatch"):
        check_host_batch([5, 6, 7], device_batch, has_history=False)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"host_batch has 2 tokens and 1 requests"):
        check_host_batch(HashBatch.single([5, 6]), device_batch, has_history=False)
    with pytest.raises(ValidationError, match=r"host_batch.dead_mask is set and batch.dead_mask"):
        masked = HashBatch.single([5, 6, 7], start=4)
        masked.dead_mask = torch.zeros(3, dtype=torch.bool)
        check_host_batch(masked, device_batch, has_history=False)
    with pytest.raises(ValidationError, match=r"no lookback_token_ids, but request 0 starts at"):
        check_host_batch(HashBatch.single([5, 6, 7], start=4), device_batch, has_history=True)
    host.lookback_token_ids = torch.tensor([[3, -1, 1]])
    with pytest.raises(ValidationError, match=r"lookback_token_ids\[0, 1\] = -1 \(position 2\)"):
        check_host_batch(host, device_batch, has_history=True)
    # A chunk at position 1 needs one lookback id only.
    near_start = HashBatch.single([5, 6], start=1)
    near_start.lookback_token_ids = torch.tensor([[3, -1, -1]])
    check_host_batch(near_start, HashBatch.single([5, 6], start=1), has_history=True)


def test_check_host_batch_refuses_a_device_batch(token_map) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a device to hold the batch")
    batch = HashBatch.single([5, 6, 7], device="cuda")
    with pytest.raises(ValidationError, match=r"host_batch is on cuda:0; expected"):
        check_host_batch(batch, batch, has_history=False)


@pytest.mark.parametrize(
    "fields",
    [
        {"input_ids": [], "positions": [], "query_start_loc": [0]},  # no tokens
        {"input_ids": [5, 6, 7], "positions": [0, 0, 0], "query_start_loc": [0]},  # all padding
        {"input_ids": [5, 6, 7], "positions": [-2, -1, 0], "query_start_loc": [0, 3]},
        {  # ids outside the vocabulary, in the chunk and the lookback ids: clamped
            "input_ids": [5, -6, 10**9],
            "positions": [4, 5, 6],
            "query_start_loc": [0, 3],
            "lookback_token_ids": [[10**9, -5, 3]],
        },
    ],
    ids=["empty", "padding", "negative-positions", "outside-vocabulary"],
)
def test_host_hash_edge_batches(fields, consts, token_map) -> None:
    """Batches outside the common case hash as the reference defines them."""
    tensors = {
        name: torch.tensor(value, dtype=torch.int32 if name == "query_start_loc" else torch.int64)
        for name, value in fields.items()
    }
    batch = HashBatch(**tensors)
    want = hash_batch_reference(batch, consts, token_map.map)
    np.testing.assert_array_equal(hash_batch_host(batch, consts, token_map.map), want)
