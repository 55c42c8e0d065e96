"""The fused Engram gate in Triton: hidden and kv read from DRAM once, bf16 out.

Design (SPEC §8; the definition is :mod:`engramrt.gate.reference`):

- A persistent grid of programs, each walking tokens ``pid, pid + P, ...``.
  One token is ``hc`` hidden rows, ``hc`` keys and one value; the value is
  shared by all streams, so handling a whole token in one program reads it
  once instead of ``hc`` times (the one-program-per-(token, stream) kernel
  re-read it, and lost bandwidth:
  BENCHMARKS.md#straightforward-implementations-of-the-design).
- Pass 1 walks D in chunks of ``BLOCK_D`` and accumulates, per stream,
  ``sum x^2``, ``sum k^2`` and ``sum x * q_w * k_w * k``. The RMS factors are
  scalars per (token, stream), so they factor out of the dot:
  ``dot = sum(x w k) * rsqrt(mean x^2 + eps) * rsqrt(mean k^2 + eps) / sqrt(D)``.
- Pass 2 walks the chunks in reverse and writes ``out = x + g * value``. The
  second read of x hits L2: the chunks read last in pass 1 are re-read
  first, and the grid is capped (``programs_per_sm``) so that the x rows of
  all programs in flight stay far below L2 (2 x 132 x 40 KB ~ 10 MB at
  hc=4, D=5120, against 50 MB). Keys and value are read once and tagged
  evict-first; x is tagged evict-last in pass 1 and evict-first in pass 2
  (the convention of PyTorch Inductor's looped reductions).

DRAM traffic per token: ``hc*D`` x + ``(hc+1)*D`` kv read, ``hc*D`` out
written (bf16: 26*D bytes at hc=4, 130 KB at D=5120); the [hc, D] weights
come from L1/L2.

Each chunk is a ``[BLOCK_D // VEC, S_PAD, VEC]`` tile (``S`` streams, all
``hc`` by default) with VEC = 8 (16 bytes of bf16): a thread owns whole 16-byte vectors and folds them into its
accumulators with in-thread adds (``tl.sum(axis=2)``), so the three fp32
accumulators take 1/8 of the registers of the tile, leaving the rest for
loads in flight.

The launch configuration (:class:`engramrt.gate.config.GateKernelConfig`) also
splits a token's streams over several programs and unrolls the D loops, for
decode-sized batches where latency rather than bandwidth bounds the gate.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from engramrt._launch import CachedLauncher
from engramrt.gate.config import VEC, GateKernelConfig, default_gate_config
from engramrt.gate.reference import GateInputs
from engramrt.tuning import cached_choice

# GateKernelConfig and default_gate_config live in engramrt.gate.config (no Triton
# import); they are re-exported here, where the launcher's callers look.
__all__ = ["GateKernelConfig", "default_gate_config", "engram_gate_triton"]


@triton.jit
def _gate_sums_chunk(
    hidden_row,
    kv_row,
    q_weight_ptr,
    k_weight_ptr,
    chunk,
    stream,  # [1, S_PAD, 1] stream indices
    stream_ok,  # [1, S_PAD, 1]
    col,  # [BD/VEC, VEC]
    keep,
    sum_xx,
    sum_kk,
    sum_xwk,
    D,
    BLOCK_D: tl.constexpr,
):
    """Pass 1 on one chunk of D: the per-stream sums, folded over VEC inside each thread."""
    d = chunk * BLOCK_D + col  # [BD/VEC, VEC]
    offs = stream * D + d[:, None, :]  # [BD/VEC, S_PAD, VEC]
    mask = stream_ok & (d < D)[:, None, :]
    x = tl.load(hidden_row + offs, mask=mask, other=0.0, eviction_policy="evict_last")
    # A masked token's key does not matter (its output is x): skip reading it.
    k = tl.load(kv_row + offs, mask=mask & keep, other=0.0, eviction_policy="evict_first")
    q_w = tl.load(q_weight_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last")
    k_w = tl.load(k_weight_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last")
    x = x.to(tl.float32)
    k = k.to(tl.float32)
    w = q_w.to(tl.float32) * k_w.to(tl.float32)
    sum_xx += tl.sum(x * x, axis=2)
    sum_kk += tl.sum(k * k, axis=2)
    sum_xwk += tl.sum(x * w * k, axis=2)
    return sum_xx, sum_kk, sum_xwk


@triton.jit
def _gate_out_chunk(
    hidden_row,
    value_row,
    out_row,
    chunk,
    stream,
    stream_ok,
    col,
    keep,
    gate,  # [1, S_PAD, 1]
    D,
    BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Pass 2 on one chunk of D: ``out = x + gate * value``."""
    d = chunk * BLOCK_D + col
    offs = stream * D + d[:, None, :]
    mask = stream_ok & (d < D)[:, None, :]
    x = tl.load(hidden_row + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    x = x.to(tl.float32)
    value = tl.load(value_row + d, mask=(d < D) & keep, other=0.0, eviction_policy="evict_first")
    out = x + gate * value.to(tl.float32)[:, None, :]  # value read once for all streams
    if HAS_MASK:
        out = tl.where(keep, out, x)  # gate forced to 0, bit for bit
    tl.store(out_row + offs, out.to(tl.bfloat16), mask=mask)


@triton.jit
def _engram_gate_kernel(
    hidden_ptr,  # [T, HC, D], bf16 / fp16 / fp32
    kv_ptr,  # [T, (HC + 1) * D]: HC keys, then the value
    q_weight_ptr,  # [HC, D]
    k_weight_ptr,  # [HC, D]
    token_mask_ptr,  # [T] uint8 (bool storage); read only when HAS_MASK
    out_ptr,  # [T, HC, D] bf16
    num_tokens,
    D,
    eps,
    inv_sqrt_d,
    HC: tl.constexpr,
    S: tl.constexpr,  # streams per program
    S_PAD: tl.constexpr,
    GROUPS: tl.constexpr,  # ceil(HC / S) programs' worth of work per token
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    UNROLL: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(0).to(tl.int64)

    # Offsets inside one token's rows stay int32: they are below (HC + 1) * D,
    # which engram_gate's validation checks fits in int32. Row bases are int64.
    # Tiles are [BLOCK_D // VEC, S_PAD, VEC]: with the stream axis in the
    # middle, Triton gives each thread one 16-byte vector of every stream at
    # the same columns, so the value vector a thread needs is the one it loads
    # itself (no shuffle through shared memory) and a warp's load of one
    # stream is 512 contiguous bytes.
    lane = tl.arange(0, S_PAD)[None, :, None]  # [1, S_PAD, 1]
    col = tl.arange(0, BLOCK_D // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [BD/VEC, VEC]
    total = num_tokens * GROUPS

    # A while loop, not range(pid, total, num_programs): Triton's CPU
    # interpreter cannot iterate a range with runtime bounds under numpy 2.4.
    # The chunk count is a constexpr (ceil(D / BLOCK_D)) for the same reason.
    item = pid  # int64: (token, group of S streams)
    while item < total:
        token = item // GROUPS
        stream = (item - token * GROUPS).to(tl.int32) * S + lane  # [1, S_PAD, 1]
        stream_ok = (lane < S) & (stream < HC)
        hidden_row = hidden_ptr + token * (HC * D)
        kv_row = kv_ptr + token * ((HC + 1) * D)
        value_row = kv_row + HC * D
        out_row = out_ptr + token * (HC * D)
        if HAS_MASK:
            keep = tl.load(token_mask_ptr + token) != 0
        else:
            keep = True

        sum_xx = tl.zeros([BLOCK_D // VEC, S_PAD], dtype=tl.float32)
        sum_kk = tl.zeros([BLOCK_D // VEC, S_PAD], dtype=tl.float32)
        sum_xwk = tl.zeros([BLOCK_D // VEC, S_PAD], dtype=tl.float32)
        if UNROLL:
            for chunk in tl.static_range(NUM_CHUNKS):
                sum_xx, sum_kk, sum_xwk = _gate_sums_chunk(
                    hidden_row, kv_row, q_weight_ptr, k_weight_ptr, chunk, stream, stream_ok,
                    col, keep, sum_xx, sum_kk, sum_xwk, D, BLOCK_D,
                )  # fmt: skip
        else:
            for chunk in tl.range(0, NUM_CHUNKS, num_stages=NUM_STAGES):
                sum_xx, sum_kk, sum_xwk = _gate_sums_chunk(
                    hidden_row, kv_row, q_weight_ptr, k_weight_ptr, chunk, stream, stream_ok,
                    col, keep, sum_xx, sum_kk, sum_xwk, D, BLOCK_D,
                )  # fmt: skip

        x_rstd = tl.rsqrt(tl.sum(sum_xx, axis=0) / D + eps)  # [S_PAD]
        k_rstd = tl.rsqrt(tl.sum(sum_kk, axis=0) / D + eps)
        dot = tl.sum(sum_xwk, axis=0) * (x_rstd * k_rstd * inv_sqrt_d)  # [S_PAD]
        magnitude = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
        signed = tl.where(dot > 0, magnitude, tl.where(dot < 0, -magnitude, 0.0))
        gate = tl.sigmoid(signed)[None, :, None]  # [1, S_PAD, 1]

        # Pass 2, last chunk first: those x chunks were read most recently.
        if UNROLL:
            for step in tl.static_range(NUM_CHUNKS):
                _gate_out_chunk(
                    hidden_row, value_row, out_row, NUM_CHUNKS - 1 - step, stream, stream_ok,
                    col, keep, gate, D, BLOCK_D, HAS_MASK,
                )  # fmt: skip
        else:
            for step in tl.range(0, NUM_CHUNKS, num_stages=NUM_STAGES):
                _gate_out_chunk(
                    hidden_row, value_row, out_row, NUM_CHUNKS - 1 - step, stream, stream_ok,
                    col, keep, gate, D, BLOCK_D, HAS_MASK,
                )  # fmt: skip
        item += num_programs


# Binds the arguments through kernel[grid] once per specialisation, then calls
# the compiled kernel directly: a plain kernel[grid](...) binds every argument in
# Python on each call, host time of the order of the whole T=256 decode step.
_launch_gate_kernel = CachedLauncher(_engram_gate_kernel)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid_size(num_items: int, device: torch.device, config: GateKernelConfig) -> int:
    """Programs to launch: one per work item (a token or a group of its streams),
    capped at ``programs_per_sm`` per SM.

    The Triton interpreter (CPU tensors) has no SMs; we count one, which
    makes each program walk several tokens and so exercises the persistent
    loop in the CPU tests.
    """
    if config.programs_per_sm is None:
        return num_items
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        sm_count = _sm_count(index)
    else:
        sm_count = 1
    return max(1, min(num_items, sm_count * config.programs_per_sm))


def engram_gate_triton(
    inputs: GateInputs,
    out: torch.Tensor | None = None,
    config: GateKernelConfig | None = None,
) -> torch.Tensor:
    """Launch :func:`_engram_gate_kernel` on ``inputs``; shapes as in
    :func:`engramrt.gate.engram_gate`.

    Inputs are assumed valid and contiguous (``engram_gate`` checks them).
    Nothing here reads device memory or synchronises, so the call can be
    captured in a CUDA graph; with ``out`` given it allocates nothing.
    """
    hidden, kv, q_weight, k_weight, eps, token_mask = inputs
    num_tokens, hc, dim = hidden.shape
    if out is None:
        out = torch.empty((num_tokens, hc, dim), dtype=torch.bfloat16, device=hidden.device)
    if num_tokens == 0:
        return out
    if config is None:
        widest = max(t.element_size() for t in (hidden, kv, q_weight, k_weight))
        config = _default_config(hc, dim, widest, num_tokens, hidden.device)
    has_mask = token_mask is not None
    # bool storage is one byte; uint8 makes the pointer type explicit for Triton.
    mask_arg = token_mask.view(torch.uint8) if token_mask is not None else hidden
    groups, constexprs = _launch_plan(hc, dim, config, has_mask)
    grid = (_grid_size(num_tokens * groups, hidden.device, config),)
    args = (
        hidden,
        kv,
        q_weight,
        k_weight,
        mask_arg,
        out,
        num_tokens,
        dim,
        float(eps),
        1.0 / math.sqrt(dim),
    )
    # Entering torch.cuda.device costs microseconds, a fair part of a decode
    # step's gate: only when the inputs are not on the current device.
    if hidden.device.type == "cuda" and hidden.device.index != torch.cuda.current_device():
        with torch.cuda.device(hidden.device):
            _launch_gate_kernel(grid, *args, **constexprs)
    else:
        _launch_gate_kernel(grid, *args, **constexprs)
    return out


@cached_choice
def _default_config(
    hc: int, dim: int, element_bytes: int, num_tokens: int, device: torch.device
) -> GateKernelConfig:
    """:func:`default_gate_config` once per shape and device (the launch path runs every step)."""
    return default_gate_config(hc, dim, element_bytes, num_tokens, device)


@functools.cache
def _launch_plan(
    hc: int, dim: int, config: GateKernelConfig, has_mask: bool
) -> tuple[int, dict[str, Any]]:
    """Stream groups per token and the kernel's constexprs, once per shape and config
    (read only by the launcher, never changed)."""
    streams = min(hc, config.streams_per_program or hc)
    groups = triton.cdiv(hc, streams)
    constexprs: dict[str, Any] = {
        "HC": hc,
        "S": streams,
        "S_PAD": triton.next_power_of_2(streams),
        "GROUPS": groups,
        "BLOCK_D": config.block_d,
        "VEC": VEC,
        "NUM_CHUNKS": triton.cdiv(dim, config.block_d),
        "HAS_MASK": has_mask,
        "NUM_STAGES": config.num_stages,
        "UNROLL": config.unroll,
        "num_warps": config.num_warps,
    }
    return groups, constexprs
