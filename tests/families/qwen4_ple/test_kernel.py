"""The PLE row-id kernel (``PleHasher``, backend triton) against its torch reference.

Integer results compare bit for bit; outputs are poisoned with -1 before the kernel runs
so an unwritten element fails. Batches are ragged (empty chunks, padding rows, decode
batches), with EOS inside chunks and contexts, int32 and int64 inputs, every launch
variant (tokens per program, request scan or binary search, float64 or integer
remainders, speculated decode contexts), the shipped hash constants and an EOS past the
vocabulary (wrapping products, negative mixes). Runs through Triton's interpreter on CPU
and on ``ENGRAMRT_TEST_DEVICE`` (``cuda`` on a GPU machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple.config import PleConfig
from engramrt.families.qwen4_ple.ids import (
    PleIdContext,
    layer_multipliers,
    ple_row_ids,
    ple_row_ids_batch_reference,
)
from engramrt.families.qwen4_ple.ops import PleHasher
from engramrt.hashing.config import HashKernelConfig

from .test_ids import tiny

# Launch variants: (block_t, num_warps, scan_tile, fast_mod, speculate_decode).
VARIANTS = {
    "decode-scan": HashKernelConfig(block_t=4, num_warps=1, scan_tile=8192),
    "wide-search": HashKernelConfig(
        block_t=64, num_warps=4, scan_tile=0, fast_mod=False, speculate_decode=False
    ),
    "one-token-search": HashKernelConfig(block_t=1, num_warps=1, scan_tile=0),
}


def shipped(**changes: object) -> PleConfig:
    """The default hash constants (V = 248,320, head sizes from 20,000,003), two PLE layers."""
    fields: dict[str, object] = {
        "ple_layer_ids": (2, 5),
        "ple_embed_dim": 64,
        "eos_token_id": 248_044,
        "num_hidden_layers": 8,
        "layer_types": ("linear_attention",) * 8,
    }
    fields.update(changes)
    return PleConfig(**fields)  # type: ignore[arg-type]


def eos_with_negative_mix(cfg: PleConfig, start: int) -> int:
    """The first id >= ``start`` whose all-EOS mix is negative in int64 for some PLE layer
    and order (products wrap): the floor-modulo case the kernel must get right."""
    multipliers = np.array(
        [layer_multipliers(cfg.vocab_size, cfg.ngram_size, i, cfg.seed) for i in range(2)],
        dtype=np.uint64,
    )
    for eos in range(start, start + 1000):
        mixes = np.bitwise_xor.accumulate((np.uint64(eos) * multipliers).view(np.int64), axis=1)
        if (mixes < 0).any():
            return eos
    raise AssertionError("no EOS id with a negative mix found")


CONFIGS = {
    "tiny": tiny(),
    "tiny-fast-mod": tiny(
        ngram_vocab_size_base=4096, ngram_size=4, heads_per_ngram=3, ple_embed_dim=18
    ),
    "shipped": shipped(),
    # An EOS past the vocabulary: products wrap and mixes go negative (floor modulo).
    "eos-past-vocab": tiny(eos_token_id=97 + 100_000, ngram_vocab_size_base=5000),
    "shipped-eos-past-vocab": shipped(eos_token_id=eos_with_negative_mix(shipped(), 2 * 248_320)),
}


def random_step(
    rng: np.random.Generator, cfg: PleConfig, *, decode: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ragged step: chunks of 0..9 tokens (of one with ``decode``), 0..3 padding rows,
    EOS at ~15% of tokens and context entries, contexts of fresh and running requests."""
    n_req = int(rng.integers(1 if decode else 0, 9))
    lengths = np.ones(n_req, dtype=np.int64) if decode else rng.integers(0, 10, size=n_req)
    padding = int(rng.integers(0, 4))
    n_tokens = int(lengths.sum()) + padding
    ids = rng.integers(0, cfg.vocab_size, size=n_tokens)
    ids[rng.random(n_tokens) < 0.15] = cfg.eos
    contexts = rng.integers(0, cfg.vocab_size, size=(n_req, cfg.ngram_size - 1))
    contexts[rng.random(contexts.shape) < 0.15] = cfg.eos
    qsl = np.concatenate([[0], np.cumsum(lengths)])
    return torch.from_numpy(ids), torch.from_numpy(qsl), torch.from_numpy(contexts)


def poisoned(hasher: PleHasher, n_tokens: int, n_req: int, device: torch.device):
    out = torch.full((n_tokens, hasher.n_layers, hasher.n_cols), -1, dtype=hasher.out_dtype)
    nxt = torch.full((n_req, hasher.ngram_size - 1), -1, dtype=torch.int64)
    return out.to(device), nxt.to(device)


@pytest.fixture(scope="module")
def hashers(device: torch.device) -> dict[str, PleHasher]:
    return {name: PleHasher(cfg, device, backend="triton") for name, cfg in CONFIGS.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_equals_the_reference_on_ragged_steps(
    name: str, variant: str, hashers: dict[str, PleHasher], device: torch.device
) -> None:
    cfg, hasher = CONFIGS[name], hashers[name]
    hasher.kernel_config = VARIANTS[variant]
    rng = np.random.default_rng(abs(hash((name, variant))) % 2**32)
    for step in range(4):
        ids, qsl, ctx = random_step(rng, cfg, decode=step == 3)
        id_dtype = (torch.int32, torch.int64)[step % 2]
        ids, qsl = ids.to(id_dtype), qsl.to((torch.int64, torch.int32)[step % 2])
        want_rows, want_next = ple_row_ids_batch_reference(ids, qsl, ctx, hasher.consts, cfg.eos)
        out, nxt = poisoned(hasher, ids.shape[0], ctx.shape[0], device)
        rows, next_context = hasher(
            ids.to(device), qsl.to(device), ctx.to(device), out=out, next_context=nxt
        )
        assert rows.data_ptr() == out.data_ptr() and next_context.data_ptr() == nxt.data_ptr()
        torch.testing.assert_close(rows.cpu(), want_rows, rtol=0, atol=0)
        torch.testing.assert_close(next_context.cpu(), want_next, rtol=0, atol=0)


def test_fast_mod_runs_where_head_sizes_allow_it(hashers: dict[str, PleHasher]) -> None:
    """The float64 remainder is used only where every head size is >= 4096."""
    assert not hashers["tiny"]._sizes_allow_fast_mod
    assert hashers["tiny-fast-mod"]._sizes_allow_fast_mod
    assert hashers["shipped-eos-past-vocab"]._sizes_allow_fast_mod


def test_eos_past_the_vocabulary_reaches_negative_mixes(hashers: dict[str, PleHasher]) -> None:
    """The wrapping case is exercised: some mix of an EOS past V is negative in int64."""
    for name in ("eos-past-vocab", "shipped-eos-past-vocab"):
        consts = hashers[name].consts
        eos = CONFIGS[name].eos
        products = (np.uint64(eos) * consts.multipliers.astype(np.uint64)).view(np.int64)
        mixes = np.bitwise_xor.accumulate(products, axis=1)
        assert (mixes < 0).any(), name


def test_streamed_requests_equal_one_shot(hashers: dict[str, PleHasher], device) -> None:
    """Three interleaved requests, chunked differently, carried through the kernel's
    next contexts, give each request's one-shot rows."""
    cfg, hasher = CONFIGS["tiny"], hashers["tiny"]
    hasher.kernel_config = None
    rng = np.random.default_rng(5)
    requests = [rng.integers(0, cfg.vocab_size, size=n) for n in (17, 9, 12)]
    for request in requests:
        request[rng.random(request.shape[0]) < 0.2] = cfg.eos
    schedule = [[5, 1, 0], [3, 2, 6], [1, 1, 1], [0, 5, 5], [8, 0, 0]]
    done = [0, 0, 0]
    contexts = hasher.start_contexts(3)
    got: list[list[torch.Tensor]] = [[], [], []]
    for step in schedule:
        chunks = [requests[r][done[r] : done[r] + step[r]] for r in range(3)]
        qsl = np.concatenate([[0], np.cumsum([len(c) for c in chunks])])
        ids = torch.from_numpy(np.concatenate(chunks)).to(device)
        rows, contexts = hasher(ids, torch.from_numpy(qsl).to(device), contexts)
        for r in range(3):
            got[r].append(rows[qsl[r] : qsl[r + 1]].cpu())
            done[r] += len(chunks[r])
    for r, request in enumerate(requests):
        assert done[r] == len(request)
        want = ple_row_ids(request, hasher.consts, cfg.eos)
        np.testing.assert_array_equal(torch.cat(got[r]).numpy(), want)
        after = PleIdContext.from_history(request.tolist(), cfg.ngram_size, cfg.eos)
        assert contexts[r].tolist() == list(after.token_ids)


def test_control_contexts_not_carried_change_rows(hashers: dict[str, PleHasher], device) -> None:
    """Negative control: the second chunk hashed from a fresh context is not the one-shot."""
    cfg, hasher = CONFIGS["tiny"], hashers["tiny"]
    request = np.array([11, 12, 13, 14, 15, 16])
    qsl = torch.tensor([0, 3], device=device)
    first = torch.from_numpy(request[:3]).to(device)
    _, carried = hasher(first, qsl, hasher.start_contexts(1))
    second = torch.from_numpy(request[3:]).to(device)
    right, _ = hasher(second, qsl, carried)
    wrong, _ = hasher(second, qsl, hasher.start_contexts(1))
    want = ple_row_ids(request, hasher.consts, cfg.eos)[3:]
    np.testing.assert_array_equal(right.cpu().numpy(), want)
    assert not np.array_equal(wrong.cpu().numpy(), want)


def test_empty_step_and_only_empty_chunks(hashers: dict[str, PleHasher], device) -> None:
    hasher = hashers["tiny"]
    ctx = torch.tensor([[1, 2], [7, 3]], device=device)
    rows, nxt = hasher(
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros(3, dtype=torch.int64, device=device),
        ctx,
    )
    assert rows.shape == (0, 3, 4) and torch.equal(nxt, ctx)
    rows, nxt = hasher(
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
        ctx[:0],
    )
    assert rows.shape == (0, 3, 4) and nxt.shape == (0, 2)


def test_int32_rows(device) -> None:
    cfg = CONFIGS["shipped"]
    hasher = PleHasher(cfg, device, backend="triton", out_dtype=torch.int32)
    rng = np.random.default_rng(3)
    ids, qsl, ctx = random_step(rng, cfg)
    rows, _ = hasher(ids.to(device), qsl.to(device), ctx.to(device))
    want, _ = ple_row_ids_batch_reference(ids, qsl, ctx, hasher.consts, cfg.eos)
    assert rows.dtype == torch.int32
    assert torch.equal(rows.cpu().long(), want)


def test_reference_backend_is_the_reference() -> None:
    cfg = CONFIGS["tiny"]
    hasher = PleHasher(cfg, backend="reference")
    ids, qsl, ctx = random_step(np.random.default_rng(8), cfg)
    rows, nxt = hasher(ids, qsl, ctx)
    want_rows, want_next = ple_row_ids_batch_reference(ids, qsl, ctx, hasher.consts, cfg.eos)
    assert torch.equal(rows, want_rows) and torch.equal(nxt, want_next)


def test_refuses_bad_arguments() -> None:
    hasher = PleHasher(CONFIGS["tiny"], backend="reference", check_ids=True)
    ids, qsl, ctx = torch.arange(4), torch.tensor([0, 3, 4]), torch.full((2, 2), 7)
    with pytest.raises(ValidationError, match=r"token_ids has shape \[4\] dtype torch.float32"):
        hasher(ids.float(), qsl, ctx)
    with pytest.raises(ValidationError, match=r"context_token_ids has shape \[2, 3\]"):
        hasher(ids, qsl, torch.full((2, 3), 7))
    with pytest.raises(ValidationError, match=r"out has shape \[4, 3, 5\]"):
        hasher(ids, qsl, ctx, out=torch.empty(4, 3, 5, dtype=torch.int64))
    with pytest.raises(ValidationError, match="next_context shares memory"):
        hasher(ids, qsl, ctx, next_context=ctx)
    with pytest.raises(ValidationError, match=r"query_start_loc=\[0, 3, 2\]"):
        hasher(ids, torch.tensor([0, 3, 2]), ctx)
    with pytest.raises(ValidationError, match=r"query_start_loc\[-1\]=5; expected at most T=4"):
        hasher(ids, torch.tensor([0, 3, 5]), ctx)
    with pytest.raises(ValidationError, match=r"token_ids holds 97 at flat index 1"):
        hasher(torch.tensor([1, 97, 2, 3]), qsl, ctx)
    with pytest.raises(ValidationError, match=r"context_token_ids holds -1"):
        hasher(ids, qsl, torch.tensor([[7, 7], [-1, 7]]))
    with pytest.raises(ValidationError, match=r"out_dtype=torch\.int16"):
        PleHasher(CONFIGS["tiny"], out_dtype=torch.int16)
    with pytest.raises(ValidationError, match="PLE off"):
        PleHasher(tiny(ple_layer_ids=()))
    # An EOS past the vocabulary is accepted as EOS (it is hashed, not gathered).
    eos_far = PleHasher(CONFIGS["eos-past-vocab"], backend="reference", check_ids=True)
    eos_far(torch.tensor([1, 97 + 100_000]), torch.tensor([0, 2]), torch.tensor([[5, 6]]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_equals_the_reference() -> None:
    """Captured once at fixed addresses, replayed on new steps of the same shape."""
    cfg = CONFIGS["shipped"]
    hasher = PleHasher(cfg, "cuda", backend="triton")
    n_req = 64
    ids = torch.zeros(n_req, dtype=torch.int64, device="cuda")
    qsl = torch.arange(n_req + 1, dtype=torch.int32, device="cuda")
    ctx = hasher.start_contexts(n_req)
    out = torch.empty(n_req, hasher.n_layers, hasher.n_cols, dtype=torch.int64, device="cuda")
    nxt = torch.empty(n_req, cfg.ngram_size - 1, dtype=torch.int64, device="cuda")
    hasher(ids, qsl, ctx, out=out, next_context=nxt)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hasher(ids, qsl, ctx, out=out, next_context=nxt)
    rng = np.random.default_rng(9)
    for _ in range(3):
        new_ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, size=n_req))
        new_ctx = torch.from_numpy(rng.integers(0, cfg.vocab_size, size=(n_req, 2)))
        ids.copy_(new_ids)
        ctx.copy_(new_ctx)
        graph.replay()
        want, want_next = ple_row_ids_batch_reference(
            new_ids, qsl.cpu(), new_ctx, hasher.consts, cfg.eos
        )
        assert torch.equal(out.cpu(), want) and torch.equal(nxt.cpu(), want_next)
