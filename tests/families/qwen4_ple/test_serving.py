"""Qwen4-Exp PLE served by :class:`EngramRuntime` (``families/qwen4_ple/serving.py``).

Requests are streamed through the runtime (row ids by :class:`PleRowIdMaker`, rows from
bf16 stores of the device tier, :class:`PleHead` per layer, ``h = h + out`` between the
layers) in chunked prefill, interleaved decode and a padded step; every token's outputs
are checked bit for bit against the one-shot computation of its whole sequence
(``test_streaming.one_shot``: numpy row ids, the layer reference over the sequence), which
the runtime takes no part in. On a GPU (``ENGRAMRT_TEST_DEVICE=cuda``) the kernels do not
round like the CPU reference, so there the runtime is checked bit for bit against the same
kernels called directly (the hasher over the pool, ``PleLayer`` gathering from the store):
what the runtime adds (staging, side streams, slots) must change no bit. Controls: a pool
whose conv states are dropped between steps, and a step whose requests point at each
other's slots, must both be caught.
"""

from __future__ import annotations

import os

import pytest
import torch
from tests.families.qwen4_ple.test_streaming import CONFIG, MODEL, differ, one_shot

from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple.module import PleLayer
from engramrt.families.qwen4_ple.ops import PleHasher
from engramrt.families.qwen4_ple.serving import PleHead, PleRowIdMaker
from engramrt.families.qwen4_ple.streaming import PleStatePool, ple_row_ids_slots
from engramrt.family import BF16
from engramrt.lookup.tiers import DeviceOptions, TablePlacement, make_store
from engramrt.protocols import LayerHead, RowIdMaker
from engramrt.runtime import EngramRuntime
from engramrt.step import EngineStep

MAX_REQUESTS = 4
MAX_TOKENS = 24
# Three requests of fixed token ids (EOS = 7 inside the second).
PROMPTS = {0: [3, 5, 11, 2, 9, 1, 4], 1: [8, 7, 2, 2, 10, 6], 2: [1, 1, 1, 0, 3]}
# Each step: (request, number of its next tokens), in the step's order.
SCHEDULE = [
    [(0, 4), (1, 3)],  # prefill chunks of two requests
    [(1, 3), (0, 3), (2, 2)],  # their second chunks and a new request
    [(0, 1), (1, 1), (2, 3)],  # decode beside a prefill chunk
    [(2, 1), (0, 1)],  # decode, requests in another order
]
EXTRA = {0: [6, 2], 1: [5], 2: [9]}  # decode tokens after the prompts


def make_stores(device: torch.device) -> list:
    return [
        make_store(
            TablePlacement(DeviceOptions(), device=device),
            packed=table.contiguous().view(torch.uint8),
            row_format=BF16,
        )
        for table in MODEL.tables
    ]


def build(backend: str = "reference", device: torch.device | str = "cpu"):
    device = torch.device(device)
    pool = PleStatePool(CONFIG, max_requests=MAX_REQUESTS, device=device)
    maker = PleRowIdMaker(PleHasher(CONFIG, device, backend=backend))
    stores = make_stores(device)
    heads = [
        PleHead.from_pool(pool, index, weights.to(device=device), backend=backend)
        for index, weights in enumerate(MODEL.weights)
    ]
    runtime = EngramRuntime(
        maker, stores, heads=heads, max_tokens=MAX_TOKENS, max_requests=MAX_REQUESTS,
        history=pool,
    )  # fmt: skip
    return runtime, pool


class Direct:
    """The same kernels without the runtime: the hasher over the pool's contexts, then
    each layer's ``PleLayer`` gathering its rows from the store itself."""

    def __init__(self, backend: str, device: torch.device) -> None:
        self.pool = PleStatePool(CONFIG, max_requests=MAX_REQUESTS, device=device)
        self.hasher = PleHasher(CONFIG, device, backend=backend)
        self.layers = [
            PleLayer.from_config(CONFIG, weights.to(device=device), store, backend=backend)
            for weights, store in zip(MODEL.weights, make_stores(device), strict=True)
        ]
        self.step: EngineStep | None = None

    def plan(self, step: EngineStep) -> None:
        self.step = step
        self.row_ids = ple_row_ids_slots(
            self.hasher, step.input_ids, step.query_start_loc, step.request_slots,
            self.pool.contexts,
        )  # fmt: skip

    def run(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        step = self.step
        assert step is not None and step.request_slots is not None
        flat = hidden.reshape(hidden.shape[0], -1)
        return self.layers[layer](
            flat, self.row_ids[:, layer].contiguous(), step.query_start_loc,
            self.pool.conv_states[layer], step.request_slots,
        )  # fmt: skip

    def close(self) -> None:
        pass


def stream(
    backend: str = "reference",
    *,
    device: torch.device | str = "cpu",
    direct: bool = False,
    drop_state: bool = False,
    swap_slots: bool = False,
):
    """Run SCHEDULE through the runtime (or :class:`Direct`); returns (mismatched bf16
    values against the one-shot sequences, tokens checked, every step's outputs)."""
    device = torch.device(device)
    if direct:
        runtime = Direct(backend, device)
        pool = runtime.pool
    else:
        runtime, pool = build(backend, device)
    steps = []
    tokens = {r: PROMPTS[r] + EXTRA[r] for r in PROMPTS}
    done = dict.fromkeys(PROMPTS, 0)
    pool.reset(list(PROMPTS))
    wrong = checked = 0
    for index, entries in enumerate(SCHEDULE):
        if drop_state:
            pool.conv_state_pool.zero_()
        ids, positions, qsl, slots = [], [], [0], []
        for request, count in entries:
            start = done[request]
            ids += tokens[request][start : start + count]
            positions += range(start, start + count)
            qsl.append(qsl[-1] + count)
            slots.append(request)
        pad = index == 2  # a padded step: two tokens past qsl[-1], one padded request
        if pad:
            ids += [0, 0]
            positions += [0, 0]
            qsl.append(qsl[-1])
            slots.append(pool.pad_slot)
        if swap_slots:
            slots = slots[1:] + slots[:1]
        step = EngineStep(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            request_slots=torch.tensor(slots, dtype=torch.int32),
        ).to(device)
        runtime.plan(step)
        hidden = MODEL.hidden(step.input_ids.cpu(), step.positions.cpu()).to(device)
        outs = []
        for layer in range(CONFIG.n_layers):
            out = runtime.run(layer, hidden.view(-1, CONFIG.hc_count, CONFIG.hidden_size))
            out = out.reshape(len(ids), -1).clone()
            outs.append(out)
            hidden = hidden + out
        outs = [out.cpu() for out in outs]
        steps.append(outs)
        for n, (request, count) in enumerate(entries):
            start = done[request]
            expected = one_shot(tuple(tokens[request][: start + count]))
            span = slice(qsl[n], qsl[n + 1])
            for layer in range(CONFIG.n_layers):
                wrong += differ(outs[layer][span], expected.outs[layer][start : start + count])
            checked += count
            done[request] = start + count
        if pad:
            assert bool((outs[0][qsl[-1] :] == 0).all()), "padding tokens get 0"
    runtime.close()
    return wrong, checked, steps


def test_protocols_are_met() -> None:
    runtime, _ = build()
    assert isinstance(runtime.hasher, RowIdMaker)
    assert all(isinstance(head, LayerHead) for head in runtime.heads)
    assert runtime.hasher.history_window == CONFIG.ngram_size - 1
    runtime.close()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_runtime_streams_ple_bit_for_bit(backend: str) -> None:
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors: the kernels run under TRITON_INTERPRET=1 (on a GPU: below)")
    wrong, checked, _ = stream(backend)
    assert checked == sum(len(PROMPTS[r]) + len(EXTRA[r]) for r in PROMPTS)
    assert wrong == 0, f"{wrong} bf16 values differ from the one-shot sequences"


def test_runtime_changes_no_bit_of_the_kernels(device) -> None:
    """On the test device: the runtime's outputs are the direct kernels' bit for bit."""
    backend = "triton" if device.type == "cuda" else "reference"
    _, _, found = stream(backend, device=device)
    _, _, expected = stream(backend, device=device, direct=True)
    for index, (got, want) in enumerate(zip(found, expected, strict=True)):
        for layer in range(CONFIG.n_layers):
            count = differ(got[layer], want[layer])
            assert count == 0, f"step {index} layer {layer}: {count} values differ"
    # Control: the direct path itself notices a broken pool.
    _, _, broken = stream(backend, device=device, direct=True, drop_state=True)
    assert any(differ(b[0], w[0]) for b, w in zip(broken, expected, strict=True))


@pytest.mark.parametrize("control", ["drop_state", "swap_slots"])
def test_control_broken_state_is_caught(control: str) -> None:
    wrong, _, _ = stream(**{control: True})
    assert wrong > 0, f"{control} went unnoticed"


def test_steps_without_request_slots_or_pool_are_refused() -> None:
    runtime, _ = build()
    step = EngineStep.single([3, 5, 11])
    with pytest.raises(ValidationError, match=r"step.request_slots is None"):
        runtime.plan(step)
    maker = runtime.hasher
    with pytest.raises(ValidationError, match=r"history is a NoneType; expected the PleStatePool"):
        maker(step, None)
    head = runtime.heads[0]
    rows = torch.zeros(3, head.num_cols, head.head_dim, dtype=torch.bfloat16)
    hidden = torch.zeros(3, head.hc_mult, head.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(ValidationError, match=r"return_kv / kv_out"):
        head.compute(hidden, rows, step=step, return_kv=True)
    with pytest.raises(ValidationError, match=r"load_weights got \['key_proj'\]"):
        head.load_weights(key_proj=MODEL.weights[0].key_proj)
    runtime.close()


def test_load_weights_writes_in_place() -> None:
    runtime, _ = build()
    head = runtime.heads[1]
    address = head.layer.kv_proj.data_ptr()
    source = MODEL.weights[0]
    head.load_weights(**{name: getattr(source, name) for name in (
        "key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d")})  # fmt: skip
    assert head.layer.kv_proj.data_ptr() == address
    assert torch.equal(head.layer.weights.key_proj, source.key_proj)
    assert torch.equal(head.layer.weights.conv1d, source.conv1d)
    runtime.close()


def test_ple_runtime_from_a_checkpoint(tmp_path) -> None:
    """``ple_runtime`` serves a saved checkpoint: a two-request step, bit for bit against
    the one-shot reference over the checkpoint's own tables and weights."""
    from tests.families.qwen4_ple import ple_checkpoints as ckpt

    from engramrt.families.qwen4_ple.ids import ple_row_ids
    from engramrt.families.qwen4_ple.layer import PleLayerWeights, ple_layer_reference
    from engramrt.families.qwen4_ple.serving import ple_runtime
    from engramrt.lookup.tiers import HostOptions

    state = ckpt.checkpoint_state(ckpt.COMPOSITE)
    path = ckpt.save(tmp_path / "model", state, files=2)
    runtime, pool = ple_runtime(
        path, ckpt.FIELDS, TablePlacement(HostOptions(), device="cpu"),
        max_tokens=16, max_requests=3, backend="reference",
    )  # fmt: skip
    config = ckpt.CONFIG
    prompts = [[3, 9, 5, 14, 2], [60, 1, 1]]
    pool.reset([0, 2])
    ids = torch.tensor(prompts[0] + prompts[1])
    step = EngineStep(
        input_ids=ids,
        positions=torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
        query_start_loc=torch.tensor([0, 5, 8], dtype=torch.int32),
        request_slots=torch.tensor([0, 2], dtype=torch.int32),
    )
    runtime.plan(step)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(8, config.hc_count * config.hidden_size, generator=g).bfloat16()
    outs, h = [], hidden
    for layer in range(config.n_layers):
        out = runtime.run(layer, h.view(8, config.hc_count, config.hidden_size))
        outs.append(out.reshape(8, -1).clone())
        h = h + outs[-1]
    runtime.close()
    wrong = 0
    for start, tokens in ((0, prompts[0]), (5, prompts[1])):
        row_ids = torch.from_numpy(ple_row_ids(tokens, ckpt.CONSTS, config.eos))
        h = hidden[start : start + len(tokens)]
        for layer in range(config.n_layers):
            table = ckpt.random_table(layer, torch.bfloat16)  # what the shards hold
            names = PleLayerWeights.checkpoint_names(ckpt.LAYERS[layer], ckpt.COMPOSITE)
            weights = PleLayerWeights(**{field: state[name] for field, name in names.items()})
            rows = table[row_ids[:, layer]].flatten(1)
            want, _ = ple_layer_reference(
                h, rows, weights, ngram_size=config.ngram_size, eps=config.rms_norm_eps
            )
            wrong += differ(outs[layer][start : start + len(tokens)], want)
            h = h + want
    assert wrong == 0, f"{wrong} bf16 values differ from the checkpoint's one-shot reference"
    with pytest.raises(ValidationError, match=r"placement.tp=2; expected 1"):
        ple_runtime(path, ckpt.FIELDS, TablePlacement(HostOptions(), device="cpu", tp=2),
                    max_tokens=16, max_requests=3)  # fmt: skip


def test_compiled_step_through_the_custom_ops() -> None:
    """torch.compile(fullgraph=True) of a PLE step through the runtime's operators (the
    plan op takes the pool's contexts, the layers run through ``run_layer``): the same row
    ids, outputs and pool state as the eager runtime, bit for bit, over three steps."""
    from engramrt import custom_ops

    compiled_rt, compiled_pool = build()
    eager_rt, eager_pool = build()

    def model(step: EngineStep, hidden: torch.Tensor):
        row_ids = custom_ops.plan(compiled_rt, step)
        outs = []
        for layer in range(CONFIG.n_layers):
            out = custom_ops.run_layer(compiled_rt, layer, hidden, row_ids)
            outs.append(out)
            hidden = hidden + out
        return row_ids, outs

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for pool in (compiled_pool, eager_pool):
        pool.reset([0, 1])
    shape = (-1, CONFIG.hc_count, CONFIG.hidden_size)
    for index, (ids, slots) in enumerate([([3, 5, 11, 2, 8, 7], [0, 1]), ([9, 4], [1, 0])]):
        qsl = [0, len(ids) // 2, len(ids)]
        step = EngineStep(
            input_ids=torch.tensor(ids),
            positions=torch.arange(len(ids)) + index,  # positions are not read by PLE
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            request_slots=torch.tensor(slots, dtype=torch.int32),
        )
        hidden = MODEL.hidden(step.input_ids, step.positions).view(shape)
        row_ids, outs = compiled(step, hidden)
        plan = eager_rt.plan(step)
        assert torch.equal(row_ids, plan.row_ids), f"step {index}: row ids"
        h = hidden
        for layer in range(CONFIG.n_layers):
            want = eager_rt.run(layer, h).clone()
            assert differ(outs[layer], want) == 0, f"step {index} layer {layer}"
            h = h + want
    assert torch.equal(compiled_pool.contexts, eager_pool.contexts)
    assert differ(compiled_pool.conv_state_pool, eager_pool.conv_state_pool) == 0
    compiled_rt.close()
    eager_rt.close()
