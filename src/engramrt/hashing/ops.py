"""``NgramHasher``: row ids of one engine step, through the kernel or the reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engramrt._backend import resolve_backend
from engramrt._device import resolve_device
from engramrt._launch import next_pow2
from engramrt.errors import ValidationError
from engramrt.hashing.config import HashKernelConfig, kernel_config_for
from engramrt.hashing.history import RequestHistory, SlotHashCache
from engramrt.hashing.host import check_host_batch, hash_batch_host
from engramrt.hashing.reference import hash_batch_reference
from engramrt.hashing.types import HashBatch, HashConstants
from engramrt.hashing.validate import check_batch_contents, check_batch_metadata

if TYPE_CHECKING:
    from engramrt.config import EngramConfig
    from engramrt.tokenmap import TokenMap

__all__ = ["HashKernelConfig", "NgramHasher", "kernel_config_for"]

History = SlotHashCache | RequestHistory


# Shared by the launchers of every n-gram hash kernel (this one and the PLE family's).


def check_out_dtype(out_dtype: torch.dtype, max_row_id: int) -> None:
    """Refuse an ``out_dtype`` other than int32 or int64, or int32 when a row id reaches
    ``max_row_id >= 2**31``."""
    if out_dtype not in (torch.int32, torch.int64):
        raise ValidationError(f"out_dtype={out_dtype} must be torch.int32 or torch.int64")
    if out_dtype == torch.int32 and max_row_id >= 2**31:
        raise ValidationError(
            f"out_dtype=torch.int32 cannot hold row id {max_row_id:,}; use torch.int64"
        )


def check_kernel_config(kernel_config: object) -> None:
    """Refuse a ``kernel_config`` that is neither a :class:`HashKernelConfig` nor None."""
    if kernel_config is not None and not isinstance(kernel_config, HashKernelConfig):
        raise ValidationError(f"kernel_config={kernel_config!r} must be a HashKernelConfig or None")


def hash_shape_constexprs(n_layers: int, ngram_size: int, heads: int) -> dict[str, int]:
    """The shape constexprs of an n-gram hash kernel: ``L``, ``N``, ``H`` and each padded
    to a power of two (the register tiles' sizes)."""
    return {
        "L": n_layers,
        "N": ngram_size,
        "H": heads,
        "L_PAD": next_pow2(n_layers),
        "N_PAD": next_pow2(ngram_size),
        "H_PAD": next_pow2(heads),
    }


def request_search(config: HashKernelConfig, num_requests: int) -> tuple[int, int]:
    """``(search_steps, scan_r)``: how a launch finds each token's request among
    ``num_requests``, by a binary search of ``search_steps`` or one load of a ``scan_r``
    tile of ``query_start_loc`` (``scan_r > 0``). Both rounded so only a few variants ever
    compile: the search to a multiple of 4 steps, the tile to a power of two >= 16."""
    search_steps = -(-max(1, num_requests.bit_length()) // 4) * 4
    return search_steps, config.scan_width(num_requests)


class NgramHasher:
    """Computes ``[T, n_layers, C]`` row ids for every Engram layer of a batch.

    One call is one launch of ``_ngram_hash_kernel`` (two with a
    :class:`RequestHistory` and more than ``window - (N-1)`` tokens, whose
    ring is then written by a second kernel), with
    no host synchronisation unless ``check_ids``: the call can be captured
    in a CUDA graph (host-side ``validate`` checks read no tensor).

    Args:
        consts: multipliers, primes, offsets and pad id (see :class:`HashConstants`).
        token_map: ``[V]`` tokenizer id -> compressed id.
        device: where batches live.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``_backend``).
        validate: check every batch's fields (types, shapes, dtypes,
            devices) and ``out`` on the host; never synchronises.
        check_ids: check every batch's values (token ids in the vocabulary,
            boundaries, positions, lookback ids, history slots) on the host
            first; synchronises, so off on the hot path.
        out_dtype: ``torch.int32`` (default when every row id fits) or ``torch.int64``.
        kernel_config: launch settings for every call; None (default)
            picks one by token count and device (:func:`kernel_config_for`).
    """

    def __init__(
        self,
        consts: HashConstants,
        token_map: np.ndarray | TokenMap,
        device: torch.device | str = "cpu",
        *,
        backend: str = "auto",
        validate: bool = True,
        check_ids: bool = False,
        out_dtype: torch.dtype | None = None,
        kernel_config: HashKernelConfig | None = None,
    ) -> None:
        mapping = token_map if isinstance(token_map, np.ndarray) else token_map.map
        self.consts = consts
        self.n_layers = consts.n_layers  # L, the Engram layers hashed in one launch
        self.num_cols = consts.n_cols  # C, hash columns per layer
        self.device = resolve_device(device)
        self.backend = resolve_backend(backend, self.device)
        self.validate = validate
        self.check_ids = check_ids
        self.vocab_size = int(mapping.shape[0])
        self.token_map = np.asarray(mapping, dtype=np.int64)
        fits32 = consts.max_row_id < 2**31
        if out_dtype is None:
            out_dtype = torch.int32 if fits32 else torch.int64
        check_out_dtype(out_dtype, consts.max_row_id)
        self.out_dtype = out_dtype
        check_kernel_config(kernel_config)
        self.kernel_config = kernel_config
        self.token_map_dev = torch.as_tensor(self.token_map.astype(np.int32), device=self.device)
        self.consts_dev = consts.packed(self.device)
        # The float64 remainder's error bound needs every prime >= 4096 (kernel._mod_prime);
        # numpy divides with IEEE rounding, which the bound assumes of the reciprocals.
        self._primes_allow_fast_mod = bool(consts.col_primes.min(initial=4096) >= 4096)
        inv_primes = 1.0 / consts.col_primes.astype(np.float64)  # [L, C]
        self.inv_primes_dev = torch.as_tensor(np.ascontiguousarray(inv_primes), device=self.device)
        self._launchers: tuple[Any, Any] | None = None
        self._shape_constexprs = hash_shape_constexprs(
            consts.n_layers, consts.max_ngram_size, consts.n_heads
        )

    @classmethod
    def from_config(
        cls,
        config: EngramConfig,
        token_map: TokenMap | None = None,
        device: torch.device | str = "cpu",
        *,
        seed: int | None = None,
        **kwargs: object,
    ) -> NgramHasher:
        """A hasher for a config, with its token map (default: DeepSeek-V4)."""
        from engramrt.tokenmap import TokenMap

        token_map = token_map or TokenMap.from_tokenizer_file()
        consts = HashConstants.from_config(config, token_map, seed)
        return cls(consts, token_map, device, **kwargs)  # type: ignore[arg-type]

    def __call__(
        self,
        batch: HashBatch,
        history: History | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Row ids ``[T, L, C]`` of ``batch``; updates ``history`` with the batch's tokens.

        Args:
            batch: the step (see :class:`HashBatch`).
            history: a :class:`SlotHashCache` or :class:`RequestHistory`, or
                None when lookback ids (or nothing) carry the history.
            out: optional preallocated ``[T, L, C]`` output (fixed address
                for CUDA graphs).
        """
        self._check_batch(batch, history, self.device)
        shape = (batch.num_tokens, self.consts.n_layers, self.consts.n_cols)
        if out is None:
            out = torch.empty(shape, dtype=self.out_dtype, device=self.device)
        elif self.validate and (
            tuple(out.shape) != shape or out.dtype not in (torch.int32, torch.int64)
        ):
            raise ValidationError(
                f"out has shape {list(out.shape)} and dtype {out.dtype}; expected {list(shape)} int32/int64"
            )
        if batch.num_tokens == 0:
            return out
        if self.backend == "reference":
            ids = hash_batch_reference(batch, self.consts, self.token_map, history)
            out.copy_(torch.from_numpy(ids).to(out.device, out.dtype))
            return out
        self._launch(batch, history, out)
        return out

    def hash_on_host(self, batch: HashBatch, layers: Sequence[int] | None = None) -> np.ndarray:
        """``[T, len(layers), C]`` int64 row ids of ``batch`` computed on the host
        (:func:`~engramrt.hashing.host.hash_batch_host`), the same as :meth:`__call__`'s
        for a batch whose history comes from the chunk and its lookback ids. Never
        touches the device or a history store; ``layers`` (positions in the config,
        None: all) picks the layers to hash. For sources that gather rows on the CPU
        (an :class:`~engramrt.step.EngineStep`'s host mirror, ``EngramRuntime.plan``)."""
        self._check_batch(batch, None, None)
        if layers is not None and not all(
            isinstance(li, int) and 0 <= li < self.n_layers for li in layers
        ):
            raise ValidationError(
                f"layers={list(layers)!r}; expected Engram layer positions in [0, {self.n_layers})"
            )
        return hash_batch_host(batch, self.consts, self.token_map, layers)

    def check_host_step(self, host: HashBatch, step: HashBatch, *, has_history: bool) -> None:
        """Check that ``host`` (on the CPU) can stand for ``step`` in :meth:`hash_on_host`
        (:func:`~engramrt.hashing.host.check_host_batch`): host arrays only."""
        check_host_batch(host, step, has_history=has_history)

    @property
    def history_window(self) -> int:
        """Tokens before a chunk its n-grams reach: ``max_ngram_size - 1``."""
        return int(self.consts.max_ngram_size) - 1

    def _check_batch(
        self, batch: HashBatch, history: History | None, device: torch.device | None
    ) -> None:
        """The hasher's checks of a batch: its fields with ``validate`` (and that it is on
        ``device``, unless None), its contents with ``check_ids``."""
        if self.validate:
            check_batch_metadata(batch, max_ngram_size=self.consts.max_ngram_size, history=history)
            if device is not None and batch.device != device:
                raise ValidationError(
                    f"batch is on {batch.device}; this hasher was built for {device}"
                )
        if self.check_ids:
            check_batch_contents(
                batch,
                vocab_size=self.vocab_size,
                max_ngram_size=self.consts.max_ngram_size,
                history=history,
            )

    def _launch(self, batch: HashBatch, history: History | None, out: torch.Tensor) -> None:
        if self._launchers is None:
            from engramrt._launch import CachedLauncher
            from engramrt.hashing.kernel import _history_commit_kernel, _ngram_hash_kernel

            self._launchers = (
                CachedLauncher(_ngram_hash_kernel),
                CachedLauncher(_history_commit_kernel),
            )
        hash_kernel, commit_kernel = self._launchers

        consts = self.consts
        t_len, n_req = batch.num_tokens, batch.num_requests
        dummy = batch.input_ids
        dead = batch.dead_mask
        if dead is not None and dead.dtype == torch.bool:
            dead = dead.view(torch.uint8)
        lookback = batch.lookback_token_ids
        lookback_dead = batch.lookback_dead
        if lookback is not None:
            lookback = lookback.contiguous()
        if lookback_dead is not None:
            lookback_dead = lookback_dead.contiguous()
            if lookback_dead.dtype == torch.bool:
                lookback_dead = lookback_dead.view(torch.uint8)
        mode, slots, tags, slot_mapping, table, block_size, table_stride = (
            0,
            dummy,
            dummy,
            dummy,
            dummy,
            1,
            0,
        )
        table_cols, history_rows = 0, 0  # the bounds every history load and store is masked to
        if isinstance(history, SlotHashCache):
            assert batch.slot_mapping is not None and batch.block_table is not None
            mode, slots, slot_mapping = 1, history.slots, batch.slot_mapping
            table, block_size = batch.block_table, history.block_size
            table_stride = table.stride(0)
            table_cols, history_rows = table.shape[1], history.num_slots // block_size
        elif isinstance(history, RequestHistory):
            assert batch.request_slots is not None
            mode, slots, tags = 2, history.slots, history.tags
            table, block_size = batch.request_slots, history.window
            history_rows = history.max_requests
        config = self.kernel_config or kernel_config_for(t_len, self.device)
        search_steps, scan_r = request_search(config, n_req)
        ring_commit = (
            isinstance(history, RequestHistory)
            and config.ring_commit
            and t_len <= history.window - (consts.max_ngram_size - 1)
        )
        grid = (triton_cdiv(t_len, config.block_t),)
        hash_kernel(
            grid,
            out,
            batch.input_ids,
            batch.positions,
            batch.query_start_loc,
            dead if dead is not None else dummy,
            lookback if lookback is not None else dummy,
            lookback_dead if lookback_dead is not None else dummy,
            self.token_map_dev,
            self.consts_dev,
            self.inv_primes_dev,
            slots,
            tags,
            slot_mapping,
            table,
            t_len,
            n_req,
            self.vocab_size,
            consts.pad_id,
            block_size,
            table_stride,
            table_cols,
            history_rows,
            consts.max_ngram_size - 1,
            **self._shape_constexprs,
            HAS_DEAD=dead is not None,
            HAS_LOOKBACK=lookback is not None,
            HAS_LOOKBACK_DEAD=lookback_dead is not None,
            HISTORY=mode,
            SEARCH_STEPS=0 if scan_r else search_steps,
            SCAN_R=scan_r,
            RING_COMMIT=ring_commit,
            FAST_MOD=config.fast_mod and self._primes_allow_fast_mod,
            SPECULATE=config.speculate_decode,
            BLOCK_T=config.block_t,
            num_warps=config.num_warps,
        )
        if isinstance(history, RequestHistory) and not ring_commit:
            commit_kernel(
                grid,
                history.slots,
                history.tags,
                batch.input_ids,
                batch.positions,
                batch.query_start_loc,
                dead if dead is not None else dummy,
                batch.request_slots,
                self.token_map_dev,
                t_len,
                n_req,
                self.vocab_size,
                history.window,
                history.max_requests,
                BLOCK_T=config.block_t,
                HAS_DEAD=dead is not None,
                SEARCH_STEPS=search_steps,
                num_warps=config.num_warps,
            )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
