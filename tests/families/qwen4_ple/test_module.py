"""``PleLayer`` (the GPU-ready PLE layer op) against ``ple_layer_reference_varlen``.

What is compared, and how:

- ``backend="reference"`` (the vectorised torch path, the kernels' definition) equals the
  per-sequence reference **bit for bit** in bf16 on the CPU: each step is the same torch
  operation on the same values, and a bf16 GEMM on the CPU gives the same bits for any
  number of rows. In fp32 the CPU's GEMM does not (one row takes another kernel than
  many), so fp32 is within :func:`ple_layer_tolerance`.
- The kernels (``backend="triton"``, through the interpreter on the CPU): the gathered rows
  and the state pool's copy are compared **bit for bit** with their references (copies).
  The layer's output in fp32 is within :func:`ple_layer_tolerance`, the derived bound on two
  fp32 implementations (the kernels sum the norms and the score in another order and
  evaluate ``exp`` themselves; bit equality is not promised).
- In bf16 the kernels round every step as the reference does, computing each step in fp32
  in their own order. Why they may still differ: the GEMM's E products summed in another
  order (on a GPU, tensor cores rounding toward zero), the norms' and the score's D-sums
  in another tree, ``rsqrt``/``sqrt``/``exp`` within a few fp32 ulps, the conv's K taps in
  another order; each moves an fp32 value by at most its derived error (``2 (n + 2) u
  sum|terms|`` for a sum of n terms, ``u = 2^-24``; a few ``u`` for a function), and that
  moves the bf16 rounding only where a rounding boundary lies within it, then by one bf16
  ulp, which the following steps carry on. :func:`ple_layer_enclosure` follows exactly
  this: an interval per value, each step's exact result over its inputs' intervals,
  widened by the step's fp32 error and rounded at both ends (derivation in layer.py, above
  the function). Every value of such an implementation lies in it, the reference's
  included; :func:`assert_within_enclosure` asserts that for out and for the states, and
  reports how many values differ from the reference's bits only as information. At these
  sizes the enclosure is mostly a single value, so a real mistake leaves it: the controls
  below (a conv rounded per tap, a gate computed in fp32 and rounded once, a wrong tap)
  fail the same function on the CPU.
- Negative controls: a wrong dilation, a stale or zeroed state and a state left unwritten
  each fail the same checks.

Runs on ``ENGRAMRT_TEST_DEVICE`` (default CPU, kernels through ``TRITON_INTERPRET=1``); the
CUDA-graph and inductor tests need a GPU.
"""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple.layer import (
    PleLayerEnclosure,
    PleLayerWeights,
    assert_within_enclosure,
    ple_conv_state_len,
    ple_layer_enclosure,
    ple_layer_reference_varlen,
    ple_layer_tolerance,
)
from engramrt.families.qwen4_ple.module import (
    PleKernelConfig,
    PleLayer,
    PleTable,
    gather_ple_rows,
    gather_ple_rows_reference,
    ple_conv_varlen_reference,
    ple_gate_norm_reference,
    update_ple_conv_states,
    update_ple_conv_states_reference,
)
from engramrt.family import BF16
from engramrt.gate.reference import assert_within_tolerance
from engramrt.lookup.tiers import DeviceOptions, TablePlacement, make_store

HC, D, K, N, EPS = 2, 32, 4, 3, 1e-6
HEADS, ROW_WIDTH = 4, 8  # C, d
E, WIDTH = HEADS * ROW_WIDTH, HC * D
S = ple_conv_state_len(K, N)  # 9
TABLE_ROWS = 997
SMALL = PleKernelConfig(gather_pairs=8, conv_tokens=4, conv_width=32, state_width=32)
"""Small tiles, so the interpreter's grids have several programs along each axis."""

CPU = torch.device("cpu")


def make_weights(dtype: torch.dtype, seed: int = 0) -> PleLayerWeights:
    """Random weights (norm weights and taps non-zero, so ``1 + w`` and the conv count)."""
    g = torch.Generator().manual_seed(seed)
    return PleLayerWeights(
        key_proj=torch.randn(WIDTH, E, generator=g) / E**0.5,
        value_proj=torch.randn(D, E, generator=g) / E**0.5,
        norm_key=0.3 * torch.randn(WIDTH, generator=g),
        norm_query=0.3 * torch.randn(WIDTH, generator=g),
        norm_conv=0.3 * torch.randn(WIDTH, generator=g),
        conv1d=0.6 * torch.randn(WIDTH, 1, K, generator=g),
    ).to(dtype)


def make_table(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TABLE_ROWS, ROW_WIDTH, generator=g).bfloat16()


class Batch:
    """One step's inputs on the CPU: ``lengths`` per sequence, ``padding`` rows after
    ``query_start_loc[B]``, states of running sequences in a pool at permuted slots."""

    def __init__(
        self,
        lengths: list[int],
        dtype: torch.dtype,
        *,
        seed: int,
        padding: int = 0,
        masked: float = 0.0,
        fresh: bool = False,
        num_slots: int | None = None,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = lengths
        real = sum(lengths)
        self.num_tokens = real + padding
        self.query_start_loc = torch.tensor([0, *itertools.accumulate(lengths)])
        self.hidden = torch.randn(self.num_tokens, WIDTH, generator=g).to(dtype)
        # Row ids as PleHasher writes them, [T, L, C]; this layer's [:, 1, :] is strided.
        self.all_row_ids = torch.randint(0, TABLE_ROWS, (self.num_tokens, 2, HEADS), generator=g)
        self.row_ids = self.all_row_ids[:, 1, :]
        self.token_mask = None
        if masked:
            self.token_mask = torch.rand(self.num_tokens, generator=g) >= masked
        num_slots = num_slots or 2 * len(lengths) + 1
        self.pool = torch.randn(num_slots, S, WIDTH, generator=g).to(dtype)
        self.state_slots = torch.randperm(num_slots, generator=g)[: len(lengths)]
        if fresh:
            self.pool[self.state_slots] = 0

    def rows(self, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[T, E]`` each token's rows concatenated (what the reference takes)."""
        return table[self.row_ids].reshape(self.num_tokens, E).to(dtype)

    def expected(
        self, weights: PleLayerWeights, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference on the real tokens: ``(out [T_real, W], new states [B, S, W])``."""
        real = int(self.query_start_loc[-1])
        mask = None if self.token_mask is None else self.token_mask[:real]
        return ple_layer_reference_varlen(
            self.hidden[:real],
            self.rows(table, weights.dtype)[:real],
            weights,
            query_start_loc=self.query_start_loc,
            ngram_size=N,
            eps=EPS,
            conv_states=self.pool[self.state_slots],
            token_mask=mask,
        )

    def run(
        self, layer: PleLayer, device: torch.device, *, index_dtype: torch.dtype = torch.int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, pool after the step)`` on the CPU; out poisoned with NaN beforehand."""
        pool = self.pool.to(device, copy=True)
        out = torch.full((self.num_tokens, WIDTH), float("nan"), dtype=layer.dtype, device=device)
        mask = None if self.token_mask is None else self.token_mask.to(device)
        layer(
            self.hidden.to(device),
            self.all_row_ids.to(device)[:, 1, :].to(index_dtype),
            self.query_start_loc.to(device, index_dtype),
            pool,
            self.state_slots.to(device, index_dtype),
            token_mask=mask,
            out=out,
        )
        return out.cpu(), pool.cpu()

    def enclosure(self, weights: PleLayerWeights, table: torch.Tensor) -> PleLayerEnclosure:
        """:func:`ple_layer_enclosure` of the step's real tokens (16-bit weights)."""
        real = int(self.query_start_loc[-1])
        mask = None if self.token_mask is None else self.token_mask[:real]
        return ple_layer_enclosure(
            self.hidden[:real],
            self.rows(table, weights.dtype)[:real],
            weights,
            query_start_loc=self.query_start_loc,
            ngram_size=N,
            eps=EPS,
            conv_states=self.pool[self.state_slots],
            token_mask=mask,
        )

    def bound(
        self, weights: PleLayerWeights, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`ple_layer_tolerance` of each sequence's chunk with its state."""
        exacts, bounds = [], []
        rows = self.rows(table, weights.dtype)
        for seq, (start, stop) in enumerate(itertools.pairwise(self.query_start_loc.tolist())):
            mask = None if self.token_mask is None else self.token_mask[start:stop]
            exact, bound = ple_layer_tolerance(
                self.hidden[start:stop],
                rows[start:stop],
                weights,
                ngram_size=N,
                eps=EPS,
                conv_state=self.pool[self.state_slots[seq]],
                token_mask=mask,
            )
            exacts.append(exact)
            bounds.append(bound)
        return torch.cat(exacts), torch.cat(bounds)


def assert_same_bits(found: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """Equal shapes, dtypes and bits (NaN included); the first differences in the message."""
    assert found.shape == expected.shape and found.dtype == expected.dtype, (
        f"{label}: {found.dtype} {tuple(found.shape)} != {expected.dtype} {tuple(expected.shape)}"
    )
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[found.element_size()]
    differ = (found.view(bits) != expected.view(bits)).nonzero()
    if differ.numel():
        first = ", ".join(
            f"{tuple(i)}: {found[tuple(i)].item()!r} != {expected[tuple(i)].item()!r}"
            for i in differ[:6].tolist()
        )
        raise AssertionError(f"{label}: {differ.shape[0]} of {found.numel()} differ; {first}")


def assert_bf16_within(
    found: torch.Tensor,
    expected: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    label: str,
) -> None:
    """A bf16 implementation and the reference both inside the enclosure ``[low, high]``
    (:func:`ple_layer_enclosure`; the module doc says why that is the bound)."""
    assert_within_enclosure(expected, low, high, label=f"{label} (the reference)")
    assert_within_enclosure(found, low, high, label=label, reference=expected)


def check_layer_out(
    out: torch.Tensor,
    batch: Batch,
    weights: PleLayerWeights,
    table: torch.Tensor,
    *,
    exact_bits: bool,
    label: str,
) -> None:
    """``out`` (all T rows) against the reference: padding rows 0; real rows bit for bit
    (``exact_bits``), else fp32 within the derived bound / bf16 within the enclosure."""
    real = int(batch.query_start_loc[-1])
    assert not out[real:].any(), f"{label}: padding rows are not 0"
    expected, _ = batch.expected(weights, table)
    if exact_bits:
        assert_same_bits(out[:real], expected, label)
    elif weights.dtype == torch.float32:
        exact, bound = batch.bound(weights, table)
        assert_within_tolerance(out[:real], exact, bound, label=label)
        assert_within_tolerance(expected, exact, bound, label=f"{label} (the reference)")
    else:
        enclosure = batch.enclosure(weights, table)
        assert_bf16_within(out[:real], expected, enclosure.out_low, enclosure.out_high, label)


def check_pool(
    pool: torch.Tensor,
    batch: Batch,
    expected_states: torch.Tensor,
    label: str,
    *,
    weights: PleLayerWeights,
    table: torch.Tensor,
):
    """The step's slots hold the expected states; every other pool row is untouched."""
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[batch.state_slots] = False
    assert_same_bits(pool[others], batch.pool[others], f"{label}: rows of other slots")
    found = pool[batch.state_slots]
    if found.dtype == torch.bfloat16:
        enclosure = batch.enclosure(weights, table)
        assert_bf16_within(found, expected_states, enclosure.states_low,
                           enclosure.states_high, f"{label}: states")  # fmt: skip
    else:
        # b in fp32 (no derived bound of its own: the streaming test bounds what it feeds).
        torch.testing.assert_close(found, expected_states, rtol=1e-5, atol=1e-6)


STEPS = {
    # name: (lengths, padding rows, masked fraction)
    "ragged-with-empty": ([5, 0, 13, 1, 2, 0], 0, 0.0),
    "decode": ([1] * 7, 0, 0.0),
    "longer-than-S": ([23, 11], 0, 0.0),
    "shorter-than-S": ([2, 4, 3, 8], 0, 0.0),
    "masked-with-padding-rows": ([6, 10, 3], 3, 0.3),
    "all-empty": ([0, 0], 2, 0.0),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("step", list(STEPS))
def test_reference_backend_is_the_reference(step: str, dtype: torch.dtype) -> None:
    """The vectorised torch path, on the CPU: bf16 bit for bit, out and states."""
    lengths, padding, masked = STEPS[step]
    weights, table = make_weights(dtype), make_table()
    layer = PleLayer(weights, table, ngram_size=N, eps=EPS, backend="reference")
    batch = Batch(lengths, dtype, seed=len(step), padding=padding, masked=masked)
    out, pool = batch.run(layer, CPU)
    _, states = batch.expected(weights, table)
    exact = dtype == torch.bfloat16
    check_layer_out(out, batch, weights, table, exact_bits=exact, label=step)
    if exact:
        assert_same_bits(pool[batch.state_slots], states, f"{step}: states")
    else:
        check_pool(pool, batch, states, step, weights=weights, table=table)


KERNEL_STEPS = ["ragged-with-empty", "decode", "masked-with-padding-rows"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("step", KERNEL_STEPS)
def test_kernels_meet_the_reference(step: str, dtype: torch.dtype, device) -> None:
    """The Triton path: fp32 within the derived bound, bf16 agreeing (module doc)."""
    lengths, padding, masked = STEPS[step]
    weights, table = make_weights(dtype), make_table()
    layer = PleLayer(
        weights.to(device=device),
        table.to(device),
        ngram_size=N,
        eps=EPS,
        backend="triton",
        kernel_config=SMALL,
    )
    batch = Batch(lengths, dtype, seed=7 + len(step), padding=padding, masked=masked)
    out, pool = batch.run(layer, device, index_dtype=torch.int32 if masked else torch.int64)
    check_layer_out(out, batch, weights, table, exact_bits=False, label=f"{step} {dtype}")
    check_pool(pool, batch, batch.expected(weights, table)[1], f"{step} {dtype}", weights=weights,
               table=table)  # fmt: skip


# Three sequences of 20 tokens: chunks longer and shorter than S = 9, empty chunks and a
# run of decode steps.
SCHEDULE = [[12, 0, 3], [1, 5, 0], [0, 11, 14], [3, 1, 1], [1, 1, 1], [3, 2, 1]]
SCHEDULE_LEN = 20


def one_shot(weights, table, hidden, row_ids) -> torch.Tensor:
    """Each sequence's 20 tokens in one reference call, stacked ``[3, 20, W]``."""
    rows = table[row_ids].reshape(-1, E).to(weights.dtype)
    return torch.stack(
        [
            ple_layer_reference_varlen(
                hidden[s],
                rows,
                weights,
                query_start_loc=torch.tensor([0, SCHEDULE_LEN]),
                ngram_size=N,
                eps=EPS,
            )[0]
            for s in range(3)
        ]
    )


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("reference", torch.bfloat16), ("triton", torch.bfloat16), ("triton", torch.float32)],
)
def test_state_carried_across_calls_equals_one_shot(backend: str, dtype, device) -> None:
    """Streamed in the schedule's chunks, each sequence's outputs are its one-shot ones:
    bit for bit on the reference path, within the checks of the kernels otherwise (a
    sequence streamed is bounded by the one-shot computation, ple_layer_tolerance's doc)."""
    assert all(sum(step[s] for step in SCHEDULE) == SCHEDULE_LEN for s in range(3))
    weights, table = make_weights(dtype, seed=3), make_table(seed=4)
    g = torch.Generator().manual_seed(5)
    # The same ids for every sequence, different hidden streams.
    row_ids = torch.randint(0, TABLE_ROWS, (SCHEDULE_LEN, HEADS), generator=g)
    hidden = torch.randn(3, SCHEDULE_LEN, WIDTH, generator=g).to(dtype)
    run_device = CPU if backend == "reference" else device
    layer = PleLayer(
        weights.to(device=run_device),
        table.to(run_device),
        ngram_size=N,
        eps=EPS,
        backend=backend,
        kernel_config=SMALL,
    )
    outs, _ = stream_each(layer, hidden, row_ids, run_device)
    want = one_shot(weights, table, hidden, row_ids)
    for s in range(3):
        label = f"sequence {s} streamed"
        if backend == "reference":
            assert_same_bits(outs[s], want[s], label)
        elif dtype == torch.float32:
            rows = table[row_ids].reshape(-1, E).float()
            exact, bound = ple_layer_tolerance(hidden[s], rows, weights, ngram_size=N, eps=EPS)
            assert_within_tolerance(outs[s], exact, bound, label=label)
        else:
            rows = table[row_ids].reshape(-1, E).to(dtype)
            enclosure = ple_layer_enclosure(hidden[s], rows, weights,
                                            query_start_loc=torch.tensor([0, SCHEDULE_LEN]),
                                            ngram_size=N, eps=EPS)  # fmt: skip
            assert_bf16_within(outs[s], want[s], enclosure.out_low, enclosure.out_high, label)


def stream_each(layer: PleLayer, hidden, row_ids, device):
    """:func:`stream` with sequence s reading ``hidden[s]`` and the shared ``row_ids``."""
    slots = torch.tensor([4, 0, 2], device=device)
    pool = layer.new_conv_states(5)
    done = [0, 0, 0]
    outs: list[list[torch.Tensor]] = [[], [], []]
    for step in SCHEDULE:
        hid = torch.cat([hidden[s, done[s] : done[s] + n] for s, n in enumerate(step)])
        ids = torch.cat([row_ids[done[s] : done[s] + n] for s, n in enumerate(step)])
        qsl = torch.tensor([0, *itertools.accumulate(step)], device=device)
        out = layer(hid.to(device), ids.to(device), qsl, pool, slots).cpu()
        for s, n in enumerate(step):
            outs[s].append(out[int(qsl[s]) : int(qsl[s]) + n])
            done[s] += n
    return [torch.cat(o) for o in outs], pool.cpu()


# --------------------------------------------------------------------------
# Negative controls: the checks above fail on the mistakes a varlen conv invites.
# --------------------------------------------------------------------------


def test_control_wrong_dilation_fails(device) -> None:
    """A conv at dilation 2 (its own state length 6, so the pool fits) fails the bf16
    bit check and the fp32 bound."""
    for dtype, backend in ((torch.bfloat16, "reference"), (torch.float32, "triton")):
        weights, table = make_weights(dtype), make_table()
        run_device = CPU if backend == "reference" else device
        wrong = PleLayer(
            weights.to(device=run_device),
            table.to(run_device),
            ngram_size=N - 1,
            eps=EPS,
            backend=backend,
        )
        batch = Batch([12, 5], dtype, seed=11)
        batch.pool = batch.pool[:, S - ple_conv_state_len(K, N - 1) :].contiguous()
        out, _ = batch.run(wrong, run_device)
        batch.pool = Batch([12, 5], dtype, seed=11).pool  # the reference's own state
        with pytest.raises(AssertionError):
            check_layer_out(out, batch, weights, table, exact_bits=dtype == torch.bfloat16,
                            label="dilation 2")  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_control_stale_or_unwritten_state_fails(backend: str, device) -> None:
    """A state other than the sequence's (zeros, or the pool row before the last step,
    as if the update were skipped) changes the next chunk beyond the checks."""
    dtype = torch.bfloat16 if backend == "reference" else torch.float32
    weights, table = make_weights(dtype), make_table()
    run_device = CPU if backend == "reference" else device
    layer = PleLayer(
        weights.to(device=run_device), table.to(run_device), ngram_size=N, eps=EPS,
        backend=backend,
    )  # fmt: skip
    batch = Batch([4, 6, 1], dtype, seed=13)
    out, _ = batch.run(layer, run_device)
    check_layer_out(out, batch, weights, table, exact_bits=dtype == torch.bfloat16, label="ok")
    for name, stale in (
        ("zeroed", torch.zeros_like(batch.pool)),
        ("another slot's", batch.pool.roll(1, dims=0)),
    ):
        wrong = Batch([4, 6, 1], dtype, seed=13)
        wrong.pool = stale
        out, _ = wrong.run(layer, run_device)
        with pytest.raises(AssertionError):
            check_layer_out(out, batch, weights, table, exact_bits=dtype == torch.bfloat16,
                            label=name)  # fmt: skip
    # The update skipped: the second step reads the first step's input state.
    first, second = Batch([3, 2, 1], dtype, seed=17), Batch([2, 2, 1], dtype, seed=19)
    second.state_slots = first.state_slots
    _, after_first = first.run(layer, run_device)
    second.pool = after_first
    good, _ = second.run(layer, run_device)
    check_layer_out(good, second, weights, table, exact_bits=dtype == torch.bfloat16,
                    label="carried")  # fmt: skip
    second_stale = Batch([2, 2, 1], dtype, seed=19)
    second_stale.state_slots, second_stale.pool = first.state_slots, first.pool
    bad, _ = second_stale.run(layer, run_device)
    with pytest.raises(AssertionError):
        check_layer_out(bad, second, weights, table, exact_bits=dtype == torch.bfloat16,
                        label="not carried")  # fmt: skip


def _conv_rounded_per_tap(gated, normed, states, slots, qsl, conv1d, ngram_size):
    """The conv with its running sum rounded to bf16 after every tap (a mistake the spec
    names), in place of ``ple_conv_varlen_reference``."""
    tokens = torch.arange(normed.shape[0])
    seq = torch.searchsorted(qsl[1:].long(), tokens, right=True)
    position = tokens - qsl.long()[seq]
    window = torch.cat([states[slots].reshape(-1, normed.shape[1]), normed])
    total = torch.zeros_like(normed)
    for tap in range(K):
        back = (K - 1 - tap) * ngram_size
        src = position - back
        rows = torch.where(src >= 0, len(slots) * S + tokens - back, seq * S + S + src)
        total = (total.float() + conv1d[:, 0, tap].float() * window[rows].float()).bfloat16()
    mixed = torch.nn.functional.silu(total.float()).bfloat16()
    return (gated.float() + mixed.float()).bfloat16()


def _gate_rounded_once(key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The gate in fp32 from the normed key and query, rounded once at the end (the spec
    rounds each step), in place of ``ple_gate_reference``."""
    score = (key.float() * query.float()).sum(-1) / D**0.5
    logit = torch.sign(score) * score.abs().clamp_min(1e-6).sqrt()
    return torch.sigmoid(logit).to(key.dtype)


@pytest.mark.parametrize("mistake", ["conv rounded per tap", "gate rounded once", "wrong tap"])
def test_control_bf16_enclosure_catches_mistakes(
    mistake: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bf16 check is not blind: the reference path with one mistake fails the same
    comparison (:func:`check_layer_out`) on the CPU, out of the enclosure; the path as it
    is passes it."""
    import engramrt.families.qwen4_ple.layer as layer_module
    import engramrt.families.qwen4_ple.module as module

    weights, table = make_weights(torch.bfloat16), make_table()
    batch = Batch([13, 6, 1, 1], torch.bfloat16, seed=23)
    layer = PleLayer(weights, table, ngram_size=N, eps=EPS, backend="reference")
    out, _ = batch.run(layer, CPU)
    check_layer_out(out, batch, weights, table, exact_bits=False, label="as it is")
    with monkeypatch.context() as patch:
        if mistake == "conv rounded per tap":
            patch.setattr(module, "ple_conv_varlen_reference", _conv_rounded_per_tap)
        elif mistake == "gate rounded once":
            patch.setattr(layer_module, "ple_gate_reference", _gate_rounded_once)
        else:  # the first tap reads the second tap's weights
            conv1d = weights.conv1d.clone()
            conv1d[:, 0, 0] = conv1d[:, 0, 1]
            wrong = PleLayerWeights(**{**vars(weights), "conv1d": conv1d})
            layer = PleLayer(wrong, table, ngram_size=N, eps=EPS, backend="reference")
        out, _ = batch.run(layer, CPU)
    with pytest.raises(AssertionError, match="outside the enclosure"):
        check_layer_out(out, batch, weights, table, exact_bits=False, label=mistake)


def test_enclosure_at_the_released_sizes_still_catches_structural_mistakes() -> None:
    """At D = 2048, hc = 4, E = 2560 the worst-case sums widen the enclosure (layer.py's
    derivation), yet it holds the reference and a variant whose GEMM and gate are exact in
    float64 before each rounding, while a wrong tap, reversed taps and another sequence's
    state leave it: the bench's check (``ple/layer ...``) is not vacuous."""
    dim, hc, embed = 2048, 4, 2560
    width = hc * dim
    g = torch.Generator().manual_seed(2026)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).bfloat16()

    weights = PleLayerWeights(
        key_proj=randn(width, embed, scale=embed**-0.5),
        value_proj=randn(dim, embed, scale=embed**-0.5),
        norm_key=randn(width, scale=0.1),
        norm_query=randn(width, scale=0.1),
        norm_conv=randn(width, scale=0.1),
        conv1d=randn(width, 1, K, scale=0.5),
    )
    qsl = torch.tensor([0, 3, 4, 6])
    hidden, rows = randn(6, width, scale=1.0), randn(6, embed, scale=1.0)
    states = randn(3, S, width, scale=1.0)

    def run(w: PleLayerWeights = weights, conv_states: torch.Tensor = states):
        return ple_layer_reference_varlen(hidden, rows, w, query_start_loc=qsl, ngram_size=N,
                                          eps=EPS, conv_states=conv_states)  # fmt: skip

    enclosure = ple_layer_enclosure(hidden, rows, weights, query_start_loc=qsl, ngram_size=N,
                                    eps=EPS, conv_states=states)  # fmt: skip
    out, new_states = run()
    assert_within_enclosure(out, enclosure.out_low, enclosure.out_high, label="reference")
    assert_within_enclosure(new_states, enclosure.states_low, enclosure.states_high,
                            label="reference states")  # fmt: skip
    # Exact sums before each rounding: another valid order.
    exact_key = (rows.double() @ weights.key_proj.double().t()).bfloat16()
    exact_value = (rows.double() @ weights.value_proj.double().t()).bfloat16()
    gated, normed = ple_gate_norm_reference(exact_key, exact_value, hidden, weights, EPS, None)
    exact_out = ple_conv_varlen_reference(gated, normed, states, torch.arange(3), qsl,
                                          weights.conv1d, N)  # fmt: skip
    assert_within_enclosure(exact_out, enclosure.out_low, enclosure.out_high, label="exact sums")
    conv1d = weights.conv1d.clone()
    conv1d[:, 0, 0] = conv1d[:, 0, 1]
    mistakes = {
        "wrong tap": run(PleLayerWeights(**{**vars(weights), "conv1d": conv1d}))[0],
        "reversed taps": run(
            PleLayerWeights(**{**vars(weights), "conv1d": weights.conv1d.flip(2).contiguous()})
        )[0],
        "another sequence's state": run(conv_states=states.roll(1, 0))[0],
    }
    for label, wrong in mistakes.items():
        with pytest.raises(AssertionError, match="outside the enclosure"):
            assert_within_enclosure(wrong, enclosure.out_low, enclosure.out_high, label=label)


def test_enclosure_is_for_16_bit_models() -> None:
    weights, table = make_weights(torch.float32), make_table()
    batch = Batch([2], torch.float32, seed=3)
    with pytest.raises(ValidationError, match="expected bf16 or fp16"):
        batch.enclosure(weights, table)


# --------------------------------------------------------------------------
# The copy kernels, bit for bit
# --------------------------------------------------------------------------


def test_gather_kernel_is_the_reference_bit_for_bit(device) -> None:
    """Every bf16 bit pattern (NaN, inf, -0.0) copied as is; rows of a store from its
    ``row_begin``; widened to fp32 exactly; strided ids; int32 ids."""
    g = torch.Generator().manual_seed(29)
    bits = torch.randint(-(2**15), 2**15, (TABLE_ROWS, ROW_WIDTH), generator=g, dtype=torch.int16)
    table = bits.view(torch.bfloat16)
    ids = torch.randint(0, TABLE_ROWS, (37, 3, HEADS), generator=g)[:, 2, :]
    for out_dtype, id_dtype in ((torch.bfloat16, torch.int64), (torch.float32, torch.int32)):
        view = PleTable(table.to(device))
        out = torch.full((37, E), float("nan"), dtype=out_dtype, device=device)
        gather_ple_rows(view, ids.to(device, id_dtype), out, config=SMALL)
        want = gather_ple_rows_reference(PleTable(table), ids, out_dtype)
        assert_same_bits(out.cpu(), want, f"gather to {out_dtype}")
    shifted = PleTable(table[100:].to(device))
    shifted.row_begin = 100
    out = torch.empty(5, E, dtype=torch.bfloat16, device=device)
    gather_ple_rows(shifted, (ids[:5] % 800 + 100).to(device), out, config=SMALL)
    assert_same_bits(out.cpu(), table[ids[:5] % 800 + 100].reshape(5, E), "row_begin 100")
    # A bf16 store of the device tier reads the same rows.
    store = make_store(
        TablePlacement(DeviceOptions(), device=device),
        packed=table.view(torch.uint8).to(device),
        row_format=BF16,
    )
    out = torch.empty(37, E, dtype=torch.bfloat16, device=device)
    gather_ple_rows(PleTable(store), ids.to(device), out, config=SMALL)
    assert_same_bits(out.cpu(), table[ids].reshape(37, E), "device store")


@pytest.mark.parametrize("lengths", [[1, 1, 1, 1], [0, 12, 3, 9, 0, 10]])
def test_state_kernel_is_the_reference_bit_for_bit(lengths: list[int], device) -> None:
    """The pool's rows of each sequence become the last S rows of state ++ chunk: chunks
    shorter, equal to and longer than S, empty ones untouched, permuted slots."""
    g = torch.Generator().manual_seed(31)
    num_tokens = sum(lengths)
    normed = torch.randn(num_tokens, WIDTH + 8, generator=g).bfloat16()  # odd width
    pool = torch.randn(9, S, WIDTH + 8, generator=g).bfloat16()
    slots = torch.randperm(9, generator=g)[: len(lengths)]
    qsl = torch.tensor([0, *itertools.accumulate(lengths)])
    want = pool.clone()
    update_ple_conv_states_reference(want, normed, slots, qsl)
    found = pool.to(device, copy=True)
    update_ple_conv_states(found, normed.to(device), slots.to(device), qsl.to(device),
                           config=SMALL)  # fmt: skip
    assert_same_bits(found.cpu(), want, "pool")
    for seq, (start, stop) in enumerate(itertools.pairwise(qsl.tolist())):
        window = torch.cat([pool[slots[seq]], normed[start:stop]])
        assert_same_bits(want[slots[seq]], window[-S:], f"sequence {seq}")


# --------------------------------------------------------------------------
# The door: checks on the host, and the switch that skips them
# --------------------------------------------------------------------------


def test_calls_are_checked_at_the_door() -> None:
    weights, table = make_weights(torch.bfloat16), make_table()
    layer = PleLayer(weights, table, ngram_size=N, eps=EPS, backend="reference")
    batch = Batch([3, 2], torch.bfloat16, seed=37)
    args = dict(
        hidden=batch.hidden,
        row_ids=batch.row_ids,
        query_start_loc=batch.query_start_loc,
        conv_states=batch.pool,
        state_slots=batch.state_slots,
    )
    bad = {
        "hidden": (batch.hidden.float(), r"hidden has shape \[5, 64\] dtype torch.float32"),
        "row_ids": (batch.row_ids[:, :3], r"row_ids has shape \[5, 3\].*expected \[T = 5, C = 4\]"),
        "query_start_loc": (batch.query_start_loc.float(), r"query_start_loc has .*float32"),
        "state_slots": (batch.state_slots[:1], r"state_slots has shape \[1\].*\[B = 2\]"),
        "conv_states": (batch.pool[:, :8], r"conv_states has shape \[5, 8, 64\].*S = 9"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(ValidationError, match=message):
            layer(**{**args, name: value})
    with pytest.raises(ValidationError, match="token_mask has"):
        layer(**args, token_mask=torch.ones(5))
    with pytest.raises(ValidationError, match=r"out has shape \[5, 63\]"):
        layer(**args, out=torch.empty(5, 63, dtype=torch.bfloat16))
    with pytest.raises(ValidationError, match="expected a divisor of the weights' E=32"):
        PleLayer(weights, torch.zeros(10, 5).bfloat16(), ngram_size=N, eps=EPS)
    with pytest.raises(ValidationError, match="row_format=BF16"):
        store = make_store(TablePlacement(DeviceOptions(), device="cpu"), num_rows=4, E=32)
        PleLayer(weights, store, ngram_size=N, eps=EPS)
    with pytest.raises(ValidationError, match="ngram_size=0"):
        PleLayer(weights, table, ngram_size=0, eps=EPS)
    unchecked = PleLayer(weights, table, ngram_size=N, eps=EPS, backend="reference",
                         validate=False)  # fmt: skip
    unchecked(**args)  # good inputs pass without the checks


# --------------------------------------------------------------------------
# CUDA graphs and torch.compile
# --------------------------------------------------------------------------


def test_compiles_fullgraph_on_the_reference_path() -> None:
    """No graph break (no host synchronisation, no data-dependent shape): dynamo traces the
    whole call; with the ``eager`` backend the result is the eager bits."""
    torch._dynamo.reset()
    weights, table = make_weights(torch.bfloat16), make_table()
    layer = PleLayer(weights, table, ngram_size=N, eps=EPS, backend="reference")
    batch = Batch([5, 0, 9], torch.bfloat16, seed=41, padding=2)
    want, want_pool = batch.run(layer, CPU)
    compiled = torch.compile(layer.__call__, fullgraph=True, backend="eager")
    pool = batch.pool.clone()
    out = compiled(batch.hidden, batch.row_ids, batch.query_start_loc, pool, batch.state_slots)
    assert_same_bits(out, want, "compiled out")
    assert_same_bits(pool, want_pool, "compiled pool")


PLE_OPS = (
    "engramrt.ple_gather_rows",
    "engramrt.ple_gate_norm",
    "engramrt.ple_conv_varlen",
    "engramrt.ple_update_conv_states",
)


class Compiled:
    """A compiled layer call where :meth:`Batch.run` takes a layer."""

    def __init__(self, layer: PleLayer, backend: object) -> None:
        self.dtype = layer.dtype
        self._call = torch.compile(layer.__call__, fullgraph=True, backend=backend)

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self._call(*args, **kwargs)


def test_kernels_are_opaque_operators_under_compile(device) -> None:
    """Under ``torch.compile`` the Triton path is four custom operators (``engramrt::ple_*``)
    the compiler does not trace: one graph (fullgraph), each operator in it, and through
    functionalisation (``aot_eager``) the eager bits of ``out`` and of the pool. Control:
    a graph without the state update leaves the pool as it was."""
    weights, table = make_weights(torch.bfloat16), make_table()
    layer = PleLayer(weights.to(device=device), table.to(device), ngram_size=N, eps=EPS,
                     backend="triton", kernel_config=SMALL)  # fmt: skip
    batch = Batch([5, 0, 9, 1], torch.bfloat16, seed=53, padding=2, masked=0.2)
    want, want_pool = batch.run(layer, device)
    seen: list[str] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    batch.run(Compiled(layer, capture), device)  # type: ignore[arg-type]
    for op in PLE_OPS:
        assert seen.count(op) == 1, f"{op} appears {seen.count(op)} times in {seen}"
    torch._dynamo.reset()
    out, pool = batch.run(Compiled(layer, "aot_eager"), device)  # type: ignore[arg-type]
    assert_same_bits(out, want, "aot_eager out")
    assert_same_bits(pool, want_pool, "aot_eager pool")
    assert not torch.equal(want_pool, batch.pool), "control: the step must move the pool"


def test_ple_operators_pass_opcheck(device) -> None:
    """Schema (what each operator writes), fake tensors and functionalisation of every
    ``engramrt::ple_*`` operator, on the Triton kernels (``torch.library.opcheck``)."""
    weights, table = make_weights(torch.bfloat16).to(device=device), make_table().to(device)
    batch = Batch([3, 0, 2], torch.bfloat16, seed=59, padding=1, masked=0.2)
    num_tokens = batch.num_tokens
    rows = torch.empty(num_tokens, E, dtype=torch.bfloat16, device=device)
    row_ids = batch.row_ids.to(device)
    hidden = batch.hidden.to(device)
    kv = torch.randn(num_tokens, WIDTH + D, device=device).bfloat16()
    mask = batch.token_mask.to(device)  # type: ignore[union-attr]
    gated, normed = (torch.randn(num_tokens, WIDTH, device=device).bfloat16() for _ in "ab")
    qsl, slots = batch.query_start_loc.to(device), batch.state_slots.to(device)
    out = torch.empty(num_tokens, WIDTH, dtype=torch.bfloat16, device=device)
    cases = {
        "ple_gather_rows": (rows, table, row_ids, 0, 8, 4),
        "ple_gate_norm": (kv[:, :WIDTH], kv[:, WIDTH:], hidden, weights.norm_key,
                          weights.norm_query, weights.norm_conv, mask, EPS, HC, 4),
        "ple_conv_varlen": (out, gated, normed, batch.pool.to(device), slots, qsl,
                            weights.conv1d, N, 4, 32, 4),
        "ple_update_conv_states": (batch.pool.to(device), normed, slots, qsl, 32, 4),
    }  # fmt: skip
    for name, args in cases.items():
        torch.library.opcheck(getattr(torch.ops.engramrt, name).default, args)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")
def test_inductor_elides_the_roundings_by_default() -> None:
    """Inductor fuses the reference path's steps and, by default, keeps the fused values in
    fp32 (a ``.to(bf16)`` between two fused operations becomes a no-op): out of the
    enclosure, which therefore catches a compiler that drops the reference's roundings.
    ``emulate_precision_casts`` (what the bench's ``engramrt-compiled`` uses) keeps eager's
    bits on some CPUs but not all (359 of 1,088 values outside on one x86 host), so the
    enclosure is asserted for eager and the Triton kernels, not for Inductor's CPU code."""
    weights, table = make_weights(torch.bfloat16), make_table()
    layer = PleLayer(weights, table, ngram_size=N, eps=EPS, backend="reference")
    batch = Batch([5, 0, 9, 1, 1, 1], torch.bfloat16, seed=43, padding=2)
    torch._dynamo.reset()
    compiled = torch.compile(
        layer.__call__, fullgraph=True, options={"emulate_precision_casts": False}
    )
    pool = batch.pool.clone()
    out = compiled(batch.hidden, batch.row_ids, batch.query_start_loc, pool, batch.state_slots)
    with pytest.raises(AssertionError, match="outside the enclosure"):
        check_layer_out(out, batch, weights, table, exact_bits=False,
                        label="inductor, casts elided")  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor with Triton needs a GPU")
def test_compiles_fullgraph_with_inductor() -> None:
    """The Triton path inside ``torch.compile`` (Inductor): the kernels run as opaque
    operators (``engramrt::ple_*``), the GEMM is Inductor's; out and pool in the enclosure."""
    torch._dynamo.reset()
    weights, table = make_weights(torch.bfloat16), make_table()
    layer = PleLayer(weights.to(device="cuda"), table.cuda(), ngram_size=N, eps=EPS,
                     backend="triton")  # fmt: skip
    batch = Batch([5, 0, 9, 1], torch.bfloat16, seed=43, padding=2, masked=0.2)
    eager, _ = batch.run(layer, torch.device("cuda"))
    out, pool = batch.run(Compiled(layer, "inductor"), torch.device("cuda"))  # type: ignore[arg-type]
    check_layer_out(out, batch, weights, table, exact_bits=False, label="compiled triton")
    check_layer_out(eager, batch, weights, table, exact_bits=False, label="eager triton")
    check_pool(pool, batch, batch.expected(weights, table)[1], "compiled triton",
               weights=weights, table=table)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_meets_the_reference() -> None:
    """Captured once at fixed addresses (a decode batch padded with empty sequences and
    padding rows), replayed on new values: each replay meets the reference."""
    cuda = torch.device("cuda")
    weights, table = make_weights(torch.bfloat16), make_table()
    layer = PleLayer(weights.to(device=cuda), table.cuda(), ngram_size=N, eps=EPS,
                     backend="triton", validate=False)  # fmt: skip
    shape = Batch([1] * 6 + [0, 0], torch.bfloat16, seed=47, padding=2)
    hidden, row_ids = shape.hidden.cuda(), shape.row_ids.cuda()
    qsl, slots = shape.query_start_loc.cuda(), shape.state_slots.cuda()
    pool, out = shape.pool.cuda(), torch.empty(shape.num_tokens, WIDTH, dtype=torch.bfloat16,
                                               device=cuda)  # fmt: skip
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(hidden, row_ids, qsl, pool.clone(), slots, out=out)  # compile outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(hidden, row_ids, qsl, pool, slots, out=out)
    for seed in (53, 59, 61):
        batch = Batch([1] * 6 + [0, 0], torch.bfloat16, seed=seed, padding=2)
        batch.state_slots = shape.state_slots
        hidden.copy_(batch.hidden)
        row_ids.copy_(batch.row_ids)
        pool.copy_(batch.pool)
        graph.replay()
        torch.cuda.synchronize()
        check_layer_out(out.cpu(), batch, weights, table, exact_bits=False, label=f"replay {seed}")
        check_pool(pool.cpu(), batch, batch.expected(weights, table)[1], f"replay {seed}",
                   weights=weights, table=table)  # fmt: skip
