"""The PLE layer of one engine step on a GPU: :class:`PleLayer` (docs/families.md §6).

One call takes a flat batch of sequence chunks (``query_start_loc``), each token's row ids
for this layer (``[T, C]``, :class:`~engramrt.families.qwen4_ple.ops.PleHasher`'s
``rows[:, l, :]``), the hidden streams ``[T, hc*D]`` and a caller-owned pool of conv
states (``conv_states [num_slots, S, hc*D]``, sequence ``i`` using row
``state_slots[i]``, as vLLM's mamba state indices), and returns the increment ``out [T,
hc*D]`` the decoder adds to its residual, updating each sequence's pool row in place to
its last ``S = (K-1)*N`` vectors ``b`` (a sequence with no tokens keeps its row).

No host synchronisation and no data-dependent shape: the call can be captured in a CUDA
graph and traced by ``torch.compile(fullgraph=True)``. Host checks of shapes, dtypes and
devices (no tensor is read) run when ``validate`` is on.

A step, part by part (each part a launcher below, with its plain torch reference)::

    e   = gather_ple_rows(table, row_ids)           # [T, E]      Triton: _ple_gather_rows_kernel
    kv  = e @ [key_proj; value_proj].T              # [T, (hc+1)*D] torch GEMM (fp32 accumulation)
    a,b = ple_gate_norm(key, value, hidden, ...)    # [T, hc*D]   Triton: _ple_gate_norm_kernel
    out = ple_conv_varlen(a, b, conv_states, ...)   # [T, hc*D]   Triton: _ple_conv_out_kernel
    update_ple_conv_states(conv_states, b, ...)     # in place    Triton: _ple_conv_state_kernel

The references are vectorised torch (no per-sequence loop, no host synchronisation), built
from the functions of :mod:`~engramrt.families.qwen4_ple.layer`: ``backend="reference"``
gives :func:`~engramrt.families.qwen4_ple.layer.ple_layer_reference_varlen`'s bits on the
CPU (each step the same torch operation on the same values). The kernels round as the
reference does (every numbered step to the model dtype; the conv's K taps one rounding
each, in tap order, rounded once to the model dtype); they differ from it only where the
reference's order is the machine's (the norms' and the score's sums, the GEMMs) or its
functions' (``exp`` in the sigmoid and SiLU): the gathered rows and the conv states' copy
are bit for bit, the output within
:func:`~engramrt.families.qwen4_ple.layer.ple_layer_tolerance` in fp32 and within
:func:`~engramrt.families.qwen4_ple.layer.ple_layer_enclosure` in bf16.

Tokens past ``query_start_loc[B]`` are padding (rows a CUDA graph was captured with): their
``out`` rows are 0 and they touch no state. ``state_slots`` must be distinct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engramrt._backend import resolve_backend
from engramrt.errors import ValidationError, describe_tensor
from engramrt.families.qwen4_ple.layer import (
    PleLayerWeights,
    accumulate_dtype,
    ple_conv_state_len,
    ple_gate_norm_reference,
)
from engramrt.families.qwen4_ple.layer_ops import (
    KERNEL_DTYPES,
    conv_launch,
    gate_norm_launch,
    gather_launch,
    state_launch,
)
from engramrt.family import BF16
from engramrt.lookup.tiers.base import RowStore

__all__ = [
    "PleKernelConfig",
    "PleLayer",
    "PleTable",
    "gather_ple_rows",
    "gather_ple_rows_reference",
    "ple_conv_varlen",
    "ple_conv_varlen_reference",
    "ple_gate_norm",
    "ple_gate_norm_reference",
    "update_ple_conv_states",
    "update_ple_conv_states_reference",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class PleKernelConfig:
    """Launch settings of the PLE layer's kernels (one value, passed whole).

    Attributes:
        gather_pairs: (token, head) rows per gather program.
        gather_warps: warps of a gather program.
        gate_warps: warps of a gate/norm program (one token's stream of D values).
        conv_tokens, conv_width: the conv program's tile ``[tokens, channels]``.
        conv_warps: warps of a conv program.
        state_width: channels per state-update program (it walks the S rows).
        state_warps: warps of a state-update program.

    The defaults are first choices, not measured: the kernels move a few MB each at decode
    256 and are bound by memory; the bench cases ``ple/layer ...`` time them.
    """

    gather_pairs: int = 16
    gather_warps: int = 4
    gate_warps: int = 4
    conv_tokens: int = 8
    conv_width: int = 256
    conv_warps: int = 4
    state_width: int = 512
    state_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("gather_pairs", "conv_tokens", "conv_width", "state_width"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < 1
                or (value & (value - 1))
            ):
                raise ValidationError(f"{name}={value!r}; expected a power of two >= 1")
        for name in ("gather_warps", "gate_warps", "conv_warps", "state_warps"):
            value = getattr(self, name)
            if value not in (1, 2, 4, 8, 16):
                raise ValidationError(f"{name}={value!r}; expected 1, 2, 4, 8 or 16 warps")


DEFAULT_KERNEL_CONFIG = PleKernelConfig()


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------


class PleTable:
    """One PLE layer's table as the layer reads it: a bf16
    :class:`~engramrt.lookup.tiers.base.RowStore` (``row_format=BF16``, any tier), or a
    plain tensor ``[R, d]`` (the device tier without a store).

    Attributes:
        width: ``d``, values per row.
        dtype: the stored values' dtype (bf16 for a store).
        device: where the rows are read to.
        row_begin: the first global row held (row id ``r`` is local row ``r - row_begin``).
        values: the rows as the device's kernels read them in place, ``[rows, d]`` (a
            tensor, or host memory mapped for the device); None where only
            :meth:`RowStore.gather_packed <engramrt.lookup.tiers.base.RowStore.gather_packed>`
            reads them (the host and disk tiers, which synchronise).
    """

    def __init__(self, table: RowStore | torch.Tensor) -> None:
        self.store: RowStore | None = None
        if isinstance(table, RowStore):
            if table.row_format != BF16:
                raise ValidationError(
                    f"table is a store of {table.row_format.describe(table.E)}; expected "
                    f"row_format=BF16 (a PLE table holds bf16 rows)"
                )
            if table.col_begin != 0 or table.col_end is not None:
                raise ValidationError(
                    f"table serves hash columns [{table.col_begin}, {table.col_end}); expected "
                    f"every column (a PLE table is split by width, not by columns)"
                )
            self.store = table
            self.width, self.dtype, self.device = table.E, torch.bfloat16, table.device
            self.row_begin = table.row_begin
            rows = table.device_rows()
            self.values = None if rows is None else rows.view(torch.bfloat16)
        elif isinstance(table, torch.Tensor):
            if table.dim() != 2 or table.shape[1] == 0 or not table.is_floating_point():
                raise ValidationError(
                    f"table has {describe_tensor(table)}; expected a floating [R, d] tensor "
                    f"or a bf16 RowStore"
                )
            if table.stride(1) != 1:
                raise ValidationError(
                    f"table has strides {list(table.stride())}; expected contiguous rows"
                )
            self.width, self.dtype, self.device = int(table.shape[1]), table.dtype, table.device
            self.row_begin = 0
            self.values = table
        else:
            raise ValidationError(
                f"table is a {type(table).__name__}; expected a bf16 RowStore or a tensor [R, d]"
            )

    @property
    def row_stride(self) -> int:
        """Elements between two rows of :attr:`values`."""
        if isinstance(self.values, torch.Tensor):
            return int(self.values.stride(0))
        return self.width


def gather_ple_rows_reference(
    table: PleTable, row_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``e [T, C*d]`` in ``dtype``: token t's C rows concatenated (head c in columns ``c*d ..
    c*d + d - 1``), read with ``index_select`` or the store's ``gather_packed``."""
    num_tokens, num_heads = row_ids.shape
    local = row_ids.reshape(-1).to(torch.int64)
    if table.row_begin:
        local = local - table.row_begin
    if table.store is not None:
        rows = table.store.gather_packed(local).view(torch.bfloat16)
    else:
        assert isinstance(table.values, torch.Tensor)
        rows = table.values.index_select(0, local.to(table.values.device))
    return rows.reshape(num_tokens, num_heads * table.width).to(dtype)


def gather_ple_rows(
    table: PleTable,
    row_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    backend: str = "triton",
    config: PleKernelConfig = DEFAULT_KERNEL_CONFIG,
) -> torch.Tensor:
    """:func:`gather_ple_rows_reference` into ``out [T, C*d]`` (model dtype, contiguous).
    The kernel reads ``table.values`` in place; a table without them (host tiers) is read
    by the reference. Rows in ``[row_begin, row_begin + rows)`` are the caller's promise."""
    if backend == "reference" or table.values is None:
        out.copy_(gather_ple_rows_reference(table, row_ids, out.dtype))
        return out
    if torch.compiler.is_compiling():  # opaque to the compiler (layer_ops)
        if isinstance(table.values, torch.Tensor):
            torch.ops.engramrt.ple_gather_rows(out, table.values, row_ids, table.row_begin,
                                               config.gather_pairs, config.gather_warps)  # fmt: skip
        else:
            torch.ops.engramrt.ple_gather_mapped_rows(
                out, row_ids, int(table.values.data_ptr()), int(table.values.num_rows),
                table.row_begin, table.row_stride,
                table.width, config.gather_pairs, config.gather_warps,
            )  # fmt: skip
        return out
    gather_launch(out, table.values, row_ids, table.row_begin, table.row_stride, table.width,
                  table.dtype, config.gather_pairs, config.gather_warps)  # fmt: skip
    return out


# --------------------------------------------------------------------------
# Steps 2-7 after the projections
# --------------------------------------------------------------------------


def ple_gate_norm(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    weights: PleLayerWeights,
    eps: float,
    token_mask: torch.Tensor | None,
    *,
    backend: str = "triton",
    config: PleKernelConfig = DEFAULT_KERNEL_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ple_gate_norm_reference` by ``_ple_gate_norm_kernel`` (one program per token
    and stream). ``key``, ``value`` and ``hidden`` need unit column stride (any row stride:
    ``key`` and ``value`` are column ranges of one GEMM output)."""
    if backend == "reference":
        return ple_gate_norm_reference(key, value, hidden, weights, eps, token_mask)
    hc = weights.hc_count
    if torch.compiler.is_compiling():
        return torch.ops.engramrt.ple_gate_norm(  # type: ignore[no-any-return]
            key, value, hidden, weights.norm_key, weights.norm_query, weights.norm_conv,
            token_mask, float(eps), hc, config.gate_warps,
        )  # fmt: skip
    return gate_norm_launch(key, value, hidden, weights.norm_key, weights.norm_query,
                            weights.norm_conv, token_mask, float(eps), hc,
                            config.gate_warps)  # fmt: skip


# --------------------------------------------------------------------------
# Steps 8-9: the varlen dilated conv, and the state pool
# --------------------------------------------------------------------------


def _token_sequences(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T]`` int64: each token's sequence (``B`` for padding past ``query_start_loc[B]``)."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:].to(torch.int64), tokens, right=True)


def _state_window(
    conv_states: torch.Tensor, normed: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    """``[B*S + T, hc*D]``: every sequence's state rows (sequence i's at ``i*S``), then ``b``."""
    num_seqs = state_slots.shape[0]
    states = conv_states.index_select(0, state_slots.to(torch.int64))  # [B, S, W]
    return torch.cat([states.reshape(num_seqs * conv_states.shape[1], -1), normed])


def ple_conv_varlen_reference(
    gated: torch.Tensor,
    normed: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv1d: torch.Tensor,
    ngram_size: int,
) -> torch.Tensor:
    """``out = a + SiLU(conv(b))`` ``[T, hc*D]`` for a flat batch, vectorised.

    Token t of sequence i at position p of its chunk reads tap j from ``b[t - (K-1-j)*N]``
    when ``p >= (K-1-j)*N``, else from ``conv_states[state_slots[i], S + p - (K-1-j)*N]``;
    the taps are summed as the reference's ``_short_conv`` (one rounding each in tap order,
    then the model dtype, SiLU). Padding tokens give 0.
    """
    dtype, acc = normed.dtype, accumulate_dtype(normed.dtype)
    wide = torch.float64 if acc == torch.float32 else acc
    num_tokens, width = normed.shape
    num_seqs, state_len = state_slots.shape[0], conv_states.shape[1]
    taps = conv1d.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return normed.new_zeros(num_tokens, width)
    qsl = query_start_loc.to(torch.int64)
    tokens = torch.arange(num_tokens, device=normed.device)
    seq = _token_sequences(query_start_loc, num_tokens)
    real = seq < num_seqs
    seq = seq.clamp_max(num_seqs - 1)
    position = tokens - qsl.index_select(0, seq)
    window = _state_window(conv_states, normed, state_slots)
    chunk_base = num_seqs * state_len
    total = torch.zeros(normed.shape, dtype=acc, device=normed.device)
    for tap in range(taps):
        back = (taps - 1 - tap) * ngram_size
        source = position - back
        rows = torch.where(
            source >= 0, chunk_base + tokens - back, seq * state_len + state_len + source
        )
        product = conv1d[:, 0, tap].to(wide) * window.index_select(0, rows).to(wide)
        total = (total.to(wide) + product).to(acc)
    mixed = F.silu(total.to(dtype).to(acc)).to(dtype)
    out = (gated.to(acc) + mixed.to(acc)).to(dtype)
    return torch.where(real.unsqueeze(-1), out, torch.zeros((), dtype=dtype, device=out.device))


def ple_conv_varlen(
    gated: torch.Tensor,
    normed: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    conv1d: torch.Tensor,
    ngram_size: int,
    out: torch.Tensor,
    *,
    backend: str = "triton",
    config: PleKernelConfig = DEFAULT_KERNEL_CONFIG,
) -> torch.Tensor:
    """:func:`ple_conv_varlen_reference` into ``out`` by ``_ple_conv_out_kernel``; reads the
    pool, does not write it (:func:`update_ple_conv_states` does, afterwards)."""
    if backend == "reference":
        out.copy_(
            ple_conv_varlen_reference(
                gated, normed, conv_states, state_slots, query_start_loc, conv1d, ngram_size
            )
        )
        return out
    if torch.compiler.is_compiling():
        torch.ops.engramrt.ple_conv_varlen(
            out, gated, normed, conv_states, state_slots, query_start_loc, conv1d, ngram_size,
            config.conv_tokens, config.conv_width, config.conv_warps,
        )  # fmt: skip
        return out
    conv_launch(out, gated, normed, conv_states, state_slots, query_start_loc, conv1d,
                ngram_size, config.conv_tokens, config.conv_width, config.conv_warps)  # fmt: skip
    return out


def update_ple_conv_states_reference(
    conv_states: torch.Tensor,
    normed: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """In place: ``conv_states[state_slots[i]]`` becomes the last S rows of ``state ++
    b_chunk`` of sequence i (unchanged for an empty chunk). Slots must be distinct."""
    num_seqs, state_len = state_slots.shape[0], conv_states.shape[1]
    if num_seqs == 0 or normed.shape[0] == 0:
        return
    qsl = query_start_loc.to(torch.int64)
    counts = qsl[1:] - qsl[:-1]  # [B]
    rows = torch.arange(state_len, device=normed.device)
    source = rows.unsqueeze(0) + counts.unsqueeze(1)  # [B, S] row of state ++ chunk
    seqs = torch.arange(num_seqs, device=normed.device).unsqueeze(1)
    index = torch.where(
        source < state_len,
        seqs * state_len + source,
        num_seqs * state_len + qsl[:-1].unsqueeze(1) + source - state_len,
    )
    window = _state_window(conv_states, normed, state_slots)
    new = window.index_select(0, index.reshape(-1)).view(num_seqs, state_len, -1)
    conv_states.index_copy_(0, state_slots.to(torch.int64), new)


def update_ple_conv_states(
    conv_states: torch.Tensor,
    normed: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    backend: str = "triton",
    config: PleKernelConfig = DEFAULT_KERNEL_CONFIG,
) -> None:
    """:func:`update_ple_conv_states_reference` by ``_ple_conv_state_kernel`` (a copy: bit
    for bit). Call after every read of the pool by :func:`ple_conv_varlen`."""
    if backend == "reference":
        update_ple_conv_states_reference(conv_states, normed, state_slots, query_start_loc)
        return
    if torch.compiler.is_compiling():
        torch.ops.engramrt.ple_update_conv_states(
            conv_states, normed, state_slots, query_start_loc, config.state_width,
            config.state_warps,
        )  # fmt: skip
        return
    state_launch(conv_states, normed, state_slots, query_start_loc, config.state_width,
                 config.state_warps)  # fmt: skip


# --------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------


class PleLayer:
    """One PLE layer's step over a flat batch (docs/families.md §6): see the module doc.

    Args:
        weights: the layer's parameters (their dtype is the model dtype, their device the
            compute device). The layer keeps ``key_proj`` and ``value_proj`` as one
            ``[(hc+1)*D, E]`` tensor (one GEMM a step) and the others as given.
        table: a bf16 :class:`~engramrt.lookup.tiers.base.RowStore` of ``d`` values a row
            (``row_format=BF16``; device and UVA tiers are read by the kernel in place, host
            tiers through ``gather_packed``, which synchronises), or a tensor ``[R, d]`` on
            the compute device (bf16, or the model dtype). ``C = E / d`` heads. None: a
            layer that is given its rows (:meth:`compute_rows`; the runtime's
            :class:`~engramrt.families.qwen4_ple.serving.PleHead`), with ``table_width``.
        table_width: ``d`` when ``table`` is None.
        ngram_size: ``N``, the conv's dilation.
        eps: ``rms_norm_eps``.
        backend: ``"auto"`` (the kernels on CUDA or under ``TRITON_INTERPRET=1``, else the
            reference), ``"triton"`` or ``"reference"`` (vectorised torch: the kernels'
            definition). A float64 model runs the reference.
        validate: check every call's shapes, dtypes and devices on the host (reads no
            tensor, never synchronises); off on a hot path whose inputs are known good.
        kernel_config: launch settings (:class:`PleKernelConfig`).

    Raises:
        ValidationError: naming the argument, what it is and what was expected.
    """

    def __init__(
        self,
        weights: PleLayerWeights,
        table: RowStore | torch.Tensor | None,
        *,
        ngram_size: int,
        eps: float,
        backend: str = "auto",
        validate: bool = True,
        kernel_config: PleKernelConfig | None = None,
        table_width: int | None = None,
    ) -> None:
        if not isinstance(weights, PleLayerWeights):
            raise ValidationError(
                f"weights is a {type(weights).__name__}; expected a PleLayerWeights"
            )
        if isinstance(ngram_size, bool) or not isinstance(ngram_size, int) or ngram_size < 1:
            raise ValidationError(f"ngram_size={ngram_size!r}; expected a positive integer (N)")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValidationError(f"eps={eps!r}; expected a positive float (rms_norm_eps)")
        if kernel_config is not None and not isinstance(kernel_config, PleKernelConfig):
            raise ValidationError(
                f"kernel_config={kernel_config!r}; expected a PleKernelConfig or None"
            )
        self.table: PleTable | None = None
        if table is None:
            if isinstance(table_width, bool) or not isinstance(table_width, int) or table_width < 1:
                raise ValidationError(
                    f"table=None and table_width={table_width!r}; expected the rows' width d "
                    f"(a positive integer) for a layer given its rows"
                )
            self.table_width = table_width
        else:
            self.table = PleTable(table)
            self.table_width = self.table.width
        self.device = weights.device
        self.dtype = weights.dtype
        self.hidden_size, self.hc_count = weights.hidden_size, weights.hc_count
        self.width = self.hc_count * self.hidden_size
        self.embed_dim = weights.embed_dim
        if self.embed_dim % self.table_width:
            raise ValidationError(
                f"table rows have d={self.table_width} values; expected a divisor of the "
                f"weights' E={self.embed_dim} (C = E / d heads)"
            )
        self.num_heads = self.embed_dim // self.table_width
        if self.table is None:
            pass
        elif self.table.device != self.device:
            raise ValidationError(
                f"table reads to {self.table.device}; expected the weights' device {self.device}"
            )
        elif self.table.dtype not in (torch.bfloat16, self.dtype):
            raise ValidationError(
                f"table holds {self.table.dtype}; expected bf16 or the model dtype {self.dtype}"
            )
        self.ngram_size = ngram_size
        self.eps = float(eps)
        self.conv_kernel_size = weights.conv_kernel_size
        self.state_len = ple_conv_state_len(self.conv_kernel_size, ngram_size)
        self.validate = validate
        self.kernel_config = kernel_config or DEFAULT_KERNEL_CONFIG
        if backend == "triton" and self.dtype not in KERNEL_DTYPES:
            raise ValidationError(
                f"backend='triton' with model dtype {self.dtype}; the kernels compute in fp32 "
                f"for bf16, fp16 and fp32 models (use backend='reference')"
            )
        resolved = resolve_backend(backend, self.device)
        self.backend = resolved if self.dtype in KERNEL_DTYPES else "reference"
        if (
            self.backend == "triton"
            and self.table is not None
            and self.table.dtype != self.dtype
            and self.dtype != torch.float32
        ):
            raise ValidationError(
                f"table holds {self.table.dtype} for a {self.dtype} model; the kernel widens "
                f"bf16 rows to fp32 only (give the table in the model dtype)"
            )
        # One [(hc+1)*D, E] weight: key and value from one GEMM; the weights hold views.
        # The layer owns copies of all of them: weights loaded in place later
        # (PleHead.load_weights) must not reach a tensor another layer was built from.
        self.kv_proj = torch.cat([weights.key_proj, weights.value_proj]).contiguous()
        own = torch.contiguous_format
        self.weights = PleLayerWeights(
            key_proj=self.kv_proj[: self.width],
            value_proj=self.kv_proj[self.width :],
            norm_key=weights.norm_key.clone(memory_format=own),
            norm_query=weights.norm_query.clone(memory_format=own),
            norm_conv=weights.norm_conv.clone(memory_format=own),
            conv1d=weights.conv1d.clone(memory_format=own),
        )

    @classmethod
    def from_config(
        cls,
        config: Any,
        weights: PleLayerWeights,
        table: RowStore | torch.Tensor | None,
        **options: Any,
    ) -> PleLayer:
        """The layer of a :class:`~engramrt.families.qwen4_ple.config.PleConfig` (``N``,
        ``eps`` from it; ``D``, ``hc``, ``E``, ``K`` of the weights checked against it)."""
        from engramrt.families.qwen4_ple.config import PleConfig

        if not isinstance(config, PleConfig):
            config = PleConfig.from_hf(config)
        expected = {
            "hidden_size": config.hidden_size,
            "hc_count": config.hc_count,
            "embed_dim": config.embed_dim,
            "conv_kernel_size": config.ple_conv_kernel_size,
        }
        for name, value in expected.items():
            if getattr(weights, name) != value:
                raise ValidationError(
                    f"weights have {name}={getattr(weights, name)}; expected the config's {value}"
                )
        return cls(weights, table, ngram_size=config.ngram_size, eps=config.rms_norm_eps, **options)

    def new_conv_states(self, num_slots: int) -> torch.Tensor:
        """A zeroed pool ``[num_slots, S, hc*D]`` (model dtype, on the device): each row a
        sequence's start state."""
        return torch.zeros(
            (num_slots, self.state_len, self.width), dtype=self.dtype, device=self.device
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        row_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        conv_states: torch.Tensor,
        state_slots: torch.Tensor,
        *,
        token_mask: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The increment ``out [T, hc*D]`` of one step; the pool rows of its sequences move on.

        Args:
            hidden: ``[T, hc*D]`` the decoder layer's input streams (model dtype, unit
                column stride).
            row_ids: ``[T, C]`` int32/int64 global rows of this layer's table (unit column
                stride: ``PleHasher``'s ``rows[:, l, :]`` as it is).
            query_start_loc: ``[B + 1]`` int32/int64, non-decreasing from 0 to at most T
                (sequence i owns tokens ``query_start_loc[i] .. query_start_loc[i+1] - 1``).
            conv_states: ``[num_slots, S, hc*D]`` model dtype, contiguous: the pool, updated
                in place (rows oldest first; zeros at a sequence's start).
            state_slots: ``[B]`` int32/int64, distinct: sequence i's pool row.
            token_mask: optional bool ``[T]``; False zeroes the token's ``a`` and ``b``
                (padding of a masked batch; its id must have been hashed as EOS).
            out: optional ``[T, hc*D]`` model dtype, contiguous (a fixed address).

        Returns:
            ``out``: 0 at tokens past ``query_start_loc[B]``.
        """
        if self.table is None:
            raise ValidationError(
                "this PleLayer has no table (table=None): give it rows with compute_rows()"
            )
        if self.validate:
            self._check_call(hidden, row_ids, query_start_loc, conv_states, state_slots,
                             token_mask, out)  # fmt: skip
        num_tokens = hidden.shape[0]
        rows = torch.empty((num_tokens, self.embed_dim), dtype=self.dtype, device=self.device)
        config = self.kernel_config
        gather_ple_rows(self.table, row_ids, rows, backend=self.backend, config=config)  # e
        return self._from_rows(hidden, rows, query_start_loc, conv_states, state_slots,
                               token_mask, out)  # fmt: skip

    def compute_rows(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        query_start_loc: torch.Tensor,
        conv_states: torch.Tensor,
        state_slots: torch.Tensor,
        *,
        token_mask: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`__call__` for rows already gathered: ``rows [T, E]`` (each token's ``C``
        rows of ``d`` values, concatenated) in the model dtype or bf16, unit column stride;
        the other arguments as :meth:`__call__`'s."""
        if self.validate:
            self._check_call(hidden, None, query_start_loc, conv_states, state_slots,
                             token_mask, out)  # fmt: skip
            if (
                not isinstance(rows, torch.Tensor)
                or list(rows.shape) != [hidden.shape[0], self.embed_dim]
                or rows.dtype not in (torch.bfloat16, self.dtype)
                or rows.device != self.device
                or (rows.shape[0] > 1 and rows.stride(1) != 1)
            ):
                what = (
                    describe_tensor(rows, device=True)
                    if isinstance(rows, torch.Tensor)
                    else f"a {type(rows).__name__}"
                )
                raise ValidationError(
                    f"rows has {what}; "
                    f"expected [T = {hidden.shape[0]}, E = {self.embed_dim}] bf16 or "
                    f"{self.dtype} with unit column stride on {self.device}"
                )
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        return self._from_rows(hidden, rows, query_start_loc, conv_states, state_slots,
                               token_mask, out)  # fmt: skip

    def _from_rows(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        query_start_loc: torch.Tensor,
        conv_states: torch.Tensor,
        state_slots: torch.Tensor,
        token_mask: torch.Tensor | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if out is None:
            out = torch.empty((num_tokens, self.width), dtype=self.dtype, device=self.device)
        backend, config, weights = self.backend, self.kernel_config, self.weights
        if backend == "reference":
            # The reference's two GEMMs (the same bits as one on the CPU, not promised).
            key = F.linear(rows, weights.key_proj)
            value = F.linear(rows, weights.value_proj)
        else:
            projected = F.linear(rows, self.kv_proj)  # [T, (hc+1)*D]
            key, value = projected[:, : self.width], projected[:, self.width :]
        gated, normed = ple_gate_norm(
            key, value, hidden, weights, self.eps, token_mask, backend=backend, config=config
        )
        ple_conv_varlen(
            gated,
            normed,
            conv_states,
            state_slots,
            query_start_loc,
            weights.conv1d,
            self.ngram_size,
            out,
            backend=backend,
            config=config,
        )
        update_ple_conv_states(
            conv_states, normed, state_slots, query_start_loc, backend=backend, config=config
        )
        return out

    def _check_call(
        self,
        hidden: Any,
        row_ids: Any,
        query_start_loc: Any,
        conv_states: Any,
        state_slots: Any,
        token_mask: Any,
        out: Any,
    ) -> None:
        """Types, shapes, dtypes, layouts and devices (host metadata only)."""
        device, dtype, width = self.device, self.dtype, self.width

        def found(value: Any) -> str:
            if isinstance(value, torch.Tensor):
                return f"{describe_tensor(value, device=True)} strides {list(value.stride())}"
            return f"a {type(value).__name__}"

        def refuse(name: str, value: Any, expected: str) -> ValidationError:
            return ValidationError(f"{name} has {found(value)}; expected {expected} on {device}")

        def ok(value: Any, ndim: int, dtypes: tuple[torch.dtype, ...]) -> bool:
            return (
                isinstance(value, torch.Tensor)
                and value.dim() == ndim
                and value.dtype in dtypes
                and value.device == device
            )

        if (
            not ok(hidden, 2, (dtype,))
            or hidden.shape[1] != width
            or (hidden.shape[0] > 1 and hidden.stride(1) != 1)
        ):
            raise refuse("hidden", hidden, f"[T, hc*D = {width}] {dtype} with unit column stride")
        num_tokens = hidden.shape[0]
        if row_ids is not None and (
            not ok(row_ids, 2, _INDEX_DTYPES)
            or list(row_ids.shape)
            != [
                num_tokens,
                self.num_heads,
            ]
            or (self.num_heads > 1 and row_ids.stride(1) != 1)
        ):
            raise refuse(
                "row_ids",
                row_ids,
                f"[T = {num_tokens}, C = {self.num_heads}] int32/int64 with unit column stride",
            )
        if (
            not ok(query_start_loc, 1, _INDEX_DTYPES)
            or query_start_loc.shape[0] < 1
            or not query_start_loc.is_contiguous()
        ):
            raise refuse("query_start_loc", query_start_loc, "a contiguous [B + 1] int32/int64")
        num_seqs = query_start_loc.shape[0] - 1
        if (
            not ok(state_slots, 1, _INDEX_DTYPES)
            or state_slots.shape[0] != num_seqs
            or (not state_slots.is_contiguous())
        ):
            raise refuse("state_slots", state_slots, f"a contiguous [B = {num_seqs}] int32/int64")
        if (
            not ok(conv_states, 3, (dtype,))
            or list(conv_states.shape[1:]) != [self.state_len, width]
            or not conv_states.is_contiguous()
        ):
            raise refuse(
                "conv_states",
                conv_states,
                f"a contiguous [num_slots, S = {self.state_len}, hc*D = {width}] {dtype}",
            )
        if token_mask is not None and (
            not ok(token_mask, 1, (torch.bool,)) or token_mask.shape[0] != num_tokens
        ):
            raise refuse("token_mask", token_mask, f"None or a torch.bool [T = {num_tokens}]")
        if out is not None and (
            not ok(out, 2, (dtype,))
            or list(out.shape) != [num_tokens, width]
            or not out.is_contiguous()
        ):
            raise refuse("out", out, f"None or a contiguous [{num_tokens}, {width}] {dtype}")
