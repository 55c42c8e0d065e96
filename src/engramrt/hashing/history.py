"""History stores: where a stateless kernel finds tokens before a chunk.

Engines differ in what they remember (SPEC §5), so hashing takes its
history from one of three places:

1. nothing but the batch: ``lookback_token_ids [R, N-1]`` per request;
2. :class:`SlotHashCache`: one int32 per KV-cache slot holding the
   compressed id (or DEAD) of the token last written there. The engine's
   ``slot_mapping`` says where new tokens go and its ``block_table`` where an
   older position lives, so prefix-cache hits and speculative rollbacks read
   exactly what the owning request wrote;
3. :class:`RequestHistory`: a small ring per request slot, for engines that
   keep no token history at all. Each entry is tagged with its position, so
   a rejected speculative token can never be mistaken for an accepted one.

Codes: a compressed id (>= 0), ``EMPTY`` (-1, unknown: hashes as pad) or
``DEAD`` (-2, blocks n-grams through it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engramrt.errors import ValidationError
from engramrt.hashing.types import DEAD, EMPTY, HashBatch, clamp_token_ids, host_array

__all__ = ["RequestHistory", "SlotHashCache"]


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_count(name: str, value: object) -> int:
    """``value`` as a token count: an integer (not a bool) in ``[0, 2**63)``."""
    if not _is_int(value) or not 0 <= int(value) < 2**63:  # type: ignore[call-overload]
        raise ValidationError(
            f"{name}={value!r} ({type(value).__name__}); expected a token count, an integer "
            f"in [0, 2**63)"
        )
    return int(value)  # type: ignore[call-overload]


def _host_ints(name: str, values: torch.Tensor) -> list[int]:
    """A 1-D integer tensor's values on the host (one synchronisation), for checking."""
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValidationError(f"{name} is a {values.dtype} tensor; expected an integer tensor")
    if values.ndim != 1:
        raise ValidationError(f"{name} has shape {list(values.shape)}; expected a 1-D tensor")
    return [int(v) for v in values.tolist()]


def _values_to_check(name: str, values: Any, validate: bool) -> list[Any] | None:
    """A sequence's values, or a tensor's read to the host when ``validate`` (None when
    not: a tensor is then used as given, without a synchronisation)."""
    if not isinstance(values, torch.Tensor):
        return list(values)
    return _host_ints(name, values) if validate else None


class SlotHashCache:
    """Compressed id of the token in every KV-cache slot.

    Args:
        num_slots: slots of the KV cache (``num_blocks * block_size``).
        block_size: tokens per KV block.
        device: where the cache lives (with the KV cache).
    """

    def __init__(self, num_slots: int, block_size: int, device: torch.device | str = "cpu") -> None:
        self.slots = torch.empty(0, dtype=torch.int32)
        self.block_size = 0
        self.bind(num_slots, block_size, device)

    def bind(
        self, num_slots: int, block_size: int, device: torch.device | str | None = None
    ) -> None:
        """(Re)allocate for a KV cache of ``num_slots``; all old history is discarded.

        Engines first bind a small cache to profile memory, then the real
        one: nothing from the first may leak into the second.
        """
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValidationError(f"num_slots={num_slots!r} must be a positive integer")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValidationError(f"block_size={block_size!r} must be a positive integer")
        if num_slots % block_size:
            raise ValidationError(
                f"num_slots={num_slots} must be a multiple of block_size={block_size}"
            )
        device = self.slots.device if device is None else torch.device(device)
        self.slots = torch.full((num_slots,), EMPTY, dtype=torch.int32, device=device)
        self.block_size = block_size

    @property
    def num_slots(self) -> int:
        return int(self.slots.shape[0])

    @property
    def device(self) -> torch.device:
        return self.slots.device

    def commit_reference(self, batch: HashBatch, token_map: np.ndarray) -> None:
        """Write the batch's tokens to their slots (what the kernel does in-launch)."""
        if batch.slot_mapping is None:
            raise ValidationError("slot_mapping is required with a SlotHashCache")
        qsl = host_array(batch.query_start_loc)
        owned = int(qsl[-1])
        slots = host_array(batch.slot_mapping)[:owned].astype(np.int64)
        ids = clamp_token_ids(host_array(batch.input_ids)[:owned], token_map.shape[0])
        codes = token_map[ids].astype(np.int32)
        if batch.dead_mask is not None:
            codes[host_array(batch.dead_mask)[:owned].astype(bool)] = DEAD
        keep = (slots >= 0) & (slots < self.num_slots)  # a slot outside the cache: not written
        index = torch.from_numpy(slots[keep]).to(self.device)
        self.slots[index] = torch.from_numpy(codes[keep]).to(self.device)
        if batch.lookback_token_ids is not None and batch.block_table is not None:
            self._seed_from_lookback(batch, token_map)

    def _seed_from_lookback(self, batch: HashBatch, token_map: np.ndarray) -> None:
        """Write each chunk's known lookback ids to the slots of their positions
        (a block outside the cache, or a column past the table, is skipped)."""
        assert batch.lookback_token_ids is not None and batch.block_table is not None
        qsl = host_array(batch.query_start_loc).astype(np.int64)
        positions = host_array(batch.positions).astype(np.int64)
        lookback = host_array(batch.lookback_token_ids).astype(np.int64)
        lb_dead = (
            host_array(batch.lookback_dead).astype(bool)
            if batch.lookback_dead is not None
            else np.zeros(lookback.shape, dtype=bool)
        )
        table = host_array(batch.block_table).astype(np.int64)
        num_blocks = self.num_slots // self.block_size
        for r in range(qsl.shape[0] - 1):
            if qsl[r] == qsl[r + 1]:
                continue
            start = int(positions[qsl[r]])
            for j in range(lookback.shape[1]):
                pos = start - 1 - j
                if pos < 0 or lookback[r, j] < 0 or pos // self.block_size >= table.shape[1]:
                    continue
                block = int(table[r, pos // self.block_size])
                if not 0 <= block < num_blocks:
                    continue
                code = int(token_map[clamp_token_ids(lookback[r, j], token_map.shape[0])])
                self.slots[block * self.block_size + pos % self.block_size] = (
                    DEAD if lb_dead[r, j] else code
                )


class RequestHistory:
    """The last ``window`` tokens of each live request, for engines that keep none.

    Args:
        max_requests: request slots (the engine's persistent batch size).
        window: positions remembered per request; at least N-1, plus the
            longest speculative draft so that rejected drafts cannot
            overwrite accepted history. Default: N-1 + 16.
        device: where the ring lives.

    The engine tells hashing which slot each request uses through
    ``HashBatch.request_slots``; it calls :meth:`reset` when a slot is given
    to a new request, :meth:`seed` when a request arrives with history from
    elsewhere (disaggregated prefill), and :meth:`rollback` after rejecting
    speculative tokens.
    """

    def __init__(
        self,
        max_requests: int,
        max_ngram_size: int,
        window: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests <= 0:
            raise ValidationError(f"max_requests={max_requests!r} must be a positive integer")
        window = max_ngram_size - 1 + 16 if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or window < max_ngram_size - 1:
            raise ValidationError(
                f"window={window!r} must be an integer >= N-1 = {max_ngram_size - 1}"
            )
        self.max_requests = max_requests
        self.window = window
        self.max_ngram_size = max_ngram_size
        self.slots = torch.full((max_requests * window,), EMPTY, dtype=torch.int32, device=device)
        self.tags = torch.full((max_requests * window,), -1, dtype=torch.int64, device=device)

    @property
    def device(self) -> torch.device:
        return self.slots.device

    def _check_slot(self, request_slot: int) -> None:
        if not _is_int(request_slot) or not 0 <= request_slot < self.max_requests:
            raise ValidationError(
                f"request_slot={request_slot!r} must be in [0, {self.max_requests}), an integer"
            )

    def reset(self, request_slot: int) -> None:
        """Forget everything of one request slot (a new request takes it)."""
        self._check_slot(request_slot)
        ring = slice(request_slot * self.window, (request_slot + 1) * self.window)
        self.slots[ring] = EMPTY
        self.tags[ring] = -1

    def seed(
        self,
        request_slot: int,
        chunk_start: int,
        compressed_lookback: np.ndarray | list[int],
        lookback_dead: np.ndarray | list[bool] | None = None,
    ) -> None:
        """Start a slot from transferred history (disaggregated prefill).

        ``compressed_lookback[j]`` is the *compressed* id at position
        ``chunk_start - 1 - j`` (-1 unknown), as :meth:`TokenMap.compress` returns.
        """
        self.reset(request_slot)
        ids = np.asarray(compressed_lookback, dtype=np.int64).reshape(-1)
        dead = (
            np.zeros(ids.shape, dtype=bool)
            if lookback_dead is None
            else np.asarray(lookback_dead, dtype=bool).reshape(-1)
        )
        for j, (tok, is_dead) in enumerate(zip(ids.tolist(), dead.tolist(), strict=True)):
            pos = chunk_start - 1 - j
            if pos < 0 or tok < 0 or j >= self.window:
                continue
            slot = request_slot * self.window + pos % self.window
            self.slots[slot] = DEAD if is_dead else tok
            self.tags[slot] = pos

    def rollback(self, request_slot: int, num_tokens: int) -> None:
        """Forget positions ``>= num_tokens`` of a request (rejected speculative tokens).

        Two masked fills on the ring's device: no host synchronisation.
        ``num_tokens`` is a host integer in ``[0, 2**63)`` (a bool, a float or
        a negative count is refused: it would erase history silently).
        """
        self._check_slot(request_slot)
        num_tokens = _check_count("num_tokens", num_tokens)
        ring = slice(request_slot * self.window, (request_slot + 1) * self.window)
        stale = self.tags[ring] >= num_tokens
        self.slots[ring].masked_fill_(stale, EMPTY)
        self.tags[ring].masked_fill_(stale, -1)

    def rollback_many(
        self,
        request_slots: torch.Tensor | Sequence[int],
        num_tokens: torch.Tensor | Sequence[int],
        *,
        validate: bool = True,
    ) -> None:
        """:meth:`rollback` of several requests at once: request ``request_slots[i]`` keeps
        its positions ``< num_tokens[i]``.

        One gather, two ``where`` and two ``index_copy_`` on the ring's device,
        whatever the number of requests. Sequences are always checked (slots
        in ``[0, max_requests)``, no slot twice, counts in ``[0, 2**63)``).
        Tensors are checked the same way when ``validate`` (the default), which
        reads them to the host once: a slot of 9 or -1 would otherwise index
        another request's ring or fail inside torch, and a negative count would
        erase history. An engine that keeps its step free of host
        synchronisation passes ``validate=False`` with tensors it built itself
        (on the ring's device, distinct, in range: a repeated slot is then
        written in no defined order); nothing then waits for the device.
        """
        slot_values = _values_to_check("request_slots", request_slots, validate)
        count_values = _values_to_check("num_tokens", num_tokens, validate)
        if slot_values is not None:
            for i, slot in enumerate(slot_values):
                if not _is_int(slot) or not 0 <= slot < self.max_requests:
                    raise ValidationError(
                        f"request_slots[{i}]={slot!r}; expected a request slot, an integer in "
                        f"[0, max_requests={self.max_requests})"
                    )
            slots_list = [int(s) for s in slot_values]
            if len(set(slots_list)) != len(slots_list):
                raise ValidationError(
                    f"request_slots={slots_list} names a slot twice; expected distinct slots"
                )
            if not isinstance(request_slots, torch.Tensor):
                request_slots = torch.tensor(slots_list, dtype=torch.int64)
        if count_values is not None:
            counts = [_check_count(f"num_tokens[{i}]", n) for i, n in enumerate(count_values)]
            if not isinstance(num_tokens, torch.Tensor):
                num_tokens = torch.tensor(counts, dtype=torch.int64)
        assert isinstance(request_slots, torch.Tensor) and isinstance(num_tokens, torch.Tensor)
        if request_slots.ndim != 1 or num_tokens.shape != request_slots.shape:
            raise ValidationError(
                f"request_slots has shape {list(request_slots.shape)} and num_tokens "
                f"{list(num_tokens.shape)}; expected two 1-D tensors of one length"
            )
        device = self.slots.device
        index = request_slots.to(device=device, dtype=torch.int64, non_blocking=True)
        keep = num_tokens.to(device=device, dtype=torch.int64, non_blocking=True)
        slots = self.slots.view(self.max_requests, self.window)
        tags = self.tags.view(self.max_requests, self.window)
        ring_tags = tags.index_select(0, index)
        stale = ring_tags >= keep[:, None]
        ring_slots = slots.index_select(0, index).masked_fill_(stale, EMPTY)
        slots.index_copy_(0, index, ring_slots)
        tags.index_copy_(0, index, ring_tags.masked_fill_(stale, -1))

    def commit_reference(self, batch: HashBatch, token_map: np.ndarray) -> None:
        """Write the last ``window`` tokens of each chunk (what the commit kernel does);
        a request slot outside ``[0, max_requests)`` is not written."""
        if batch.request_slots is None:
            raise ValidationError("request_slots is required with a RequestHistory")
        qsl = host_array(batch.query_start_loc).astype(np.int64)
        ids = clamp_token_ids(host_array(batch.input_ids), token_map.shape[0])
        positions = host_array(batch.positions).astype(np.int64)
        dead = host_array(batch.dead_mask).astype(bool) if batch.dead_mask is not None else None
        req_slots = host_array(batch.request_slots).astype(np.int64)
        slots = self.slots.cpu().numpy().copy()
        tags = self.tags.cpu().numpy().copy()
        for r in range(qsl.shape[0] - 1):
            if not 0 <= req_slots[r] < self.max_requests:
                continue
            for i in range(max(int(qsl[r]), int(qsl[r + 1]) - self.window), int(qsl[r + 1])):
                if positions[i] < 0:  # no place in the ring (the kernel skips it too)
                    continue
                slot = req_slots[r] * self.window + positions[i] % self.window
                slots[slot] = DEAD if dead is not None and dead[i] else token_map[ids[i]]
                tags[slot] = positions[i]
        self.slots.copy_(torch.from_numpy(slots))
        self.tags.copy_(torch.from_numpy(tags))
