"""Benchmark cases of the whole Engram layer (SPEC §8) at V4.1-Flash shapes.

One step per token batch: row lookup from a table in GPU memory, the
``wkv`` projection and the gate, at D = 5120, hc = 4, C = 24, E = 256,
T = 256 (decode) and T = 8192 (prefill; 2048 with ``quick``).

- table: >= 1 GiB of random packed rows in device memory (random value
  bytes with the two e4m3fn NaN codes remapped, scale bytes 110..135), far
  beyond L2; row ids uniform int32;
- ``wkv``: bf16 ``[(hc+1)*D, C*E] = [25600, 6144]`` (315 MB), random with
  standard deviation ``1/sqrt(C*E)``; norm weights near 1.

Implementations:

- ``engramrt``: :class:`engramrt.layer.EngramLayer` (Triton lookup kernel
  into the staging buffer, one cuBLAS bf16 GEMM into the kv buffer, the
  fused Triton gate), also timed under CUDA-graph replay;
- ``torch-eager``: ``index_select`` of packed rows, the reference
  dequantisation, ``torch.mm`` and the reference gate, all torch ops.

Check (each output against the reference applied to its own input, see
:func:`engramrt.layer.assert_layer_within_tolerance`): rows bit for bit
between the two; each kv within :func:`engramrt.layer.linear_tolerance` of
the float64 projection; the engramrt output within the gate tolerance of
the gate reference on its kv (torch-eager's output *is* that reference).

``bytes_moved`` counts packed rows read (264 B each), hidden read and out
written, kv written once and read once, and the bf16 ``wkv`` read once (the
brief's rows + hidden + kv, plus the weight, without which the T = 256
number would be meaningless: 315 MB of weight against 33 MB of the rest).
The step is bound by the GEMM's arithmetic, not by memory, so its percent of
the copy ceiling is low by nature; ``gemm_tflop`` in the params gives the
work to set the time against a large bf16 GEMM's measured rate. The step,
part by part: BENCHMARKS.md#the-layer-step-part-by-part.

The checks passed at both sizes with torch's default
``allow_bf16_reduced_precision_reduction=True`` (the kv bits were the same
with it off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engramrt.bench.registry import Case, Inputs, register, table_params
from engramrt.config import PRESETS
from engramrt.gate import assert_within_tolerance, engram_gate_reference, gate_tolerance
from engramrt.layer.reference import linear_exact, linear_tolerance
from engramrt.lookup.synthetic import random_packed_rows
from engramrt.packed import row_bytes_for, unpack_rows
from engramrt.quant import dequantize_rows_reference

CONFIG = PRESETS["dsv41-flash"]  # D = 5120, hc = 4, C = 24, E = 256
HC, DIM, COLS, E = CONFIG.hc_mult, CONFIG.hidden_size, CONFIG.n_cols, CONFIG.head_dim
ROW_BYTES = row_bytes_for(E)  # 264
KV_WIDTH = (HC + 1) * DIM  # 25600
IN_WIDTH = COLS * E  # 6144
TABLE_ROWS = (1 << 30) // ROW_BYTES + 1  # at least 1 GiB
_FILL_ROWS = 1 << 22
_BF16 = 2

# One table and one set of weights for every case of a run (filling 1 GiB is
# the slow part of making inputs).
_SHARED: dict[str, Any] = {}


def _shared(device: torch.device) -> dict[str, Any]:
    if _SHARED.get("device") == str(device):
        return _SHARED
    from engramrt.lookup.tiers import DeviceOptions, TablePlacement, make_store

    _SHARED.clear()
    torch.cuda.empty_cache()
    generator = torch.Generator(device=device).manual_seed(4321)
    store = make_store(
        TablePlacement(DeviceOptions(backend="triton"), device=device), num_rows=TABLE_ROWS, E=E
    )
    for start in range(0, TABLE_ROWS, _FILL_ROWS):
        count = min(_FILL_ROWS, TABLE_ROWS - start)
        store.write_rows(start, random_packed_rows(count, E, device, generator))
    wkv = torch.randn(KV_WIDTH, IN_WIDTH, device=device, generator=generator)
    _SHARED.update(
        device=str(device),
        store=store,
        num_rows=TABLE_ROWS,
        wkv=(wkv / IN_WIDTH**0.5).bfloat16(),
        q_weight=(1.0 + 0.1 * torch.randn(HC, DIM, device=device, generator=generator)).bfloat16(),
        k_weight=(1.0 + 0.1 * torch.randn(HC, DIM, device=device, generator=generator)).bfloat16(),
    )
    return _SHARED


def _make(num_tokens: int) -> Callable[[torch.device], Inputs]:
    def make(device: torch.device) -> Inputs:
        from engramrt.layer import EngramLayer

        shared = _shared(device)
        store = shared["store"]
        # validate=False: the inputs are ours; the host-side checks would add
        # microseconds to the eager T=256 timing that a serving loop need not pay.
        layer = EngramLayer(CONFIG, store, max_tokens=num_tokens, backend="triton", validate=False)
        layer.load_weights(
            wkv=shared["wkv"], q_weight=shared["q_weight"], k_weight=shared["k_weight"]
        )
        row_ids = torch.randint(
            0, shared["num_rows"], (num_tokens, COLS), dtype=torch.int32, device=device
        )
        return {
            "layer": layer,
            "table": store.table,
            "row_ids": row_ids,
            "hidden": torch.randn(num_tokens, HC, DIM, device=device).bfloat16(),
            "wkv": shared["wkv"],
            "q_weight": shared["q_weight"],
            "k_weight": shared["k_weight"],
            "eps": CONFIG.rms_norm_eps,
        }

    return make


def _engramrt(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, kv, rows): views of the layer's staging buffers."""
    layer = inputs["layer"]
    out, kv = layer(inputs["hidden"], inputs["row_ids"], return_kv=True)
    return out, kv, layer.staged_rows[: out.shape[0]]


def _torch_eager(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather + reference dequantise + torch.mm + reference gate, all torch ops."""
    row_ids = inputs["row_ids"]
    num_tokens = row_ids.shape[0]
    packed = inputs["table"].index_select(0, row_ids.reshape(-1).long())  # [T*C, 264]
    values, scales = unpack_rows(packed)
    rows = dequantize_rows_reference(values, scales).view(num_tokens, COLS, E)
    kv = torch.mm(rows.view(num_tokens, IN_WIDTH), inputs["wkv"].t())
    out = engram_gate_reference(
        inputs["hidden"], kv, inputs["q_weight"], inputs["k_weight"], inputs["eps"]
    )
    return out, kv, rows


def _check(inputs: Inputs, outputs: dict[str, Any]) -> None:
    """Rows bit for bit; each kv within the linear bound of the float64 projection;
    engramrt's output within the gate bound of the gate reference on its own kv."""
    _, _, expected_rows = outputs["torch-eager"]
    flat_rows = expected_rows.reshape(expected_rows.shape[0], IN_WIDTH)
    weight = inputs["wkv"]
    exact = linear_exact(flat_rows, weight)
    kv_tolerance = linear_tolerance(flat_rows, weight, exact)
    for name, (out, kv, rows) in outputs.items():
        got, want = rows.view(torch.int16), expected_rows.view(torch.int16)
        if got.shape != want.shape or not torch.equal(got, want):
            bad = int((got != want).sum()) if got.shape == want.shape else -1
            raise AssertionError(f"{name}: rows differ from torch-eager's in {bad} values")
        assert_within_tolerance(kv, exact, kv_tolerance, label=f"{name} kv")
        if name == "torch-eager":
            continue
        operands = (inputs["hidden"], kv, inputs["q_weight"], inputs["k_weight"], inputs["eps"])
        expected = engram_gate_reference(*operands)
        tolerance = gate_tolerance(*operands, expected=expected)
        assert_within_tolerance(out, expected, tolerance, label=f"{name} out")


@register
def layer_cases(quick: bool) -> list[Case]:
    token_counts = (256, 2048) if quick else (256, 8192)
    cases = []
    for num_tokens in token_counts:
        rows = num_tokens * COLS
        bytes_moved = (
            rows * ROW_BYTES  # packed rows read
            + 2 * num_tokens * HC * DIM * _BF16  # hidden read, out written
            + 2 * num_tokens * KV_WIDTH * _BF16  # kv written, then read by the gate
            + KV_WIDTH * IN_WIDTH * _BF16  # wkv read once
        )
        cases.append(
            Case(
                name=f"layer/T={num_tokens}",
                params={
                    "T": num_tokens,
                    "D": DIM,
                    "hc": HC,
                    **table_params(TABLE_ROWS, E, COLS),
                    "wkv": f"bf16 [{KV_WIDTH}, {IN_WIDTH}]",
                    "gemm_tflop": round(2 * num_tokens * KV_WIDTH * IN_WIDTH / 1e12, 3),
                },
                make=_make(num_tokens),
                impls={"engramrt": _engramrt, "torch-eager": _torch_eager},
                check=_check,
                bytes_moved=bytes_moved,
                items=num_tokens,
                item_name="tokens",
                graph=True,
            )
        )
    return cases
