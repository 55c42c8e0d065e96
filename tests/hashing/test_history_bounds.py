"""History entries outside their store, with ``check_ids`` off: defined, masked, never out of bounds.

Every history load and store of the hash kernel is masked to the history's
bounds; the reference defines the result (an entry outside the store is
unknown and hashes as pad; nothing is written outside it) and the kernel
matches it bit for bit. The stores sit inside larger buffers filled with a
guard value, so a read outside them hashes a wrong id and a write outside
them changes a guard. Tokens of requests whose history is out of bounds are
decode tokens (chunks of one), so their expected ids are also those of a
token at position 0 of a sequence (:func:`hash_sequence`): no history at all.

Runs on ``ENGRAMRT_TEST_DEVICE`` (CPU through the interpreter by default).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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
from engramrt.hashing.reference import clamp_token_ids

ROOT = Path(__file__).resolve().parents[2]
GUARD = 64  # guard elements on each side of a store
GUARD_CODE = 777  # a compressed id nothing writes: reading it changes the row ids
BLOCK = 4
NUM_BLOCKS = 8
NUM_SLOTS = BLOCK * NUM_BLOCKS


def guarded(store: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, view)``: a copy of ``store`` inside a buffer with ``GUARD`` elements of
    ``fill`` on each side; the view replaces the store so stray accesses hit the guards."""
    buffer = torch.full((GUARD + store.numel() + GUARD,), fill, dtype=store.dtype)
    buffer = buffer.to(store.device)
    view = buffer[GUARD : GUARD + store.numel()]
    view.copy_(store)
    return buffer, view


def guards_intact(buffer: torch.Tensor, fill: int) -> bool:
    host = buffer.cpu()
    return bool((host[:GUARD] == fill).all() and (host[-GUARD:] == fill).all())


def no_history_ids(consts: HashConstants, token_map, token_id: int) -> np.ndarray:
    """Row ids ``[L, C]`` of a token with no known history (position 0 of a sequence)."""
    code = token_map.map[clamp_token_ids(token_id, token_map.vocab_size)]
    return hash_sequence(np.array([code]), consts)[0]


def slot_cache_with_history(device, token_map) -> tuple[SlotHashCache, torch.Tensor]:
    """A guarded cache whose every slot holds a known compressed id."""
    cache = SlotHashCache(NUM_SLOTS, BLOCK, device)
    rng = np.random.default_rng(5)
    codes = token_map.map[rng.integers(0, token_map.vocab_size, NUM_SLOTS)]
    cache.slots.copy_(torch.from_numpy(codes.astype(np.int32)))
    buffer, view = guarded(cache.slots, GUARD_CODE)
    cache.slots = view
    return cache, buffer


# Request layout of the slot-cache batch: five decode tokens.
#   0: valid history (blocks 0..2), writes slot 9
#   1: block ids just past the cache and negative in its window; slot past the cache
#   2: a position (40) whose block column is past the table's width; slot -5
#   3: huge block id; slot just below 0 (-2), token id -7
#   4: valid history, token id V + 5, lookback ids with one past V; block table outside
SLOT_BAD = [1, 2, 3]


def slot_batch(vocab: int, device) -> HashBatch:
    input_ids = torch.tensor([11, 12, 13, -7, vocab + 5])
    positions = torch.tensor([9, 6, 40, 5, 3])
    qsl = torch.arange(6, dtype=torch.int32)
    table = torch.tensor(
        [
            [0, 1, 2, 3],
            [NUM_BLOCKS, -3, NUM_BLOCKS + 1, 0],
            [0, 1, 2, 3],
            [10**6, 10**6, 0, 0],
            [NUM_BLOCKS, -1, 0, 0],
        ]
    )
    slot_mapping = torch.tensor([9, NUM_SLOTS + 2, -5, -2, -1])
    lookback = torch.tensor(
        [[-1, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1], [vocab + 1, 7, 8]]
    )
    batch = HashBatch(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=qsl,
        lookback_token_ids=lookback,
        slot_mapping=slot_mapping,
        block_table=table,
    )
    return batch.to(device)


@pytest.mark.parametrize("block_t", [16, 64])
def test_slot_cache_entries_outside_the_cache_are_masked(
    block_t: int, consts, token_map, device
) -> None:
    cache, buffer = slot_cache_with_history(device, token_map)
    ref_cache, ref_buffer = slot_cache_with_history(torch.device("cpu"), token_map)
    batch = slot_batch(token_map.vocab_size, device)
    want = hash_batch_reference(batch.to("cpu"), consts, token_map.map, ref_cache)
    hasher = NgramHasher(
        consts,
        token_map,
        device,
        backend="triton",
        out_dtype=torch.int64,
        kernel_config=HashKernelConfig(block_t=block_t),
    )
    out = torch.full((5, consts.n_layers, consts.n_cols), -1, dtype=torch.int64, device=device)
    got = hasher(batch, cache, out=out).cpu().numpy()
    np.testing.assert_array_equal(got, want)
    # Independently: a token whose history is outside the cache has no history.
    for r in SLOT_BAD:
        np.testing.assert_array_equal(
            want[r], no_history_ids(consts, token_map, int(batch.input_ids[r]))
        )
    assert not np.array_equal(
        want[0], no_history_ids(consts, token_map, int(batch.input_ids[0]))
    )  # the control: request 0's history is read
    # Only slot 9 was written (request 0), nothing outside the cache; the same as the reference.
    assert guards_intact(buffer, GUARD_CODE) and guards_intact(ref_buffer, GUARD_CODE)
    np.testing.assert_array_equal(cache.slots.cpu().numpy(), ref_cache.slots.numpy())
    assert int(cache.slots[9]) == int(token_map.map[11])


def ring_history(device, window: int) -> tuple[RequestHistory, list[torch.Tensor]]:
    history = RequestHistory(3, 4, window=window, device=device)
    rng = np.random.default_rng(6)
    history.slots.copy_(torch.from_numpy(rng.integers(0, 1000, history.slots.numel())))
    buffers = []
    for name, fill in (("slots", GUARD_CODE), ("tags", 5)):  # tag 5: a position asked for
        buffer, view = guarded(getattr(history, name), fill)
        setattr(history, name, view)
        buffers.append(buffer)
    return history, buffers


def ring_batch(vocab: int, device, chunk: int) -> HashBatch:
    """Request 0 has a valid ring; 1..3 name rings past the end, below 0 and far away."""
    lengths = [chunk, 1, 1, 1]
    qsl = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    t_len = int(qsl[-1])
    positions = torch.cat([torch.arange(5, 5 + chunk), torch.tensor([8, 8, 8])])
    rng = np.random.default_rng(7)
    input_ids = torch.from_numpy(rng.integers(0, vocab, t_len))
    input_ids[-1] = -3  # an id below the vocabulary: clamped to 0
    return HashBatch(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=qsl,
        request_slots=torch.tensor([1, 3, -1, 10**6]),
    ).to(device)


@pytest.mark.parametrize(
    ("window", "chunk"),
    [(19, 2), (4, 6)],  # ring written in the hash launch (RING_COMMIT) / by the commit kernel
)
def test_request_slots_outside_the_rings_are_masked(
    window: int, chunk: int, consts, token_map, device
) -> None:
    history, buffers = ring_history(device, window)
    ref_history, ref_buffers = ring_history(torch.device("cpu"), window)
    batch = ring_batch(token_map.vocab_size, device, chunk)
    want = hash_batch_reference(batch.to("cpu"), consts, token_map.map, ref_history)
    hasher = NgramHasher(consts, token_map, device, backend="triton", out_dtype=torch.int64)
    out = torch.full(
        (batch.num_tokens, consts.n_layers, consts.n_cols), -1, dtype=torch.int64, device=device
    )
    got = hasher(batch, history, out=out).cpu().numpy()
    np.testing.assert_array_equal(got, want)
    for i in range(chunk, chunk + 3):
        np.testing.assert_array_equal(
            want[i], no_history_ids(consts, token_map, int(batch.input_ids[i]))
        )
    assert all(guards_intact(b, f) for b, f in zip(buffers, (GUARD_CODE, 5), strict=True))
    assert all(guards_intact(b, f) for b, f in zip(ref_buffers, (GUARD_CODE, 5), strict=True))
    np.testing.assert_array_equal(history.slots.cpu().numpy(), ref_history.slots.numpy())
    np.testing.assert_array_equal(history.tags.cpu().numpy(), ref_history.tags.numpy())


def test_invalid_token_ids_follow_one_rule_on_both_backends(consts, token_map, device) -> None:
    """Ids outside [0, V) are clamped to 0 / V - 1 by the kernel and the reference alike."""
    vocab = token_map.vocab_size
    bad = HashBatch.single(np.array([5, -1, vocab, vocab + 10**6, 9, -(2**31)]), device=device)
    clamped = HashBatch.single(np.array([5, 0, vocab - 1, vocab - 1, 9, 0]), device=device)
    want = hash_batch_reference(clamped.to("cpu"), consts, token_map.map)
    for backend in ("triton", "reference"):
        dev = device if backend == "triton" else torch.device("cpu")
        hasher = NgramHasher(consts, token_map, dev, backend=backend, out_dtype=torch.int64)
        got = hasher(bad.to(dev)).cpu().numpy()
        np.testing.assert_array_equal(got, want, err_msg=backend)


CHILD = """
import os, torch
from engramrt.config import PRESETS
from engramrt.hashing import HashBatch, HashConstants, NgramHasher, RequestHistory, SlotHashCache
from engramrt.tokenmap import TokenMap
device = torch.device(os.environ.get("ENGRAMRT_TEST_DEVICE", "cpu"))
token_map = TokenMap.from_tokenizer_file()
consts = HashConstants.from_config(PRESETS["tiny"], token_map)
hasher = NgramHasher(consts, token_map, device, backend="triton")
huge = 10_000_000
cache = SlotHashCache(32, 4, device)
batch = HashBatch(
    input_ids=torch.tensor([1, 2, 3]), positions=torch.tensor([9, 10, 2]),
    query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
    slot_mapping=torch.tensor([huge, -huge, 100 * huge]),
    block_table=torch.tensor([[huge, huge, huge, 0], [-huge, -huge, 0, 0]]),
).to(device)
a = hasher(batch, cache)
history = RequestHistory(2, 4, device=device)
rings = HashBatch(
    input_ids=torch.tensor([1, 2, 3]), positions=torch.tensor([4, 5, 7]),
    query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
    request_slots=torch.tensor([huge, -huge]),
).to(device)
b = hasher(rings, history)
if device.type == "cuda":
    torch.cuda.synchronize()
assert (cache.slots.cpu() == -1).all() and (history.slots.cpu() == -1).all()
print("ok", int(a.sum()), int(b.sum()))
"""


def test_ten_million_past_the_history_is_neither_read_nor_written() -> None:
    """The audit's SIGSEGV: a real process hashes entries 10**7 past every store and exits 0."""
    inherited = os.environ.get("PYTHONPATH")
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), *([inherited] if inherited else [])])
    env = {**os.environ, "PYTHONPATH": path}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.startswith("ok"), (
        done.returncode,
        done.stderr[-3000:],
    )
