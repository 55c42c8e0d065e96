"""Kernel vs reference on random ragged batches, one-shot semantics, validation."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from engramrt.config import PRESETS
from engramrt.errors import ValidationError
from engramrt.hashing import (
    HashBatch,
    HashConstants,
    NgramHasher,
    RequestHistory,
    SlotHashCache,
    hash_batch_reference,
    hash_sequence,
)
from engramrt.hashing.ops import HashKernelConfig
from engramrt.hashing.validate import check_batch_contents, check_batch_metadata


def _random_batch(rng: np.random.Generator, vocab: int, n: int, id_dtype: torch.dtype) -> HashBatch:
    lengths = rng.integers(0, 23, size=int(rng.integers(1, 9)))
    qsl = np.concatenate([[0], np.cumsum(lengths)])
    pad_rows = int(rng.integers(0, 4))
    qsl = np.concatenate([qsl, [qsl[-1]] * int(rng.integers(0, 3))]).astype(
        np.int64
    )  # padded requests
    t_len = int(qsl[-1]) + pad_rows
    starts = rng.integers(0, 9, size=qsl.shape[0] - 1)
    positions = np.zeros(t_len, dtype=np.int64)
    for r in range(qsl.shape[0] - 1):
        positions[qsl[r] : qsl[r + 1]] = starts[r] + np.arange(qsl[r + 1] - qsl[r])
    lookback = rng.integers(0, vocab, size=(qsl.shape[0] - 1, n - 1))
    lookback[rng.random(lookback.shape) < 0.3] = -1
    return HashBatch(
        input_ids=torch.tensor(rng.integers(0, vocab, size=t_len), dtype=id_dtype),
        positions=torch.from_numpy(positions),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        dead_mask=torch.from_numpy(rng.random(t_len) < 0.1),
        lookback_token_ids=torch.from_numpy(lookback),
        lookback_dead=torch.from_numpy(rng.random(lookback.shape) < 0.1),
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_kernel_matches_reference_on_random_batches(
    seed, id_dtype, consts, token_map, device
) -> None:
    rng = np.random.default_rng(seed)
    batch = _random_batch(rng, token_map.vocab_size, consts.max_ngram_size, id_dtype)
    want = hash_batch_reference(batch, consts, token_map.map)
    hasher = NgramHasher(
        consts,
        token_map,
        device,
        backend="triton",
        out_dtype=torch.int64,
        kernel_config=HashKernelConfig(block_t=int(rng.choice([16, 32, 64]))),
    )
    shape = (batch.num_tokens, consts.n_layers, consts.n_cols)
    out = torch.full(shape, -1, dtype=torch.int64, device=device)
    batch = batch.to(device)
    got = hasher(batch, out=out)  # poisoned: an unwritten element fails
    assert got.data_ptr() == out.data_ptr()
    np.testing.assert_array_equal(got.cpu().numpy(), want)
    # Every row id lands inside its column's bucket range.
    offs, primes = consts.offsets[None], consts.col_primes[None]
    assert ((want >= offs) & (want < offs + primes)).all()


def test_int32_output_equals_int64(consts, token_map, device) -> None:
    batch = _random_batch(np.random.default_rng(3), token_map.vocab_size, 4, torch.int64)
    batch = batch.to(device)
    h32 = NgramHasher(consts, token_map, device, backend="triton")
    h64 = NgramHasher(consts, token_map, device, backend="triton", out_dtype=torch.int64)
    assert h32.out_dtype == torch.int32
    np.testing.assert_array_equal(
        h32(batch).cpu().numpy().astype(np.int64), h64(batch).cpu().numpy()
    )


def test_one_shot_semantics_by_hand(consts, token_map) -> None:
    """Check hash_sequence against SPEC §4 written out for one token with Python ints."""
    ids = np.array([17, 5, 99, 3, 42], dtype=np.int64)
    dead = np.array([False, False, True, False, False])
    got = hash_sequence(ids, consts, dead)
    pad, m = consts.pad_id, [int(v) for v in consts.multipliers[1]]
    # Position 4: values 42, 3, then the dead token at 2 blocks shifts 2 and 3.
    values = [42, 3, pad, pad]
    for k in range(1, 4):
        rolling = 0
        for s in range(k + 1):
            rolling ^= values[s] * m[s]
        for h in range(consts.n_heads):
            col = (k - 1) * consts.n_heads + h
            want = rolling % int(consts.col_primes[1, col]) + int(consts.offsets[1, col])
            assert got[4, 1, col] == want
    # Position 0: only its own id; shifts 1.. are before the start.
    rolling0 = 17 * m[0] ^ pad * m[1]
    assert got[0, 1, 0] == rolling0 % int(consts.col_primes[1, 0])


def test_v41_flash_row_ids_fit_int32(token_map) -> None:
    consts = HashConstants.from_config(PRESETS["dsv41-flash"], token_map)
    assert consts.max_row_id < 2**31
    ids = np.random.default_rng(0).integers(0, 99_092, 64)
    out = hash_sequence(ids, consts)
    assert out.max() < 384_016_682 and out.min() >= 0


def test_empty_batch(consts, token_map, device) -> None:
    for backend in ("reference", "triton"):
        dev = device if backend == "triton" else torch.device("cpu")
        hasher = NgramHasher(consts, token_map, dev, backend=backend)
        batch = HashBatch(
            input_ids=torch.zeros(0, dtype=torch.int64, device=dev),
            positions=torch.zeros(0, dtype=torch.int64, device=dev),
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
        )
        assert hasher(batch).shape == (0, 2, 12)
        # Nothing written: a poisoned buffer around the empty output keeps its poison, and
        # the same buffer with one token does get that token's one-shot ids (the control).
        buffer = torch.full((2, 2, 12), -1, dtype=torch.int64, device=dev)
        assert hasher(batch, out=buffer[:0]).shape == (0, 2, 12)
        assert bool((buffer == -1).all())
        one = HashBatch.single(np.array([17]), device=dev)
        hasher(one, out=buffer[:1])
        assert (
            buffer[0].cpu().numpy().tolist()
            == hash_sequence(token_map.map[[17]], consts)[0].tolist()
        )
        assert bool((buffer[1] == -1).all())


# Fields whose type, shape, dtype or device is wrong: the metadata half (validate).
BAD_METADATA = [
    (
        lambda b: setattr(b, "input_ids", torch.tensor([1.0, 2.0, 3.0])),
        "input_ids has dtype torch.float32; expected torch.int32 or torch.int64",
    ),
    (
        lambda b: setattr(b, "positions", torch.tensor([0.0, 1.0, 2.0])),
        "positions has dtype torch.float32; expected torch.int32 or torch.int64",
    ),
    (
        lambda b: setattr(b, "query_start_loc", torch.tensor([0, 3], dtype=torch.int16)),
        "query_start_loc has dtype torch.int16; expected torch.int32 or torch.int64",
    ),
    (lambda b: setattr(b, "positions", torch.tensor([0, 1])), "positions has shape [2]"),
    (
        lambda b: setattr(b, "lookback_token_ids", torch.zeros(1, 2, dtype=torch.int64)),
        "lookback_token_ids has shape [1, 2]; expected [1, 3]",
    ),
    (
        lambda b: setattr(b, "lookback_token_ids", torch.zeros(1, 3)),
        "lookback_token_ids has dtype torch.float32; expected torch.int32 or torch.int64",
    ),
    (lambda b: setattr(b, "dead_mask", torch.zeros(2, dtype=torch.bool)), "dead_mask has shape"),
    (
        lambda b: setattr(b, "dead_mask", torch.tensor([0, 2, 0], dtype=torch.uint8)),
        "dead_mask has dtype torch.uint8; expected torch.bool",
    ),
    (
        lambda b: setattr(b, "dead_mask", torch.tensor([0.0, 0.5, 0.0])),
        "dead_mask has dtype torch.float32; expected torch.bool",
    ),
    (
        lambda b: (
            setattr(b, "lookback_token_ids", torch.zeros(1, 3, dtype=torch.int64)),
            setattr(b, "lookback_dead", torch.ones(1, 3, dtype=torch.int32)),
        ),
        "lookback_dead has dtype torch.int32; expected torch.bool",
    ),
]

# Values that break the contract: the content half (check_ids, synchronises).
BAD_CONTENT = [
    (lambda b: setattr(b, "input_ids", torch.tensor([1, 2, 129_280])), "input_ids[2]=129280"),
    (lambda b: setattr(b, "query_start_loc", torch.tensor([0, 2, 1, 3])), "non-decreasing"),
    (lambda b: setattr(b, "query_start_loc", torch.tensor([0, 4])), "exceeds"),
    (lambda b: setattr(b, "query_start_loc", torch.tensor([1, 3])), "query_start_loc[0]=1"),
    (lambda b: setattr(b, "positions", torch.tensor([0, 2, 3])), "not consecutive"),
    (lambda b: setattr(b, "positions", torch.tensor([-1, 0, 1])), "is negative"),
    (
        lambda b: setattr(b, "lookback_token_ids", torch.full((1, 3), -5)),
        "lookback_token_ids holds",
    ),
]


@pytest.mark.parametrize(("change", "needle"), BAD_METADATA)
def test_bad_fields_are_named_by_validate(change, needle, consts, token_map) -> None:
    batch = HashBatch.single([1, 2, 3])
    change(batch)
    hasher = NgramHasher(consts, token_map, backend="reference")  # validate on, check_ids off
    with pytest.raises(ValidationError) as info:
        hasher(batch)
    assert needle in str(info.value)
    with pytest.raises(ValidationError, match=re.escape(needle)):
        check_batch_metadata(batch, max_ngram_size=consts.max_ngram_size)


@pytest.mark.parametrize(("change", "needle"), BAD_CONTENT)
def test_bad_values_are_named_by_check_ids_only(change, needle, consts, token_map) -> None:
    """The metadata half passes whatever the values (it reads none); the content half
    names the bad one."""
    batch = HashBatch.single([1, 2, 3])
    change(batch)
    check_batch_metadata(batch, max_ngram_size=consts.max_ngram_size)  # no error
    with pytest.raises(ValidationError) as info:
        check_batch_contents(
            batch, vocab_size=token_map.map.shape[0], max_ngram_size=consts.max_ngram_size
        )
    assert needle in str(info.value)
    hasher = NgramHasher(consts, token_map, backend="reference", check_ids=True)
    with pytest.raises(ValidationError, match=re.escape(needle)):
        hasher(batch)


def test_a_good_batch_passes_both_halves(consts, token_map) -> None:
    """Control for the two tests above: the unchanged batch raises nothing."""
    batch = HashBatch.single([1, 2, 3])
    batch.dead_mask = torch.tensor([False, True, False])
    batch.lookback_token_ids = torch.tensor([[5, -1, 7]])
    batch.lookback_dead = torch.tensor([[False, False, True]])
    check_batch_metadata(batch, max_ngram_size=consts.max_ngram_size)
    check_batch_contents(
        batch, vocab_size=token_map.map.shape[0], max_ngram_size=consts.max_ngram_size
    )
    NgramHasher(consts, token_map, backend="reference", check_ids=True)(batch)


def test_history_inputs_are_checked(consts, token_map) -> None:
    hasher = NgramHasher(consts, token_map, backend="reference", check_ids=True)
    batch = HashBatch.single([1, 2, 3], start=5)
    with pytest.raises(ValidationError, match="slot_mapping and block_table"):
        hasher(batch, SlotHashCache(16, 4))
    batch.slot_mapping = torch.tensor([5, 6, 99])
    batch.block_table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    with pytest.raises(ValidationError, match="slot_mapping holds"):
        hasher(batch, SlotHashCache(16, 4))
    with pytest.raises(ValidationError, match="request_slots"):
        hasher(batch, RequestHistory(2, 4))
    batch.request_slots = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValidationError, match="request_slots holds"):
        hasher(batch, RequestHistory(2, 4))
    with pytest.raises(ValidationError, match="num_slots=10 must be a multiple"):
        SlotHashCache(10, 4)
    with pytest.raises(ValidationError, match="window=2"):
        RequestHistory(2, 4, window=2)


def test_rebinding_discards_history() -> None:
    cache = SlotHashCache(16, 4)
    cache.slots[3] = 77
    cache.bind(32, 8)
    assert cache.num_slots == 32 and bool((cache.slots == -1).all())


@pytest.mark.parametrize("seed", range(4))
def test_torch_baseline_matches_reference(seed, consts, token_map) -> None:
    from engramrt.hashing.vectorized import hash_batch_torch

    batch = _random_batch(np.random.default_rng(100 + seed), token_map.vocab_size, 4, torch.int64)
    want = hash_batch_reference(batch, consts, token_map.map)
    got = hash_batch_torch(batch, consts, torch.from_numpy(token_map.map))
    np.testing.assert_array_equal(got.numpy(), want)
