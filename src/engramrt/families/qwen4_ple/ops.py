"""``PleHasher``: PLE row ids of one engine step, through the Triton kernel or the reference.

One call hashes a flat batch of requests for every PLE layer (``rows [T, L, C]``) and
returns each request's next id context (``[R, N - 1]``, docs/families.md §4): one launch
of ``_ple_row_ids_kernel`` with no host synchronisation unless ``check_ids``, so the call
can be captured in a CUDA graph with preallocated ``out`` and ``next_context``.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from engramrt._backend import resolve_backend
from engramrt._device import resolve_device
from engramrt.errors import ValidationError
from engramrt.families.qwen4_ple.config import PleConfig, resolve_ple_config
from engramrt.families.qwen4_ple.ids import PleConstants, ple_row_ids_batch_reference
from engramrt.hashing.config import HashKernelConfig, kernel_config_for
from engramrt.hashing.ops import (
    check_kernel_config,
    check_out_dtype,
    hash_shape_constexprs,
    request_search,
)

__all__ = ["PleHasher"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _describe(tensor: Any) -> str:
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__
    return f"shape {list(tensor.shape)} dtype {tensor.dtype} on {tensor.device}"


class PleHasher:
    """Row ids ``[T, L, C]`` of every PLE layer of an engine step, and the next contexts.

    Request r owns tokens ``query_start_loc[r] .. query_start_loc[r+1] - 1`` of
    ``token_ids`` (a chunk, possibly empty) and carries ``context_token_ids[r]``, its last
    ``N - 1`` raw ids oldest first (``N - 1`` EOS at a request's start; a prefix hit or a
    rollback rebuilds it from the token history with
    :meth:`~engramrt.families.qwen4_ple.ids.PleIdContext.from_history`). Tokens past
    ``query_start_loc[-1]`` are padding (CUDA-graph rows) and hash as a request's first
    token. Positions an attention mask hides must be passed as EOS (docs/families.md §3).

    Args:
        config: a :class:`PleConfig` (or HF config.json object or path) with PLE on.
        device: where batches live.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``engramrt._backend``).
        validate: check shapes, dtypes and devices of every call on the host (reads no
            tensor, never synchronises).
        check_ids: also check values (ids in ``[0, V)`` or EOS, monotone
            ``query_start_loc``); synchronises, so off on the hot path.
        out_dtype: ``torch.int64`` (default) or ``torch.int32`` (every row id is below
            ``2**31`` at real sizes; refused when one is not).
        kernel_config: launch settings (the n-gram hash kernel's
            :class:`~engramrt.hashing.config.HashKernelConfig`; ``ring_commit`` is
            ignored); None picks one by token count (:func:`kernel_config_for`).
    """

    def __init__(
        self,
        config: PleConfig | Any,
        device: torch.device | str = "cpu",
        *,
        backend: str = "auto",
        validate: bool = True,
        check_ids: bool = False,
        out_dtype: torch.dtype = torch.int64,
        kernel_config: HashKernelConfig | None = None,
    ) -> None:
        config = resolve_ple_config(config)
        self.config = config
        self.consts = PleConstants.from_config(config)
        self.eos = config.eos
        self.vocab_size = config.vocab_size
        self.n_layers, self.n_cols = self.consts.n_layers, self.consts.n_cols
        self.ngram_size = self.consts.ngram_size
        self.device = resolve_device(device)
        self.backend = resolve_backend(backend, self.device)
        self.validate = validate
        self.check_ids = check_ids
        max_row = max(self.consts.addressed_rows) - 1
        check_out_dtype(out_dtype, max_row)
        self.out_dtype = out_dtype
        check_kernel_config(kernel_config)
        self.kernel_config = kernel_config
        self.consts_dev = self.consts.packed(self.device)
        # The float64 remainder's bound needs every head size >= 4096 (kernel._floor_mod_prime).
        self._sizes_allow_fast_mod = bool(self.consts.head_sizes.min(initial=4096) >= 4096)
        inv_sizes = 1.0 / self.consts.head_sizes.astype(np.float64)  # [L, C]
        self.inv_sizes_dev = torch.as_tensor(np.ascontiguousarray(inv_sizes), device=self.device)
        self._launcher: Any = None
        self._shape_constexprs = hash_shape_constexprs(
            self.n_layers, self.ngram_size, self.consts.heads_per_ngram
        )

    def start_contexts(self, num_requests: int) -> torch.Tensor:
        """``[num_requests, N - 1]`` int64 contexts of fresh requests (all EOS)."""
        return torch.full(
            (num_requests, self.ngram_size - 1), self.eos, dtype=torch.int64, device=self.device
        )

    def __call__(
        self,
        token_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_token_ids: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        next_context: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids and next contexts of one step.

        Args:
            token_ids: ``[T]`` int32/int64 raw ids.
            query_start_loc: ``[R + 1]`` int32/int64, non-decreasing from 0 to at most T.
            context_token_ids: ``[R, N - 1]`` int32/int64, each request's carried ids.
            out: optional ``[T, L, C]`` int32/int64 output (fixed address for graphs).
            next_context: optional ``[R, N - 1]`` int64 output; must not share memory
                with ``context_token_ids`` (the launch reads those while writing these).

        Returns:
            ``(rows [T, L, C], next_context [R, N - 1])`` on :attr:`device`.
        """
        if self.validate:
            self._check_shapes(token_ids, query_start_loc, context_token_ids, out, next_context)
        if self.check_ids:
            self._check_values(token_ids, query_start_loc, context_token_ids)
        n_tokens, n_req = token_ids.shape[0], query_start_loc.shape[0] - 1
        if out is None:
            out = torch.empty(
                (n_tokens, self.n_layers, self.n_cols), dtype=self.out_dtype, device=self.device
            )
        if next_context is None:
            next_context = torch.empty(
                (n_req, self.ngram_size - 1), dtype=torch.int64, device=self.device
            )
        if self.backend == "reference":
            rows, contexts = ple_row_ids_batch_reference(
                token_ids, query_start_loc, context_token_ids, self.consts, self.eos
            )
            out.copy_(rows)
            next_context.copy_(contexts)
            return out, next_context
        if n_tokens == 0 and n_req == 0:
            return out, next_context
        self._launch(token_ids, query_start_loc, context_token_ids, out, next_context)
        return out, next_context

    def _check_shapes(
        self,
        token_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_token_ids: torch.Tensor,
        out: torch.Tensor | None,
        next_context: torch.Tensor | None,
    ) -> None:
        """Types, shapes, dtypes and devices (host metadata only)."""
        n = self.ngram_size
        inputs = (
            ("token_ids", token_ids, 1, "[T]"),
            ("query_start_loc", query_start_loc, 1, "[R + 1]"),
            ("context_token_ids", context_token_ids, 2, f"[R, N - 1 = {n - 1}]"),
        )
        for name, tensor, ndim, want in inputs:
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.dim() != ndim
                or tensor.dtype not in _INDEX_DTYPES
            ):
                raise ValidationError(
                    f"{name} has {_describe(tensor)}; expected {want} int32 or int64"
                )
            if tensor.device != self.device:
                raise ValidationError(
                    f"{name} is on {tensor.device}; this hasher was built for {self.device}"
                )
        if query_start_loc.shape[0] < 1:
            raise ValidationError("query_start_loc has shape [0]; expected [R + 1], R >= 0")
        n_tokens, n_req = token_ids.shape[0], query_start_loc.shape[0] - 1
        if tuple(context_token_ids.shape) != (n_req, n - 1) or not _unit_rows(context_token_ids):
            raise ValidationError(
                f"context_token_ids has {_describe(context_token_ids)} strides "
                f"{list(context_token_ids.stride())}; expected [R, N - 1] = [{n_req}, {n - 1}] "
                f"with contiguous rows"
            )
        if not token_ids.is_contiguous() or not query_start_loc.is_contiguous():
            raise ValidationError("token_ids and query_start_loc must be contiguous")
        if out is not None:
            shape = (n_tokens, self.n_layers, self.n_cols)
            if (
                not isinstance(out, torch.Tensor)
                or tuple(out.shape) != shape
                or out.dtype not in _INDEX_DTYPES
                or not out.is_contiguous()
                or out.device != self.device
            ):
                raise ValidationError(
                    f"out has {_describe(out)}; expected contiguous {list(shape)} "
                    f"int32/int64 on {self.device}"
                )
        if next_context is not None:
            if (
                not isinstance(next_context, torch.Tensor)
                or tuple(next_context.shape) != (n_req, n - 1)
                or next_context.dtype != torch.int64
                or not _unit_rows(next_context)
                or next_context.device != self.device
            ):
                raise ValidationError(
                    f"next_context has {_describe(next_context)}; expected [{n_req}, {n - 1}] "
                    f"int64 with contiguous rows on {self.device}"
                )
            if _overlaps(next_context, context_token_ids):
                raise ValidationError(
                    "next_context shares memory with context_token_ids; expected a separate "
                    "buffer (the launch reads the old contexts while writing the new ones)"
                )

    def _check_values(
        self,
        token_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_token_ids: torch.Tensor,
    ) -> None:
        """Values: monotone boundaries within T, ids in the vocabulary or EOS (synchronises)."""
        bounds = query_start_loc.tolist()
        n_tokens = token_ids.shape[0]
        if bounds[0] != 0 or any(b < a for a, b in itertools.pairwise(bounds)):
            raise ValidationError(f"query_start_loc={bounds}; expected non-decreasing from 0")
        if bounds[-1] > n_tokens:
            raise ValidationError(
                f"query_start_loc[-1]={bounds[-1]}; expected at most T={n_tokens}"
            )
        for name, tensor in (("token_ids", token_ids), ("context_token_ids", context_token_ids)):
            values = tensor.reshape(-1).long()
            bad = ((values < 0) | (values >= self.vocab_size)) & (values != self.eos)
            if bool(bad.any()):
                index = int(bad.nonzero()[0, 0])
                raise ValidationError(
                    f"{name} holds {int(values[index])} at flat index {index}; expected ids in "
                    f"[0, vocab_size={self.vocab_size}) or the EOS id {self.eos}"
                )

    def _launch(
        self,
        token_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_token_ids: torch.Tensor,
        out: torch.Tensor,
        next_context: torch.Tensor,
    ) -> None:
        if self._launcher is None:
            from engramrt._launch import CachedLauncher
            from engramrt.families.qwen4_ple.kernel import _ple_row_ids_kernel

            self._launcher = CachedLauncher(_ple_row_ids_kernel)
        n_tokens, n_req = token_ids.shape[0], query_start_loc.shape[0] - 1
        config = self.kernel_config or kernel_config_for(n_tokens, self.device)
        search_steps, scan_r = request_search(config, n_req)
        block_r = config.block_t
        grid = (max(-(-n_tokens // config.block_t), -(-n_req // block_r), 1),)
        self._launcher(
            grid,
            out,
            next_context,
            token_ids,
            query_start_loc,
            context_token_ids,
            self.consts_dev,
            self.inv_sizes_dev,
            n_tokens,
            n_req,
            self.eos,
            context_token_ids.stride(0),
            next_context.stride(0),
            **self._shape_constexprs,
            BLOCK_T=config.block_t,
            BLOCK_R=block_r,
            SEARCH_STEPS=0 if scan_r else search_steps,
            SCAN_R=scan_r,
            FAST_MOD=config.fast_mod and self._sizes_allow_fast_mod,
            SPECULATE=config.speculate_decode,
            num_warps=config.num_warps,
        )


def _unit_rows(matrix: torch.Tensor) -> bool:
    """Whether a 2-D tensor's rows are contiguous (any layout of an empty one or one column)."""
    return matrix.numel() == 0 or matrix.shape[1] == 1 or matrix.stride(1) == 1


def _byte_span(matrix: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of a non-empty 2-D tensor with unit column stride in its storage."""
    size = matrix.element_size()
    first = int(matrix.storage_offset()) * size
    last = first + (int(matrix.shape[0] - 1) * matrix.stride(0) + int(matrix.shape[1])) * size
    return first, last


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two 2-D tensors share bytes of one storage."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_first, a_last), (b_first, b_last) = _byte_span(a), _byte_span(b)
    return a_first < b_last and b_first < a_last
