"""The PLE layer's kernels as custom operators, so that ``torch.compile`` keeps them opaque.

The launchers of the layer's kernels live here. Under ``torch.compile``
:mod:`~engramrt.families.qwen4_ple.module` calls each kernel's operator instead of its
launcher: Inductor neither traces the Triton kernels (it cannot compile
``_ple_gate_norm_kernel``'s helpers, and it would re-fuse what the kernels round step by
step) nor reorders them; the GEMM and everything else around them stays
the compiler's. Eager calls launch directly (an operator's dispatch costs microseconds
a step). Each operator declares the tensors it writes; none returns an input.

============================  ========================================================
operator                      writes
============================  ========================================================
``ple_gather_rows``           ``out [T, C*d]``: rows of a device table
``ple_gather_mapped_rows``    ``out``: rows of host memory mapped for the device
``ple_gate_norm``             returns ``(gated, normed)`` ``[T, hc*D]``
``ple_conv_varlen``           ``out [T, hc*D]``
``ple_update_conv_states``    ``conv_states [slots, S, hc*D]``
============================  ========================================================
"""

from __future__ import annotations

from typing import Any

import torch

from engramrt._launch import next_pow2
from engramrt.families.qwen4_ple.layer import ple_conv_state_len
from engramrt.lookup.mapped import MappedHostRows

__all__ = [
    "KERNEL_DTYPES",
    "conv_launch",
    "gate_norm_launch",
    "gather_launch",
    "ple_conv_varlen_op",
    "ple_gate_norm_op",
    "ple_gather_mapped_rows_op",
    "ple_gather_rows_op",
    "ple_update_conv_states_op",
    "state_launch",
]


KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Model dtypes the kernels compute in, and their ``ROUND`` constexpr."""


# --------------------------------------------------------------------------
# Launching: a CachedLauncher per kernel. Eager calls launch directly; under
# torch.compile each launcher runs inside its custom operator (below), opaque to the
# compiler: Inductor does not trace these kernels.
# --------------------------------------------------------------------------

_LAUNCHERS: dict[str, Any] = {}


def _launch(name: str, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    from engramrt.families.qwen4_ple import layer_kernel

    launcher = _LAUNCHERS.get(name)
    if launcher is None:
        from engramrt._launch import CachedLauncher

        launcher = _LAUNCHERS[name] = CachedLauncher(getattr(layer_kernel, name))
    launcher(grid, *args, **constexprs)


# --------------------------------------------------------------------------
# The launchers (checked by module's validation layer, not here)
# --------------------------------------------------------------------------


def gather_launch(
    out: torch.Tensor,
    values: Any,
    row_ids: torch.Tensor,
    row_begin: int,
    row_stride: int,
    width: int,
    values_dtype: torch.dtype,
    pairs: int,
    warps: int,
) -> None:
    num_tokens, num_heads = row_ids.shape
    num_pairs = num_tokens * num_heads
    if num_pairs == 0:
        return
    _launch(
        "_ple_gather_rows_kernel",
        (-(-num_pairs // pairs),),
        out,
        values,
        row_ids,
        num_pairs,
        row_begin,
        row_ids.stride(0),
        row_stride,
        C=num_heads,
        WIDTH=width,
        BLOCK_P=pairs,
        BLOCK_W=next_pow2(width),
        WIDEN_BF16=values_dtype == torch.bfloat16 and out.dtype == torch.float32,
        num_warps=warps,
    )


def gate_norm_launch(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key: torch.Tensor,
    norm_query: torch.Tensor,
    norm_conv: torch.Tensor,
    token_mask: torch.Tensor | None,
    eps: float,
    hc: int,
    warps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gated, normed)`` ``[T, hc*D]`` in the norms' dtype (the model dtype)."""
    num_tokens, width = hidden.shape
    dim = width // hc
    gated = torch.empty((num_tokens, width), dtype=norm_conv.dtype, device=hidden.device)
    normed = torch.empty_like(gated)
    if num_tokens == 0:
        return gated, normed
    _launch(
        "_ple_gate_norm_kernel",
        (num_tokens * hc,),
        gated,
        normed,
        key,
        value,
        hidden,
        norm_key,
        norm_query,
        norm_conv,
        hidden if token_mask is None else token_mask,  # not read without a mask
        key.stride(0),
        value.stride(0),
        hidden.stride(0),
        eps,
        float(dim) ** 0.5,
        HC=hc,
        DIM=dim,
        BLOCK_D=next_pow2(dim),
        ROUND=KERNEL_DTYPES[norm_conv.dtype],
        HAS_MASK=token_mask is not None,
        num_warps=warps,
    )
    return gated, normed


def conv_launch(
    out: torch.Tensor,
    gated: torch.Tensor,
    normed: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv1d: torch.Tensor,
    ngram_size: int,
    tokens: int,
    width_tile: int,
    warps: int,
) -> None:
    """``out = a + SiLU(conv(b))`` ``[T, hc*D]`` (reads the pool, does not write it)."""
    num_tokens, width = normed.shape
    num_seqs = state_slots.shape[0]
    if num_tokens == 0:
        return
    if num_seqs == 0:
        out.zero_()
        return
    taps = conv1d.shape[2]
    # A multiple of 4 steps, so only a few variants compile as the batch size changes.
    search_steps = -(-(num_seqs - 1).bit_length() // 4) * 4
    grid = (-(-num_tokens // tokens), -(-width // width_tile))
    _launch(
        "_ple_conv_out_kernel",
        grid,
        out,
        gated,
        normed,
        conv_states,
        state_slots,
        query_start_loc,
        conv1d,
        num_tokens,
        num_seqs,
        WIDTH=width,
        K=taps,
        N=ngram_size,
        S=ple_conv_state_len(taps, ngram_size),
        SEARCH_STEPS=search_steps,
        ROUND=KERNEL_DTYPES[normed.dtype],
        WIDE=normed.dtype == torch.float32,
        BLOCK_T=tokens,
        BLOCK_W=width_tile,
        num_warps=warps,
    )


def state_launch(
    conv_states: torch.Tensor,
    normed: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    width_tile: int,
    warps: int,
) -> None:
    """Each sequence's pool row moves on by its tokens' ``b``, in place."""
    num_seqs = state_slots.shape[0]
    num_tokens, width = normed.shape
    if num_seqs == 0 or num_tokens == 0:
        return
    _launch(
        "_ple_conv_state_kernel",
        (num_seqs, -(-width // width_tile)),
        conv_states,
        normed,
        state_slots,
        query_start_loc,
        num_tokens,
        WIDTH=width,
        S=conv_states.shape[1],
        BLOCK_W=width_tile,
        num_warps=warps,
    )


# --------------------------------------------------------------------------
# The operators
# --------------------------------------------------------------------------


@torch.library.custom_op("engramrt::ple_gather_rows", mutates_args=("out",))
def ple_gather_rows_op(
    out: torch.Tensor,
    values: torch.Tensor,
    row_ids: torch.Tensor,
    row_begin: int,
    pairs: int,
    warps: int,
) -> None:
    """Rows ``values[row_ids - row_begin]`` of a device table ``[R, d]`` into ``out``."""
    gather_launch(out, values, row_ids, row_begin, int(values.stride(0)), int(values.shape[1]),
                  values.dtype, pairs, warps)  # fmt: skip


@ple_gather_rows_op.register_fake
def _(out, values, row_ids, row_begin, pairs, warps):  # fmt: skip
    return None


@torch.library.custom_op("engramrt::ple_gather_mapped_rows", mutates_args=("out",))
def ple_gather_mapped_rows_op(
    out: torch.Tensor,
    row_ids: torch.Tensor,
    address: int,
    num_rows: int,
    row_begin: int,
    row_stride: int,
    width: int,
    pairs: int,
    warps: int,
) -> None:
    """Rows of bf16 host memory mapped for the device at ``address`` (``num_rows`` rows,
    ``row_stride`` values apart, ``width`` each) into ``out``."""
    rows = MappedHostRows(address, num_rows, torch.bfloat16)
    gather_launch(out, rows, row_ids, row_begin, row_stride, width, torch.bfloat16, pairs,
                  warps)  # fmt: skip


@ple_gather_mapped_rows_op.register_fake
def _(out, row_ids, address, num_rows, row_begin, row_stride, width, pairs, warps):  # fmt: skip
    return None


# The launchers below are the operators' bodies as they are (their annotations give the
# schemas); eager calls keep calling the plain functions.

ple_gate_norm_op = torch.library.custom_op("engramrt::ple_gate_norm", mutates_args=())(
    gate_norm_launch
)


@ple_gate_norm_op.register_fake
def _(key, value, hidden, norm_key, norm_query, norm_conv, token_mask, eps, hc, warps):  # fmt: skip
    gated = hidden.new_empty(hidden.shape, dtype=norm_conv.dtype)
    return gated, torch.empty_like(gated)


ple_conv_varlen_op = torch.library.custom_op("engramrt::ple_conv_varlen", mutates_args=("out",))(
    conv_launch
)


@ple_conv_varlen_op.register_fake
def _(out, gated, normed, conv_states, state_slots, query_start_loc, conv1d, ngram_size,
      tokens, width_tile, warps):  # fmt: skip
    return None


ple_update_conv_states_op = torch.library.custom_op(
    "engramrt::ple_update_conv_states", mutates_args=("conv_states",)
)(state_launch)


@ple_update_conv_states_op.register_fake
def _(conv_states, normed, state_slots, query_start_loc, width_tile, warps):  # fmt: skip
    return None
