"""engramrt's custom operators: opcheck, the eager runtime's bytes, and a compiled model step.

On CPU the compiled step runs through ``aot_eager`` (the graph is traced
whole, ``fullgraph=True``, with the fake implementations, without code
generation); on a GPU through Inductor and, captured, in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.layer.common import random_hidden, random_weights

from engramrt.config import PRESETS
from engramrt.errors import ValidationError
from engramrt.gate import GateInputs, gate_tolerance
from engramrt.gate import engram_gate as eager_gate
from engramrt.hashing import HashBatch, HashConstants, NgramHasher, SlotHashCache, hash_sequence
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import TablePlacement
from engramrt.runtime import EngramRuntime, synthetic_stores

custom_ops = pytest.importorskip("engramrt.custom_ops")

CFG = PRESETS["tiny"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def layout() -> EngramLayout:
    return EngramLayout(CFG)


def _runtime(layout, token_map, device, *, heads=None, history=None, tier="device", **kw):
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    hasher = NgramHasher(consts, token_map, device)
    stores = synthetic_stores(layout, TablePlacement(tier, device), seed=2)
    return EngramRuntime(
        hasher, stores, max_tokens=64, max_requests=4, history=history, heads=heads, **kw
    )


def _heads(device) -> list[EngramHead]:
    heads = []
    for li in range(CFG.n_layers):
        head = EngramHead(CFG, device=device, validate=False)
        head.load_weights(**random_weights(40 + li, fp8=li == 1, config=CFG))
        heads.append(head)
    return heads


def _batch(token_map, device, seed: int, num_tokens: int = 13) -> tuple[HashBatch, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, token_map.vocab_size, num_tokens + 3)
    batch = HashBatch.single(ids[3:], start=3, device=device)
    batch.lookback_token_ids = torch.from_numpy(ids[2::-1].copy()).view(1, 3).to(device)
    return batch, ids


def _packed(store) -> torch.Tensor:
    return store.table.cpu()


def test_opcheck_lookup_and_gate(device) -> None:
    stores = synthetic_stores(EngramLayout(CFG), TablePlacement("device", device), seed=2)
    table = stores[0].table
    g = torch.Generator().manual_seed(1)
    row_ids = torch.randint(0, table.shape[0], (9, CFG.n_cols), generator=g).to(device)
    torch.library.opcheck(
        custom_ops.lookup_rows, (row_ids, table, 0, CFG.n_cols, 0), test_utils="test_faketensor"
    )
    torch.library.opcheck(custom_ops.lookup_rows, (row_ids, table, 2, 7, 0))
    hidden = random_hidden(5, seed=1).to(device)
    kv = (torch.randn(5, (CFG.hc_mult + 1) * CFG.hidden_size, generator=g)).bfloat16().to(device)
    w = torch.ones(CFG.hc_mult, CFG.hidden_size, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(custom_ops.engram_gate, (hidden, kv, w, w, 1e-6, None))
    mask = torch.tensor([True, False, True, True, False], device=device)
    torch.library.opcheck(custom_ops.engram_gate, (hidden, kv, w, w, 1e-6, mask))


def test_opcheck_plan_with_a_slot_history(layout, token_map, device) -> None:
    cache = SlotHashCache(64, 4, device)
    runtime = _runtime(layout, token_map, device, history=cache)
    batch, _ = _batch(token_map, device, seed=3)
    batch.slot_mapping = torch.arange(3, 16, device=device)
    batch.block_table = torch.arange(16, dtype=torch.int32, device=device)[None]
    args = (
        batch.input_ids,
        batch.positions,
        batch.query_start_loc,
        None,
        batch.lookback_token_ids,
        None,
        batch.slot_mapping,
        batch.block_table,
        cache.slots,
        runtime.handle,
    )
    torch.library.opcheck(custom_ops.plan_step_slot_cache, args)
    runtime.close()


def test_opcheck_run_layer(layout, token_map, device) -> None:
    """opcheck calls the operator several times: every call runs a planned step."""
    runtime = _runtime(layout, token_map, device, heads=_heads(device), num_slots=16)
    batch, _ = _batch(token_map, device, seed=3)
    for _ in range(16):
        runtime.plan(batch)
    hidden = random_hidden(batch.num_tokens, seed=1).to(device)
    torch.library.opcheck(
        custom_ops.run_layer_op,
        (hidden, None, None, runtime.handle, 0),
        test_utils=("test_schema", "test_faketensor"),
    )
    runtime.close()


def test_ops_give_the_eager_bytes(layout, token_map, device) -> None:
    """Row ids against one-shot hashing done here, rows against the lookup reference,
    each layer's output against the eager runtime's (same launchers: the same bits)
    and the gate against the eager gate."""
    heads = _heads(device)
    runtime = _runtime(layout, token_map, device, heads=heads)
    eager = _runtime(layout, token_map, device, heads=heads)
    batch, ids = _batch(token_map, device, seed=4)
    got = custom_ops.plan(runtime, batch)
    want_plan = eager.plan(batch)
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    np.testing.assert_array_equal(
        got.cpu().numpy(), hash_sequence(token_map.compress(ids), consts)[3:]
    )
    assert got.dtype == runtime.hasher.out_dtype
    assert got.data_ptr() != runtime.staged_row_ids(0).data_ptr()  # a copy, never an alias
    hidden = random_hidden(13, seed=5).to(device)
    for li, store in enumerate(runtime.sources):
        want = lookup_rows_reference(got[:, li].cpu(), _packed(store), CFG.head_dim)
        rows = custom_ops.lookup_rows(got[:, li], store.table, 0, CFG.n_cols, 0)
        assert torch.equal(rows.cpu().view(torch.int16), want.view(torch.int16))
        assert torch.equal(want_plan.rows(li).cpu().view(torch.int16), want.view(torch.int16))
        out = custom_ops.run_layer(runtime, li, hidden, got)
        expected = eager.run(li, hidden)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"layer {li}"
        hidden = out
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(13, (CFG.hc_mult + 1) * CFG.hidden_size, generator=g).bfloat16().to(device)
    w = (1 + 0.1 * torch.randn(CFG.hc_mult, CFG.hidden_size, generator=g)).bfloat16().to(device)
    out = custom_ops.engram_gate(hidden, kv, w, w, CFG.rms_norm_eps, None)
    assert torch.equal(
        out.view(torch.int16),
        eager_gate(GateInputs(hidden, kv, w, w, CFG.rms_norm_eps)).view(torch.int16),
    )
    runtime.close()
    eager.close()


def test_negative_control_a_layer_run_on_another_step_differs(layout, token_map, device) -> None:
    """The equality above can fail: the operator run after a plan of other tokens gives
    another output than the eager runtime on the right tokens."""
    heads = _heads(device)
    runtime = _runtime(layout, token_map, device, heads=heads)
    eager = _runtime(layout, token_map, device, heads=heads)
    batch, _ = _batch(token_map, device, seed=4)
    other, _ = _batch(token_map, device, seed=5)
    custom_ops.plan(runtime, other)
    eager.plan(batch)
    hidden = random_hidden(13, seed=5).to(device)
    out = custom_ops.run_layer(runtime, 0, hidden)
    assert not torch.equal(out.view(torch.int16), eager.run(0, hidden).view(torch.int16))
    runtime.close()
    eager.close()


def test_handles_and_arguments_are_clear_errors(layout, token_map, device) -> None:
    runtime = _runtime(layout, token_map, device)
    handle = runtime.handle
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=device)
    runtime.close()
    del runtime
    with pytest.raises(ValidationError, match=f"handle={handle} names no live EngramRuntime"):
        custom_ops.plan_step(ids, ids, qsl, None, None, None, handle)
    with pytest.raises(ValidationError, match="expected an EngramRuntime"):
        custom_ops.run_layer(object(), 0, ids)  # type: ignore[arg-type]
    heads = _heads(device)
    runtime = _runtime(layout, token_map, device, heads=heads, history=SlotHashCache(64, 4, device))
    batch, _ = _batch(token_map, device, seed=3)
    with pytest.raises(ValidationError, match="SlotHashCache; expected the batch's slot_mapping"):
        custom_ops.plan(runtime, batch)
    with pytest.raises(ValidationError, match=r"run\(0\) but no planned step"):
        custom_ops.run_layer(runtime, 0, random_hidden(13, seed=1).to(device))
    runtime.close()


class TwoLayerStep(torch.nn.Module):
    """A model step as an engine compiles it: plan the step (hash both layers, start
    both layers' rows), blocks between the Engram layers, each Engram layer run by the
    runtime. ``plan_inside=False``: the engine plans on the host before calling the
    compiled model (piecewise), which then only runs the layers."""

    def __init__(self, runtime: EngramRuntime, plan_inside: bool = True) -> None:
        super().__init__()
        self.runtime, self.plan_inside = runtime, plan_inside
        g = torch.Generator().manual_seed(3)
        self.block = torch.nn.Parameter(
            (torch.randn(CFG.hidden_size, CFG.hidden_size, generator=g) / CFG.hidden_size**0.5)
            .bfloat16()
            .to(runtime.device),
            requires_grad=False,
        )

    def forward(self, input_ids, positions, query_start_loc, lookback, hidden):
        row_ids = None
        if self.plan_inside:
            row_ids = custom_ops.plan_step(
                input_ids, positions, query_start_loc, None, lookback, None, self.runtime.handle
            )
        ins, outs = [], []
        for li in range(self.runtime.n_layers):
            hidden = hidden + torch.tanh(hidden @ self.block)  # a backbone block
            ins.append(hidden)
            hidden = custom_ops.run_layer(self.runtime, li, hidden, row_ids)
            outs.append(hidden)
        return row_ids, ins, outs


def _eager_step(runtime: EngramRuntime, model: TwoLayerStep, batch: HashBatch, hidden):
    """The same step through the eager API: plan, then each block and runtime.run."""
    step = runtime.plan(batch)
    outs = []
    for li in range(runtime.n_layers):
        hidden = hidden + torch.tanh(hidden @ model.block)
        hidden = runtime.run(li, hidden).clone()
        outs.append(hidden)
    return step, outs


def _check_layers_within_tolerance(runtime, step, ins, outs) -> None:
    """Each compiled layer's output against the float reference of the gate on the
    eager runtime's rows and the layer's input in the compiled graph (the compiler
    may schedule the blocks and wkv differently: the output is held to the gate's
    derived tolerance, not to its bits)."""
    for li, head in enumerate(runtime.heads):
        h_in = ins[li]
        kv = head.wkv(step.rows(li).reshape(step.num_tokens, -1))
        ref = eager_gate(
            GateInputs(h_in, kv, head.q_weight, head.k_weight, head.eps), backend="reference"
        )
        tol = gate_tolerance(
            h_in, kv, head.q_weight, head.k_weight, head.eps, ref,
            truncating_store=runtime.device.type == "cpu",
        )  # fmt: skip
        err = (outs[li].double() - ref.double()).abs()
        assert bool((err <= tol.to(err.device)).all()), f"layer {li}: {float(err.max())}"


@pytest.mark.parametrize(
    ("plan_inside", "tier"),
    [(True, "device"), (False, "host")],
    ids=["whole-step-device-tables", "piecewise-host-tables"],
)
def test_compiled_two_layer_step_fullgraph(plan_inside, tier, layout, token_map, device) -> None:
    """torch.compile(fullgraph=True) of a step through the runtime's operators, with
    tables in GPU or host memory: the same row ids and rows as the eager runtime over
    the same tables, bit for bit, and outputs within the gate's tolerance. Each step
    is prefetched before the previous one's layers run, as an engine does."""
    heads = _heads(device)
    runtime = _runtime(layout, token_map, device, heads=heads, tier=tier)
    eager = _runtime(layout, token_map, device, heads=heads, tier=tier)
    model = TwoLayerStep(runtime, plan_inside)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    batches = [_batch(token_map, device, seed=seed)[0] for seed in (8, 9, 10)]
    if not plan_inside:
        runtime.plan(batches[0])
    for index, batch in enumerate(batches):
        hidden = random_hidden(batch.num_tokens, seed=index).to(device)
        args = (batch.input_ids, batch.positions, batch.query_start_loc,
                batch.lookback_token_ids, hidden)  # fmt: skip
        row_ids, ins, outs = compiled(*args)
        if not plan_inside and index + 1 < len(batches):
            runtime.prefetch(batches[index + 1])  # the next step's rows start now
        step, eager_outs = _eager_step(eager, model, batch, hidden)
        if plan_inside:
            assert torch.equal(row_ids, step.row_ids)
        _check_layers_within_tolerance(eager, step, ins, outs)
        assert [o.shape for o in outs] == [o.shape for o in eager_outs]
    assert runtime.pending_steps == 0
    runtime.close()
    eager.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_step_replays_in_a_cuda_graph(layout, token_map) -> None:
    """The whole step (plan and both layers) compiled and captured in one CUDA graph
    over GPU-memory tables (one staging slot, so one graph), replayed over fresh
    tokens: the same row ids, rows and outputs as the eager runtime."""
    device = torch.device("cuda", torch.cuda.current_device())
    heads = _heads(device)
    runtime = _runtime(layout, token_map, device, heads=heads, num_slots=1)
    eager = _runtime(layout, token_map, device, heads=heads)
    model = TwoLayerStep(runtime)
    compiled = torch.compile(model, fullgraph=True)
    batch, _ = _batch(token_map, device, seed=10, num_tokens=32)
    hidden = random_hidden(32, seed=10).to(device)
    static = (batch.input_ids.clone(), batch.positions, batch.query_start_loc,
              batch.lookback_token_ids.clone(), hidden.clone())  # fmt: skip
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compiled(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(*static)
    rng = np.random.default_rng(11)
    for _ in range(3):
        static[0].copy_(torch.as_tensor(rng.integers(0, token_map.vocab_size, 32), device=device))
        static[3].copy_(
            torch.as_tensor(rng.integers(0, token_map.vocab_size, (1, 3)), device=device)
        )
        graph.replay()
        fresh = HashBatch(
            input_ids=static[0], positions=static[1], query_start_loc=static[2],
            lookback_token_ids=static[3],
        )  # fmt: skip
        step, _ = _eager_step(eager, model, fresh, static[4])
        assert torch.equal(captured[0], step.row_ids)
        for li in range(runtime.n_layers):
            assert torch.equal(
                runtime.staged_rows(0, li)[:32].view(torch.int16),
                step.rows(li).view(torch.int16),
            )
        _check_layers_within_tolerance(eager, step, captured[1], captured[2])
    runtime.close()
    eager.close()
