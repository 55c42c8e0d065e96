"""``EngramRuntime``: what an engine integrates, one object per model.

Each engine step hands the runtime its batch. The runtime computes the row
ids of every Engram layer in one launch and starts every layer's lookup at
once, so that each Engram layer later waits only for its own rows:

- device and UVA tiers: the lookup kernel runs on a lowest-priority side
  stream, after an event that marks the hash ids ready; the layer's
  ``rows()`` makes the caller's stream wait on the lookup's event (no host
  synchronisation, capturable in a CUDA graph);
- host and disk tiers, and a hot-row cache in front of them
  (:class:`~engramrt.cache.CachedRowStore`): a worker thread per layer runs
  the lookup (the CPU gathers rows, so these tiers synchronise once on the
  unique ids); the layer's ``rows()`` joins that thread, then waits on its
  copy stream. A cache is updated on the same thread right after its
  lookup, off the layer's path; :meth:`EngramRuntime.cache_stats` reads its
  counts.

:meth:`EngramRuntime.prefetch` starts the next step's lookups as soon as
its tokens exist (right after sampling), into the other of two staging
slots, so they overlap the rest of the current step.

Staging buffers are allocated once for ``max_tokens`` and reused, so the
addresses are fixed: a captured graph replays into the same memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engramrt.cache import CachedRowStore, CacheStats
from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch, NgramHasher, RequestHistory, SlotHashCache
from engramrt.lookup.tiers.base import RowStore

__all__ = ["EngramRuntime", "StepRows"]

# Tiers whose lookup is a kernel reading memory the GPU can address: no host
# synchronisation, so they run on the side stream and can be graph-captured.
_STREAM_TIERS = ("device", "uva")


@dataclass
class StepRows:
    """The lookups of one step: row ids and, per layer, rows once ready.

    Attributes:
        row_ids: ``[T, L, C]`` row ids of every Engram layer (a view of the
            runtime's fixed buffer).
        num_tokens: T.
        slot: the staging slot the rows land in.
    """

    row_ids: torch.Tensor
    num_tokens: int
    slot: int
    _runtime: EngramRuntime
    _events: list[torch.cuda.Event | None] = field(default_factory=list)
    _futures: list[Future[None] | None] = field(default_factory=list)

    def rows(self, layer_index: int) -> torch.Tensor:
        """``[T, C, E]`` bf16 rows of Engram layer ``layer_index`` (its position in the config).

        The current stream waits for this layer's lookup only; other layers'
        lookups keep running.
        """
        if not 0 <= layer_index < len(self._events):
            raise ValidationError(
                f"layer_index={layer_index} must be in [0, {len(self._events)}) (Engram layers)"
            )
        future = self._futures[layer_index]
        if future is not None:
            future.result()  # host tiers: the gather thread has issued its copies
        event = self._events[layer_index]
        if event is not None:
            torch.cuda.current_stream(self._runtime.device).wait_event(event)
        return self._runtime.staging[self.slot][layer_index][: self.num_tokens]


class EngramRuntime:
    """Hash ids and table rows for every Engram layer of one model.

    Args:
        hasher: the :class:`NgramHasher` of the model's layout.
        stores: one :class:`RowStore` per Engram layer (a table or this
            rank's shard), all with the same compute device.
        max_tokens: the most tokens one step may hold (sizes the staging).
        max_requests: the most requests one step may hold.
        history: a :class:`SlotHashCache`, a :class:`RequestHistory`, or
            None when batches carry ``lookback_token_ids``.
        validate: check every batch on the host (synchronises; off in serving).
        num_slots: staging slots; 2 lets a prefetch overlap the current step.
        lookup_priority: CUDA stream priority of the side streams the
            lookups run on (lower numbers are higher priority in torch). The
            default, 0, is the lowest, the same as a default stream's: an
            engine that runs its model on a higher-priority stream keeps
            precedence over the lookups. Measured without that, the lookups
            cost a 7B-sized backbone 0.2-1.2% on an H200 (BENCHMARKS.md).
    """

    def __init__(
        self,
        hasher: NgramHasher,
        stores: Sequence[RowStore],
        *,
        max_tokens: int,
        max_requests: int,
        history: SlotHashCache | RequestHistory | None = None,
        validate: bool = True,
        num_slots: int = 2,
        lookup_priority: int = 0,
    ) -> None:
        consts = hasher.consts
        if len(stores) != consts.n_layers:
            raise ValidationError(
                f"stores has {len(stores)} entries; expected one per Engram layer ({consts.n_layers})"
            )
        for name, value in (
            ("max_tokens", max_tokens),
            ("max_requests", max_requests),
            ("num_slots", num_slots),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValidationError(f"{name}={value!r} must be a positive integer")
        devices = {s.device for s in stores}
        if devices != {hasher.device}:
            raise ValidationError(
                f"stores compute on {sorted(map(str, devices))} but the hasher runs on {hasher.device}; "
                "expected one device"
            )
        head_dims = {s.E for s in stores}
        if len(head_dims) != 1:
            raise ValidationError(f"stores have head dims {sorted(head_dims)}; expected one E")
        self.hasher = hasher
        self.stores = list(stores)
        self.device = hasher.device
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.history = history
        self.validate = validate
        self.n_layers = consts.n_layers
        self.n_cols = consts.n_cols
        self.head_dim = head_dims.pop()
        self.row_ids = [
            torch.empty(
                (max_tokens, self.n_layers, self.n_cols), dtype=hasher.out_dtype, device=self.device
            )
            for _ in range(num_slots)
        ]
        self.staging = [
            [
                torch.empty(
                    (max_tokens, self.n_cols, self.head_dim),
                    dtype=torch.bfloat16,
                    device=self.device,
                )
                for _ in range(self.n_layers)
            ]
            for _ in range(num_slots)
        ]
        self._next_slot = 0
        cuda = self.device.type == "cuda"
        self._lookup_stream = (
            torch.cuda.Stream(self.device, priority=lookup_priority) if cuda else None
        )
        self._host_streams = (
            [torch.cuda.Stream(self.device, priority=lookup_priority) for _ in range(self.n_layers)]
            if cuda
            else []
        )
        # One worker per host-tier layer: a store owns its staging buffers and
        # is used by one thread at a time, so a prefetch queues behind the
        # same layer's previous lookup instead of racing it.
        self._workers = {
            li: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engramrt-lookup-{li}")
            for li, s in enumerate(self.stores)
            if cuda and s.tier not in _STREAM_TIERS
        }

    # -- steps -------------------------------------------------------------

    def _check(self, batch: HashBatch) -> None:
        if batch.num_tokens > self.max_tokens:
            raise ValidationError(
                f"the batch has {batch.num_tokens} tokens; this runtime was sized for "
                f"max_tokens={self.max_tokens}"
            )
        if batch.num_requests > self.max_requests:
            raise ValidationError(
                f"the batch has {batch.num_requests} requests; this runtime was sized for "
                f"max_requests={self.max_requests}"
            )

    def step(self, batch: HashBatch) -> StepRows:
        """Hash ``batch`` and start every layer's lookup; returns handles to the rows.

        Shape checks against ``max_tokens`` / ``max_requests`` read only
        tensor shapes (no device synchronisation), so they always run.
        """
        self._check(batch)
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self.row_ids)
        t_len = batch.num_tokens
        row_ids = self.row_ids[slot][:t_len]
        self.hasher.validate = self.validate
        self.hasher(batch, self.history, out=row_ids)
        handle = StepRows(row_ids=row_ids, num_tokens=t_len, slot=slot, _runtime=self)
        if self.device.type != "cuda":
            for li, store in enumerate(self.stores):
                store.lookup(row_ids[:, li], out=self.staging[slot][li][:t_len])
                if isinstance(store, CachedRowStore):
                    store.update()
                handle._events.append(None)
                handle._futures.append(None)
            return handle
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        assert self._lookup_stream is not None
        for li, store in enumerate(self.stores):
            out = self.staging[slot][li][:t_len]
            ids = row_ids[:, li]
            if store.tier in _STREAM_TIERS:
                self._lookup_stream.wait_event(ready)
                with torch.cuda.stream(self._lookup_stream):
                    store.lookup(ids, out=out)
                    done = torch.cuda.Event()
                    done.record(self._lookup_stream)
                handle._events.append(done)
                handle._futures.append(None)
            else:
                stream = self._host_streams[li]
                done = torch.cuda.Event()
                handle._events.append(done)
                handle._futures.append(
                    self._workers[li].submit(
                        self._host_lookup, store, ids, out, ready, stream, done
                    )
                )
        return handle

    prefetch = step
    """Start the next step's lookups now (an alias of :meth:`step`: the
    staging slots alternate, so the current step's rows stay valid until the
    step after the prefetched one)."""

    def _host_lookup(
        self,
        store: RowStore,
        ids: torch.Tensor,
        out: torch.Tensor,
        ready: torch.cuda.Event,
        stream: torch.cuda.Stream,
        done: torch.cuda.Event,
    ) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            store.lookup(ids, out=out)
            done.record(stream)
            if isinstance(store, CachedRowStore):
                # Admit this lookup's misses after the rows are out: the
                # layer waits on `done`, the cache's next lookup on the update.
                store.update(stream)

    def cache_stats(self) -> list[CacheStats | None]:
        """Per Engram layer, its hot-row cache's counts (None for an uncached layer).

        Read on the layer's lookup thread, after the lookups queued so far, so
        counts never race a lookup; synchronises with the device.
        """
        stats: list[CacheStats | None] = []
        for li, store in enumerate(self.stores):
            if not isinstance(store, CachedRowStore):
                stats.append(None)
            elif li in self._workers:
                stats.append(self._workers[li].submit(store.stats).result())
            else:
                stats.append(store.stats())
        return stats

    def close(self) -> None:
        """Stop the lookup threads (after their queued lookups finish)."""
        for worker in self._workers.values():
            worker.shutdown(wait=True)
        self._workers = {}
