"""The PLE layer's kernels as custom operators, so that ``torch.compile`` keeps them opaque.

Under ``torch.compile`` each launcher of :mod:`~engramrt.families.qwen4_ple.module` calls
its operator here instead of launching: Inductor neither traces the Triton kernels (it
cannot compile ``_ple_gate_norm_kernel``'s helpers, and it would re-fuse what the kernels
round step by step) nor reorders them; the GEMM and everything else around them stays
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

import torch

from engramrt.lookup.mapped import MappedHostRows

__all__ = [
    "ple_conv_varlen_op",
    "ple_gate_norm_op",
    "ple_gather_mapped_rows_op",
    "ple_gather_rows_op",
    "ple_update_conv_states_op",
]


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
    from engramrt.families.qwen4_ple import module

    module._gather_launch(out, values, row_ids, row_begin, int(values.stride(0)),
                          int(values.shape[1]), values.dtype, pairs, warps)  # fmt: skip


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
    from engramrt.families.qwen4_ple import module

    rows = MappedHostRows(address, num_rows, torch.bfloat16)
    module._gather_launch(out, rows, row_ids, row_begin, row_stride, width, torch.bfloat16,
                          pairs, warps)  # fmt: skip


@ple_gather_mapped_rows_op.register_fake
def _(out, row_ids, address, num_rows, row_begin, row_stride, width, pairs, warps):  # fmt: skip
    return None


@torch.library.custom_op("engramrt::ple_gate_norm", mutates_args=())
def ple_gate_norm_op(
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
    """``(gated, normed)`` of :func:`~engramrt.families.qwen4_ple.module.ple_gate_norm`."""
    from engramrt.families.qwen4_ple import module

    return module._gate_norm_launch(key, value, hidden, norm_key, norm_query, norm_conv,
                                    token_mask, eps, hc, warps)  # fmt: skip


@ple_gate_norm_op.register_fake
def _(key, value, hidden, norm_key, norm_query, norm_conv, token_mask, eps, hc, warps):  # fmt: skip
    gated = hidden.new_empty(hidden.shape, dtype=norm_conv.dtype)
    return gated, torch.empty_like(gated)


@torch.library.custom_op("engramrt::ple_conv_varlen", mutates_args=("out",))
def ple_conv_varlen_op(
    out: torch.Tensor,
    gated: torch.Tensor,
    normed: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv1d: torch.Tensor,
    ngram_size: int,
    tokens: int,
    width: int,
    warps: int,
) -> None:
    """:func:`~engramrt.families.qwen4_ple.module.ple_conv_varlen` into ``out`` (reads the
    pool, does not write it)."""
    from engramrt.families.qwen4_ple import module

    module._conv_launch(out, gated, normed, conv_states, state_slots, query_start_loc, conv1d,
                        ngram_size, tokens, width, warps)  # fmt: skip


@ple_conv_varlen_op.register_fake
def _(out, gated, normed, conv_states, state_slots, query_start_loc, conv1d, ngram_size,
      tokens, width, warps):  # fmt: skip
    return None


@torch.library.custom_op("engramrt::ple_update_conv_states", mutates_args=("conv_states",))
def ple_update_conv_states_op(
    conv_states: torch.Tensor,
    normed: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    width: int,
    warps: int,
) -> None:
    """:func:`~engramrt.families.qwen4_ple.module.update_ple_conv_states`, in place."""
    from engramrt.families.qwen4_ple import module

    module._state_launch(conv_states, normed, state_slots, query_start_loc, width, warps)


@ple_update_conv_states_op.register_fake
def _(conv_states, normed, state_slots, query_start_loc, width, warps):  # fmt: skip
    return None
