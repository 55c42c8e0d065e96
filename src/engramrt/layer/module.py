"""``EngramLayer``: table lookup, ``wkv`` projection and gate as one module (SPEC §8).

One step of a layer::

    layer.prepare(row_ids, stream=side)    # optional: start the lookup early
    ...                                    # backbone layers run meanwhile
    out = layer(hidden)                    # wait for the rows, wkv, gate

or simply ``out = layer(hidden, row_ids)``.

Staging and graph safety. Every intermediate lives in a buffer allocated at
construction for ``max_tokens`` tokens: the rows ``[max_tokens, C, E]``, kv
``[max_tokens, (hc+1)*D]`` and the output ``[max_tokens, hc, D]`` (plus the
sequence-parallel exchange buffers). A step writes leading slices of them,
so its addresses depend only on ``T``: on the device tier ``prepare`` and
``forward`` allocate nothing, read no device memory on the host and never
synchronise, and both can be captured in one CUDA graph per ``T`` (capture
``prepare`` together with ``forward``: a captured stream cannot wait for an
event recorded outside the capture). The host and disk tiers synchronise
inside their lookup (the CPU must learn the ids), so they run eagerly only.

**The returned tensor is a view of the layer's output buffer**: the next
step overwrites it (as with any CUDA-graph output). Pass ``out=`` or clone
it to keep it.

Overlap. ``prepare(row_ids, stream=s)`` makes ``s`` wait for the work
already queued on the current stream (the hashing that produced
``row_ids``, and the previous step's ``forward``, which read the rows
buffer this lookup overwrites), runs the lookup (and the sequence-parallel
exchange) on ``s`` and records an event there; ``forward`` makes the
current stream wait for that event. The layer holds a reference to
``row_ids`` until then, so the caching allocator cannot hand its memory to
someone else while ``s`` still reads it.

Memory at V4.1-Flash shapes (D = 5120, hc = 4, C = 24, E = 256), per
``max_tokens`` token: rows 12 KiB + kv 50 KiB + out 40 KiB = 102 KiB
(0.8 GiB at 8192), plus 12 KiB for the sequence-parallel lookup buffer
(and 2 x 12/tp KiB for all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engramrt.config import EngramConfig
from engramrt.errors import CheckpointError, ShardingError, ValidationError
from engramrt.gate import engram_gate
from engramrt.layer.linear import EngramLinear
from engramrt.layer.parallel import SequenceParallelRows, tokens_per_rank
from engramrt.lookup.tiers.base import RowStore

__all__ = ["EngramLayer"]

_ID_DTYPES = (torch.int32, torch.int64)
_NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class _Prepared:
    """A batch whose rows ``prepare`` staged and ``forward`` has not consumed."""

    num_tokens: int
    row_ids: torch.Tensor  # kept alive until the lookup stream is joined
    event: Any  # torch.cuda.Event recorded after the lookup, or None


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {list(tensor.shape)} dtype {tensor.dtype}"


class EngramLayer(nn.Module):
    """One Engram layer: rows from a :class:`RowStore`, ``wkv``, the fused gate.

    Args:
        config: the Engram config (``hidden_size`` D, ``hc_mult``,
            ``head_dim`` E, ``n_cols`` C, ``rms_norm_eps``).
        store: the layer's table, or this rank's column shard under
            sequence parallelism; the layer runs on ``store.device``.
        max_tokens: the most tokens ``T`` one step may have (all ranks
            together under sequence parallelism); sizes the staging buffers.
        group: a tensor-parallel process group for sequence parallelism
            (:mod:`engramrt.layer.parallel`), or None.
        collective: ``"reduce_scatter"`` or ``"all_to_all"`` (with ``group``).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` for the gate
            (the store has its own for the lookup).
        validate: check shapes, dtypes, devices and token counts on the host
            every step (no device reads). Off only for known-good callers.

    Attributes:
        wkv: the :class:`EngramLinear` projection ``[C*E] -> [(hc+1)*D]``.
        q_weight, k_weight: ``[hc, D]`` RMSNorm weights of the gate.
    """

    def __init__(
        self,
        config: EngramConfig,
        store: RowStore,
        *,
        max_tokens: int,
        group: Any = None,
        collective: str = "reduce_scatter",
        backend: str = "auto",
        validate: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValidationError(f"max_tokens={max_tokens!r}; expected a positive integer")
        if not isinstance(store, RowStore):
            raise ValidationError(f"store is a {type(store).__name__}; expected a RowStore")
        self.config = config
        self.hidden_size = config.hidden_size
        self.hc_mult = config.hc_mult
        self.head_dim = config.head_dim
        self.num_cols = config.n_cols
        self.eps = float(config.rms_norm_eps)
        if self.head_dim != store.E:
            raise ValidationError(
                f"store holds rows of E={store.E} values; config {config.name!r} has "
                f"head_dim E={self.head_dim}"
            )
        self.store = store
        self.device = store.device
        self.max_tokens = max_tokens
        self.backend = backend
        self.validate = validate

        self.sequence_parallel: SequenceParallelRows | None = None
        if group is not None:
            self.sequence_parallel = SequenceParallelRows(
                group,
                num_cols=self.num_cols,
                E=self.head_dim,
                max_tokens=max_tokens,
                device=self.device,
                collective=collective,
            )
            self.sequence_parallel.check_store(store)
            max_local = self.sequence_parallel.max_part
        else:
            store_end = store.col_end if store.col_end is not None else self.num_cols
            if store.col_begin != 0 or store_end != self.num_cols:
                raise ShardingError(
                    f"store serves hash columns [{store.col_begin}, {store.col_end}) of C="
                    f"{self.num_cols}; without a sequence-parallel group the layer needs the "
                    f"whole table (pass group= for a column shard)"
                )
            max_local = max_tokens
        self.max_local_tokens = max_local

        hc, dim, width = self.hc_mult, self.hidden_size, self.num_cols * self.head_dim
        self.wkv = EngramLinear(width, (hc + 1) * dim, device=self.device)
        self.q_weight = nn.Parameter(
            torch.ones(hc, dim, dtype=torch.bfloat16, device=self.device), requires_grad=False
        )
        self.k_weight = nn.Parameter(
            torch.ones(hc, dim, dtype=torch.bfloat16, device=self.device), requires_grad=False
        )

        # Staging buffers, NaN-poisoned so a slice that was never written shows.
        # Plain attributes, not registered buffers: they are not state, and
        # Module.to(dtype) must not convert them.
        def staging(*shape: int) -> torch.Tensor:
            return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=self.device)

        self.rows_buffer = staging(max_local, self.num_cols, self.head_dim)  # [Tl, C, E]
        self.kv_buffer = staging(max_local, (hc + 1) * dim)  # [Tl, (hc+1)*D]
        self.out_buffer = staging(max_local, hc, dim)  # [Tl, hc, D]
        self._rows_ready = torch.cuda.Event() if self.device.type == "cuda" else None
        self._prepared: _Prepared | None = None

    # Sizes ---------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return 1 if self.sequence_parallel is None else self.sequence_parallel.tp

    def local_tokens(self, num_tokens: int) -> int:
        """Tokens of ``hidden`` for a step of ``num_tokens`` row-id tokens:
        ``T``, or ``ceil(T / tp)`` under sequence parallelism."""
        return tokens_per_rank(num_tokens, self.tp)

    # Weights -------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(
        self,
        *,
        wkv: torch.Tensor,
        wkv_scale: torch.Tensor | None = None,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
    ) -> None:
        """Load the layer's weights from plain tensors (any device).

        Args:
            wkv: ``[(hc+1)*D, C*E]`` bf16, or float8_e4m3fn with ``wkv_scale``.
            wkv_scale: the fp8 weight's ``weight_scale_inv``, float32
                ``[ceil((hc+1)*D / 128), ceil(C*E / 128)]``; None for bf16.
            q_weight, k_weight: ``[hc, D]`` bf16, fp16 or fp32 (kept in that dtype).

        Every tensor is checked before anything is written. Load before
        capturing a CUDA graph: a norm weight of another dtype than the one
        held gets a new tensor (a new address).

        Raises:
            CheckpointError: naming the tensor, the expected and the found
                shape and dtype.
        """
        expected = [self.hc_mult, self.hidden_size]
        for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
            if not isinstance(weight, torch.Tensor):
                raise CheckpointError(
                    f"{name} is a {type(weight).__name__}; expected a tensor {expected}"
                )
            if list(weight.shape) != expected or weight.dtype not in _NORM_DTYPES:
                raise CheckpointError(
                    f"{name} has {_describe(weight)}; expected shape {expected} ([hc, D]) and "
                    f"dtype torch.bfloat16, torch.float16 or torch.float32"
                )
        self.wkv.load(wkv, wkv_scale, name="wkv")  # checks wkv and wkv_scale before writing
        for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
            held = getattr(self, name)
            if held.dtype == weight.dtype:
                held.copy_(weight)
            else:
                fresh = weight.to(self.device).contiguous()
                setattr(self, name, nn.Parameter(fresh, requires_grad=False))

    # Steps ---------------------------------------------------------------------
    def prepare(self, row_ids: torch.Tensor, *, stream: torch.cuda.Stream | None = None) -> None:
        """Start looking up ``row_ids [T, C]`` into the rows buffer.

        Args:
            row_ids: ``[T, C]`` int32/int64 global row ids of this layer for
                all ``T`` tokens (a strided view of the hasher's ``[T, L, C]``
                output is fine).
            stream: a CUDA stream to run the lookup on (overlapping the work
                queued after this call on the current stream); None runs it on
                the current stream.

        The next :meth:`forward` consumes the batch; calling ``prepare`` twice
        without a ``forward`` in between is an error.
        """
        num_tokens = self._check_row_ids(row_ids)
        if self._prepared is not None:
            raise ValidationError(
                f"prepare() was already called for a batch of {self._prepared.num_tokens} tokens "
                f"that forward() has not consumed"
            )
        if stream is None:
            self._stage_rows(row_ids)
            self._prepared = _Prepared(num_tokens, row_ids, None)
            return
        if self.device.type != "cuda" or self._rows_ready is None:
            raise ValidationError(
                f"stream={stream!r} given but the layer runs on {self.device}; streams need CUDA"
            )
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._stage_rows(row_ids)
            self._rows_ready.record(stream)
        self._prepared = _Prepared(num_tokens, row_ids, self._rows_ready)

    def forward(
        self,
        hidden: torch.Tensor,
        row_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        return_kv: bool = False,
    ) -> Any:
        """``out [Tl, hc, D]`` bf16 = gate(hidden, wkv(rows)).

        Args:
            hidden: ``[Tl, hc, D]`` hidden streams (bf16; fp16/fp32 accepted),
                contiguous, where ``Tl = T`` or, under sequence parallelism,
                ``ceil(T / tp)`` (this rank's tokens, the last rank padded:
                padding tokens get zero rows, so they pass through unchanged).
            row_ids: ``[T, C]`` to look up now; None uses the batch staged by
                :meth:`prepare`.
            token_mask: optional bool ``[Tl]``; False passes the token's hidden
                state through unchanged.
            out: optional contiguous bf16 ``[Tl, hc, D]`` to write instead of
                the layer's output buffer.
            return_kv: also return kv ``[Tl, (hc+1)*D]`` (a view of the
                layer's kv buffer).

        Returns:
            ``out``, a view of the layer's output buffer unless ``out`` was
            given (overwritten by the next step), or ``(out, kv)``.
        """
        prepared = self._prepared
        if row_ids is None:
            if prepared is None:
                raise ValidationError(
                    "forward() got row_ids=None but no batch was staged; call prepare(row_ids) "
                    "first or pass row_ids"
                )
            num_tokens = prepared.num_tokens
        else:
            if prepared is not None:
                raise ValidationError(
                    f"forward() got row_ids for {row_ids.shape[0]} tokens but prepare() already "
                    f"staged {prepared.num_tokens}; pass the ids to one of them"
                )
            num_tokens = self._check_row_ids(row_ids)
        local = self.local_tokens(num_tokens)
        if self.validate:
            self._check_hidden(hidden, local, num_tokens)

        if row_ids is None:
            assert prepared is not None
            if prepared.event is not None:
                torch.cuda.current_stream(self.device).wait_event(prepared.event)
            self._prepared = None
        else:
            self._stage_rows(row_ids)

        rows = self.rows_buffer[:local].view(local, self.num_cols * self.head_dim)
        kv = self.wkv(rows, out=self.kv_buffer[:local])  # [Tl, (hc+1)*D]
        result = engram_gate(
            hidden,
            kv,
            self.q_weight,
            self.k_weight,
            self.eps,
            token_mask,
            backend=self.backend,
            out=self.out_buffer[:local] if out is None else out,
            validate=self.validate,
        )
        return (result, kv) if return_kv else result

    # Internals -----------------------------------------------------------------
    def _stage_rows(self, row_ids: torch.Tensor) -> None:
        """Rows of ``row_ids`` into the leading slice of the rows buffer (current stream)."""
        num_tokens = row_ids.shape[0]
        local = self.local_tokens(num_tokens)
        if self.sequence_parallel is not None:
            self.sequence_parallel(self.store, row_ids, self.rows_buffer[:local])
        else:
            self.store.lookup(row_ids, out=self.rows_buffer[:num_tokens])

    def _check_row_ids(self, row_ids: torch.Tensor) -> int:
        if not isinstance(row_ids, torch.Tensor) or row_ids.dtype not in _ID_DTYPES:
            found = (
                str(row_ids.dtype) if isinstance(row_ids, torch.Tensor) else type(row_ids).__name__
            )
            raise ValidationError(f"row_ids has dtype {found}; expected torch.int32 or torch.int64")
        if row_ids.dim() != 2 or row_ids.shape[1] != self.num_cols:
            raise ValidationError(
                f"row_ids has shape {list(row_ids.shape)}; expected [T, C] with C = "
                f"{self.num_cols} hash columns"
            )
        num_tokens = row_ids.shape[0]
        if num_tokens > self.max_tokens:
            raise ValidationError(
                f"row_ids has T = {num_tokens} tokens, more than the layer's max_tokens = "
                f"{self.max_tokens} (the size its staging buffers were built for)"
            )
        return num_tokens

    def _check_hidden(self, hidden: torch.Tensor, local: int, num_tokens: int) -> None:
        if not isinstance(hidden, torch.Tensor):
            raise ValidationError(f"hidden is a {type(hidden).__name__}; expected a tensor")
        expected = [local, self.hc_mult, self.hidden_size]
        if list(hidden.shape) != expected:
            tokens = (
                f"T = {num_tokens} row-id tokens"
                if self.tp == 1
                else f"ceil(T / tp) = ceil({num_tokens} / {self.tp}) tokens of this rank"
            )
            raise ValidationError(
                f"hidden has shape {list(hidden.shape)}; expected [{local}, {self.hc_mult}, "
                f"{self.hidden_size}] ({tokens}, hc, D)"
            )
        if hidden.device != self.device:
            raise ValidationError(
                f"hidden is on {hidden.device}; expected the layer's device {self.device}"
            )

    def extra_repr(self) -> str:
        return (
            f"D={self.hidden_size}, hc={self.hc_mult}, C={self.num_cols}, E={self.head_dim}, "
            f"max_tokens={self.max_tokens}, tp={self.tp}, store={self.store!r}"
        )
