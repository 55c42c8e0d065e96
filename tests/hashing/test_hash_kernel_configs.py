"""Every launch setting of the hash kernel gives the reference's row ids, bit for bit.

The settings (tokens per program, warps, request search by vector scan or
binary search, float64 or integer remainders, the request ring written in the
hash launch or by a second kernel) change speed only; each is checked here on
random ragged batches with padding rows and padded requests, on engine
schedules in every history mode, and, for the remainder, on adversarial
values next to multiples of the primes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from engramrt.config import PRESETS
from engramrt.errors import ValidationError
from engramrt.hashing import (
    HashBatch,
    HashConstants,
    NgramHasher,
    RequestHistory,
    hash_batch_reference,
)
from engramrt.hashing.config import HashKernelConfig, kernel_config_for
from engramrt.hashing.kernel import _mod_prime
from engramrt.testing import MODES, run_schedules

CONFIGS = {
    "bt8w1-scan": HashKernelConfig(block_t=8, num_warps=1),
    "bt16w2-scan": HashKernelConfig(block_t=16, num_warps=2),
    "bt32w4-bsearch": HashKernelConfig(block_t=32, num_warps=4, scan_tile=0),
    "bt16w1-tile-too-small": HashKernelConfig(block_t=16, num_warps=1, scan_tile=128),
    "bt64w4-intmod": HashKernelConfig(block_t=64, fast_mod=False),
    "bt16w2-no-ring-commit": HashKernelConfig(block_t=16, num_warps=2, ring_commit=False),
    "bt16w2-no-speculation": HashKernelConfig(block_t=16, num_warps=2, speculate_decode=False),
}


def _ragged_batch(rng: np.random.Generator, vocab: int, n: int, n_req: int) -> HashBatch:
    """Requests of 0..22 tokens (odd sizes), padded requests and padding rows, dead tokens."""
    lengths = rng.integers(0, 23, size=n_req)
    qsl = np.concatenate([[0], np.cumsum(lengths)])
    qsl = np.concatenate([qsl, [qsl[-1]] * int(rng.integers(1, 3))]).astype(np.int64)
    t_len = int(qsl[-1]) + int(rng.integers(1, 5))  # padding rows after the last request
    positions = np.zeros(t_len, dtype=np.int64)
    for r in range(qsl.shape[0] - 1):
        positions[qsl[r] : qsl[r + 1]] = rng.integers(0, 9) + np.arange(qsl[r + 1] - qsl[r])
    lookback = rng.integers(0, vocab, size=(qsl.shape[0] - 1, n - 1))
    lookback[rng.random(lookback.shape) < 0.3] = -1
    return HashBatch(
        input_ids=torch.tensor(rng.integers(0, vocab, size=t_len)),
        positions=torch.from_numpy(positions),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        dead_mask=torch.from_numpy(rng.random(t_len) < 0.1),
        lookback_token_ids=torch.from_numpy(lookback),
        lookback_dead=torch.from_numpy(rng.random(lookback.shape) < 0.1),
    )


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n_req", [1, 5, 37])
def test_every_config_matches_reference(name, n_req, consts, token_map, device) -> None:
    """37 requests need a 64-wide scan tile: too wide for a 128-element tile, so binary search."""
    config = CONFIGS[name]
    rng = np.random.default_rng(n_req * 101 + len(name))
    batch = _ragged_batch(rng, token_map.vocab_size, consts.max_ngram_size, n_req)
    want = hash_batch_reference(batch, consts, token_map.map)
    hasher = NgramHasher(
        consts, token_map, device, backend="triton", out_dtype=torch.int64, kernel_config=config
    )
    shape = (batch.num_tokens, consts.n_layers, consts.n_cols)
    out = torch.full(shape, -1, dtype=torch.int64, device=device)  # poisoned
    got = hasher(batch.to(device), out=out)
    np.testing.assert_array_equal(got.cpu().numpy(), want)


def _decode_batch(rng: np.random.Generator, vocab: int, n: int, lengths: list[int]) -> HashBatch:
    """Chunks of the given lengths (1: a decode token), two padded requests, padding rows."""
    qsl = np.concatenate([[0], np.cumsum(lengths), [sum(lengths)] * 2]).astype(np.int64)
    t_len = int(qsl[-1]) + 3
    positions = np.zeros(t_len, dtype=np.int64)
    for r in range(qsl.shape[0] - 1):
        # Starts 0..4 too: lookback columns before position 0 must be ignored.
        positions[qsl[r] : qsl[r + 1]] = (
            rng.integers(0, 5) * (r % 2) * 7 + r % 4 + np.arange(qsl[r + 1] - qsl[r])
        )
    lookback = rng.integers(0, vocab, size=(qsl.shape[0] - 1, n - 1))
    lookback[rng.random(lookback.shape) < 0.2] = -1
    return HashBatch(
        input_ids=torch.tensor(rng.integers(0, vocab, size=t_len)),
        positions=torch.from_numpy(positions),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        dead_mask=torch.from_numpy(rng.random(t_len) < 0.1),
        lookback_token_ids=torch.from_numpy(lookback),
        lookback_dead=torch.from_numpy(rng.random(lookback.shape) < 0.2),
    )


@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize(
    "lengths",
    [
        [1] * 37,  # pure decode: every guess right
        [1] * 9 + [0] + [1] * 6,  # an empty request shifts the rest: guesses wrong after it
        [1] * 5 + [13] + [1] * 4,  # decode first, then a prefill chunk, then more decode
        [3, 1, 1, 2, 1],  # speculative drafts beside decode tokens
        [1],
    ],
)
def test_decode_batches_with_and_without_speculation(
    speculate, lengths, consts, token_map, device
) -> None:
    rng = np.random.default_rng(len(lengths) * 7 + sum(lengths))
    batch = _decode_batch(rng, token_map.vocab_size, consts.max_ngram_size, lengths)
    want = hash_batch_reference(batch, consts, token_map.map)
    for block_t in (8, 32):
        config = HashKernelConfig(block_t=block_t, num_warps=1, speculate_decode=speculate)
        hasher = NgramHasher(
            consts, token_map, device, backend="triton", out_dtype=torch.int64, kernel_config=config
        )
        out = torch.full((batch.num_tokens, consts.n_layers, consts.n_cols), -1, device=device)
        got = hasher(batch.to(device), out=out.to(torch.int64))
        np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_scan_width_follows_the_tile_bound() -> None:
    config = HashKernelConfig(block_t=16, scan_tile=4096)
    assert [config.scan_width(r) for r in (0, 1, 16, 17, 256, 257)] == [16, 16, 16, 32, 256, 0]
    assert HashKernelConfig(scan_tile=0).scan_width(1) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["bt8w1-scan", "bt32w4-bsearch", "bt16w2-no-ring-commit"])
@pytest.mark.parametrize("seed", [3, 29])
def test_schedules_match_one_shot_under_each_config(
    mode, name, seed, consts, token_map, device
) -> None:
    hasher = NgramHasher(
        consts, token_map, device, backend="triton", check_ids=True, kernel_config=CONFIGS[name]
    )
    (engine,) = run_schedules(
        [seed], mode, "triton", consts, token_map, max_steps=8, device=device, hasher=hasher
    )
    assert not engine.mismatches, engine.mismatches


class _CountingLauncher:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        self.inner(*args, **kwargs)


@pytest.mark.parametrize(("window", "chunk"), [(19, 8), (19, 9), (3, 1), (5, 1), (5, 2)])
@pytest.mark.parametrize("ring_commit", [True, False])
def test_request_ring_written_in_the_hash_launch_only_when_safe(
    window, chunk, ring_commit, consts, token_map, device
) -> None:
    """Two requests decode ``chunk`` tokens each after a first step; the ring ends as the
    reference commit leaves it, and the second kernel runs only when T > window - (N-1)."""
    n = consts.max_ngram_size
    rng = np.random.default_rng(window * 31 + chunk)
    config = HashKernelConfig(block_t=16, num_warps=2, ring_commit=ring_commit)
    hasher = NgramHasher(consts, token_map, device, backend="triton", kernel_config=config)
    store = RequestHistory(4, n, window=window, device=device)
    mirror = RequestHistory(4, n, window=window)
    seqs = rng.integers(0, token_map.vocab_size, size=(2, 3 * chunk))
    slots = torch.tensor([2, 0], dtype=torch.int32)
    for step in range(3):
        lo, hi = step * chunk, (step + 1) * chunk
        t_len = 2 * chunk
        batch = HashBatch(
            input_ids=torch.from_numpy(seqs[:, lo:hi].reshape(-1).copy()),
            positions=torch.from_numpy(np.tile(np.arange(lo, hi), 2)),
            query_start_loc=torch.tensor([0, chunk, t_len], dtype=torch.int32),
            dead_mask=torch.from_numpy(rng.random(t_len) < 0.1),
            request_slots=slots,
        )
        want = hash_batch_reference(batch, consts, token_map.map, mirror)
        mirror.commit_reference(batch, token_map.map)
        if hasher._launchers is not None:
            hasher._launchers = (hasher._launchers[0], _CountingLauncher(hasher._launchers[1]))
        got = hasher(batch.to(device), store)
        np.testing.assert_array_equal(got.cpu().numpy().astype(np.int64), want)
        np.testing.assert_array_equal(store.slots.cpu().numpy(), mirror.slots.numpy())
        np.testing.assert_array_equal(store.tags.cpu().numpy(), mirror.tags.numpy())
        if step > 0:
            commit = hasher._launchers[1]
            fused = ring_commit and t_len <= window - (n - 1)
            assert isinstance(commit, _CountingLauncher)
            assert commit.calls == (0 if fused else 1)


@triton.jit
def _mod_probe_kernel(x_ptr, prime_ptr, inv_ptr, out_ptr, n, FAST_MOD: tl.constexpr):
    idx = tl.arange(0, 1024)
    ok = idx < n
    x = tl.load(x_ptr + idx, mask=ok, other=0)
    prime = tl.load(prime_ptr + idx, mask=ok, other=1)
    inv = tl.load(inv_ptr + idx, mask=ok, other=0.0)
    tl.store(out_ptr + idx, _mod_prime(x, prime, inv, FAST_MOD), mask=ok)


def test_float_remainder_is_exact_next_to_multiples_of_primes(token_map, device) -> None:
    """Values at k*p-1, k*p, k*p+1 (largest k with k*p+1 < 2**63, and random k), 0 and
    2**63-1, for the smallest allowed primes and the V4.1-Flash ones."""
    flash = HashConstants.from_config(PRESETS["dsv41-flash"], token_map)
    # Any divisor >= 4096 keeps the bound; these include the largest below 2**31.
    primes = [4099, 4111, 65_537, 2_147_483_647, *flash.col_primes.reshape(-1)[:8].tolist()]
    rng = np.random.default_rng(0)
    xs, ps = [], []
    top = 2**63 - 1
    for p in primes:
        for k in [top // p - 1, *rng.integers(1, top // p - 1, size=20).tolist()]:
            for d in (-1, 0, 1):
                xs.append(int(k) * p + d)
                ps.append(p)
        xs += [0, top, top - 1, int(rng.integers(0, top))]
        ps += [p] * 4
    assert len(xs) <= 1024 and min(xs) >= 0 and max(xs) <= top
    x = torch.tensor(xs, dtype=torch.int64)
    prime = torch.tensor(ps, dtype=torch.int64)
    inv = torch.from_numpy(1.0 / np.array(ps, dtype=np.float64))
    want = np.array([a % b for a, b in zip(xs, ps, strict=True)], dtype=np.int64)
    for fast in (True, False):
        out = torch.full_like(x, -1, device=device)
        _mod_probe_kernel[(1,)](
            x.to(device), prime.to(device), inv.to(device), out, len(xs), FAST_MOD=fast
        )
        np.testing.assert_array_equal(out.cpu().numpy(), want)


def test_control_a_quotient_off_by_more_than_one_is_caught(token_map, device) -> None:
    """Negative control: a reciprocal 2**-40 too large (quotient off by up to ~2**23/p
    near 2**63) makes the single correction fail, so the probe above can fail."""
    p = 4099
    xs = [(2**63 - 1) // p * p - 1, (2**63 - 1) // p * p]
    x = torch.tensor(xs, dtype=torch.int64, device=device)
    prime = torch.full((2,), p, dtype=torch.int64, device=device)
    inv = torch.full((2,), (1.0 / p) * (1 + 2**-40), dtype=torch.float64, device=device)
    out = torch.full_like(x, -1)
    _mod_probe_kernel[(1,)](x, prime, inv, out, 2, FAST_MOD=True)
    assert (out.cpu().numpy() != np.array([a % p for a in xs])).any()


def test_default_table_and_config_errors(consts, token_map) -> None:
    for t_len in (0, 1, 256, 8192, 65_536, 2**31):
        assert isinstance(kernel_config_for(t_len), HashKernelConfig)
    assert kernel_config_for(256) is kernel_config_for(256, "an unknown GPU")  # the default file
    with pytest.raises(ValidationError, match=r"block_t=24 must be a power of two"):
        HashKernelConfig(block_t=24)
    with pytest.raises(ValidationError, match=r"num_warps=0 must be a positive power of two"):
        HashKernelConfig(num_warps=0)
    with pytest.raises(ValidationError, match=r"scan_tile=-1 must be >= 0"):
        HashKernelConfig(scan_tile=-1)
    with pytest.raises(ValidationError, match=r"kernel_config=64 must be a HashKernelConfig"):
        NgramHasher(consts, token_map, kernel_config=64)  # type: ignore[arg-type]
