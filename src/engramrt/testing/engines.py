"""A scheduled step as a vLLM-v1 model runner or an SGLang forward batch would hold it.

:class:`VllmView` keeps a V1 runner's persistent buffers (``input_ids``,
``positions``, ``query_start_loc``, ``slot_mapping``, a block table) with
stale contents past the live rows, and hands over either whole buffers or
their live part; padded requests repeat the last boundary or own a padding
token each (as a uniform-decode graph pads them). :class:`SglangView` keeps
a request-to-token pool over the token-slot KV pool and builds extend,
decode and verify batches; padded requests point at pool row 0 with length
1, padding rows hold token 0. Both are an :class:`EngineView`, whose ``express``
returns the keyword arguments of its adapter
(:func:`~engramrt.adapters.from_vllm_step`,
:func:`~engramrt.adapters.from_sglang_batch`); :func:`adapt` calls it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engramrt.adapters import from_sglang_batch, from_vllm_step, vllm_slot_cache
from engramrt.hashing import HashBatch, HashConstants, RequestHistory, SlotHashCache
from engramrt.testing.scheduler import Chunk, Request, Scheduler, Step

__all__ = [
    "ENGINES",
    "EngineView",
    "SglangView",
    "VllmEngine",
    "VllmView",
    "adapt",
    "lookback_of",
    "seed_started",
    "sglang_adapter",
]


def sglang_adapter(consts: HashConstants) -> Callable[..., HashBatch]:
    """:func:`~engramrt.adapters.from_sglang_batch` for a model of ``consts``: the one
    place the simulator binds the adapter's model settings."""

    def adapter(**step: Any) -> HashBatch:
        return from_sglang_batch(hasher=consts, **step)

    return adapter


def lookback_of(request: Request, start: int, width: int) -> tuple[list[int], list[bool]]:
    """Tokenizer ids at ``start - 1 - j`` for ``j < width`` (-1 before the sequence)
    and their dead flags."""
    ids, dead = [], []
    for j in range(width):
        pos = start - 1 - j
        ids.append(request.tokens[pos] if pos >= 0 else -1)
        dead.append(request.dead[pos] if pos >= 0 else False)
    return ids, dead


def _slots(request: Request, start: int, end: int, block_size: int) -> list[int]:
    blocks = request.blocks
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


class EngineView(ABC):
    """A scheduled step as an engine holds it, handed over as its adapter's keyword
    arguments.

    Attributes:
        block_size: the KV block size of the engine's cache.
    """

    block_size: int

    def express(
        self,
        steps: Sequence[Step],
        lookback: tuple[np.ndarray, np.ndarray] | None,
        device: torch.device,
    ) -> dict[str, Any]:
        """The adapter's keyword arguments for ``steps`` run as one engine step, on
        ``device`` (``lookback``: ``[R_pad, N-1]`` tokenizer ids and dead flags, one row
        per request, padded ones included; None: no lookback ids)."""
        fields = self._fields(steps, device)
        if lookback is not None:
            fields["lookback_token_ids"] = torch.from_numpy(lookback[0]).to(device)
            fields["lookback_dead"] = torch.from_numpy(lookback[1]).to(device)
        return fields

    @abstractmethod
    def _fields(self, steps: Sequence[Step], device: torch.device) -> dict[str, Any]:
        """The adapter's keyword arguments for ``steps``, all but the lookback ids."""

    @abstractmethod
    def pool_rows(self, steps: Sequence[Step]) -> list[int]:
        """Each request's row of the batch (padded requests: 0), for ``request_slots``."""


class VllmView(EngineView):
    """A V1 model runner's persistent step buffers.

    Args:
        rng: draws the stale contents and the runner's hand-over choices.
        vocab: stale token ids are drawn from ``[0, vocab)``.
        max_tokens, max_requests: buffer sizes (padding included).
        max_blocks: block-table width.
        num_slots: KV slots (``num_blocks * block_size``).
        block_size: KV block size.
        pad_slot_id: the slot of padding tokens (-1 in vLLM).
        worst_padding: padded requests always own padding tokens and whole
            stale buffers are always handed over.
    """

    def __init__(
        self,
        rng,
        vocab: int,
        *,
        max_tokens: int,
        max_requests: int,
        max_blocks: int,
        num_slots: int,
        block_size: int,
        pad_slot_id: int = -1,
        worst_padding: bool = False,
    ) -> None:
        self.rng = rng
        self.block_size = block_size
        self.pad_slot_id = pad_slot_id
        self.worst_padding = worst_padding
        self.max_tokens, self.max_requests = max_tokens, max_requests
        self.input_ids = rng.integers(0, vocab, max_tokens)
        self.positions = rng.integers(0, 64, max_tokens)
        self.qsl = rng.integers(0, 50, max_requests + 1).astype(np.int32)
        self.slot_mapping = rng.integers(0, num_slots, max_tokens)
        self.block_table = rng.integers(0, num_slots // block_size, (max_requests, max_blocks))
        self.block_table = self.block_table.astype(np.int32)

    def _fields(self, steps: Sequence[Step], device: torch.device) -> dict[str, Any]:
        """One runner step: every step's requests, then their padded requests; every
        step's tokens, then their padding rows."""
        bs = self.block_size
        chunks = [c for s in steps for c in s.chunks]
        pad_ids = [t for s in steps for t in s.pad_tokens]
        num_reqs = len(chunks)
        r_pad = num_reqs + sum(s.pad_requests for s in steps)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        dead: list[bool] = []
        qsl = [0]
        for row, chunk in enumerate(chunks):
            req, start, end = chunk.request, chunk.start, chunk.end
            ids += req.tokens[start:end]
            dead += req.dead[start:end]
            positions += range(start, end)
            slots += _slots(req, start, end, bs)
            qsl.append(qsl[-1] + chunk.count)
            self.block_table[row, : len(req.blocks)] = req.blocks
        num_tokens = qsl[-1]
        t_pad = num_tokens + len(pad_ids)
        self.input_ids[:num_tokens] = ids
        self.input_ids[num_tokens:t_pad] = pad_ids
        self.positions[:num_tokens] = positions
        self.slot_mapping[:num_tokens] = slots
        self.slot_mapping[num_tokens:t_pad] = self.pad_slot_id
        self.qsl[: num_reqs + 1] = qsl
        if not self.worst_padding and self.rng.random() < 0.5:
            self.qsl[num_reqs + 1 : r_pad + 1] = num_tokens  # padded requests repeat the boundary
        else:  # or own one padding token each, as a uniform-decode graph pads them
            trailing = num_tokens + np.arange(1, r_pad - num_reqs + 1)
            self.qsl[num_reqs + 1 : r_pad + 1] = np.minimum(trailing, t_pad)
        dead_mask = np.zeros(t_pad, dtype=bool)
        dead_mask[:num_tokens] = dead
        # Runners hand over either the whole slot mapping buffer or its live part.
        slot_len = self.max_tokens if self.worst_padding or self.rng.random() < 0.5 else num_tokens
        rows = self.max_requests if self.worst_padding or self.rng.random() < 0.5 else num_reqs
        step: dict[str, Any] = {
            "input_ids": torch.from_numpy(self.input_ids[:t_pad].copy()).to(device),
            "positions": torch.from_numpy(self.positions[:t_pad].copy()).to(device),
            "query_start_loc": torch.from_numpy(self.qsl[: r_pad + 1].copy()).to(device),
            "slot_mapping": torch.from_numpy(self.slot_mapping[:slot_len].copy()).to(device),
            "block_table": torch.from_numpy(self.block_table[:rows].copy()).to(device),
            "block_size": bs,
            "num_tokens_unpadded": num_tokens,
            "num_reqs_unpadded": num_reqs,
            "pad_slot_id": self.pad_slot_id,
            "dead_mask": torch.from_numpy(dead_mask).to(device),
        }
        return step

    def pool_rows(self, steps: Sequence[Step]) -> list[int]:
        rows = [c.request.row for s in steps for c in s.chunks]
        return rows + [0] * sum(s.pad_requests for s in steps)


class SglangView(EngineView):
    """An SGLang request-to-token pool (``[max_requests, max_context]`` KV slots)."""

    def __init__(self, rng, *, max_requests: int, max_context: int, num_slots: int) -> None:
        self.block_size = 1
        self.req_to_token = rng.integers(0, num_slots, (max_requests, max_context))
        self.req_to_token = self.req_to_token.astype(np.int32)

    def _fields(self, steps: Sequence[Step], device: torch.device) -> dict[str, Any]:
        """One forward batch (``steps``: one step)."""
        (step,) = steps
        chunks: list[Chunk] = step.chunks
        ids: list[int] = []
        dead: list[bool] = []
        for chunk in chunks:
            req = chunk.request
            ids += req.tokens[chunk.start : chunk.end]
            dead += req.dead[chunk.start : chunk.end]
            self.req_to_token[req.row, : chunk.end] = _slots(req, 0, chunk.end, 1)
        num_reqs, num_tokens = len(chunks), len(ids)
        extra = step.pad_requests
        t_pad = num_tokens + len(step.pad_tokens)
        input_ids = np.zeros(t_pad, dtype=np.int64)
        input_ids[:num_tokens] = ids
        dead_mask = np.zeros(t_pad, dtype=bool)
        dead_mask[:num_tokens] = dead
        per_request = chunks[0].count if step.kind != "extend" and chunks else 1
        rows = [c.request.row for c in chunks] + [0] * extra  # padded: row 0, length 1
        prefix = [c.start for c in chunks]
        counts = [c.count for c in chunks]
        batch: dict[str, Any] = {
            "input_ids": torch.from_numpy(input_ids).to(device),
            "req_pool_indices": torch.tensor(rows, dtype=torch.int64).to(device),
            "req_to_token": torch.from_numpy(self.req_to_token.copy()).to(device),
            "num_reqs": num_reqs,
            "num_actual_tokens": num_tokens,
            "dead_mask": torch.from_numpy(dead_mask).to(device),
        }
        if step.kind == "decode":
            seq_lens = [s + 1 for s in prefix] + [1] * extra
            batch["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int64).to(device)
        else:
            batch["extend_prefix_lens"] = torch.tensor(prefix + [1] * extra, dtype=torch.int32)
            batch["extend_seq_lens"] = torch.tensor(
                counts + [per_request] * extra, dtype=torch.int32
            )
            batch["seq_lens"] = torch.tensor(
                [s + c for s, c in zip(prefix, counts, strict=True)] + [1] * extra,
                dtype=torch.int64,
            )
            for name in ("extend_prefix_lens", "extend_seq_lens", "seq_lens"):
                batch[name] = batch[name].to(device)
        return batch

    def pool_rows(self, steps: Sequence[Step]) -> list[int]:
        return [c.request.row for s in steps for c in s.chunks] + [0] * steps[0].pad_requests


ENGINES = ("vllm", "sglang")


def adapt(
    adapter: Callable[..., HashBatch],
    engine_step: dict[str, Any],
    *,
    request_slots: list[int] | None = None,
) -> HashBatch:
    """The engine step through its adapter; ``request_slots`` (a :class:`RequestHistory`'s
    rows: the persistent-batch rows or pool rows) added to the batch."""
    batch = adapter(**engine_step)
    if request_slots is not None:
        batch.request_slots = torch.tensor(
            request_slots, dtype=torch.int32, device=batch.input_ids.device
        )
    return batch


def seed_started(
    history: Any, started: Sequence[Request], token_map: np.ndarray, width: int
) -> None:
    """Reset the :class:`RequestHistory` ring of every request that (re)started, and seed it
    with the ``width`` compressed ids before the position it starts at (a prefix-cache hit);
    any other history needs nothing."""
    if not isinstance(history, RequestHistory):
        return
    for request in started:
        history.reset(request.row)
        if request.computed:
            ids, dead = lookback_of(request, request.computed, width)
            known = [i for i in ids if i >= 0]
            compressed = token_map[np.array(known, dtype=np.int64)]
            history.seed(request.row, request.computed, compressed, dead[: len(known)])


class VllmEngine:
    """A simulated vLLM-style engine's side of Engram, one request served at a time: its
    :class:`Scheduler` (paged KV blocks, prefix cache), its runner's buffers
    (:class:`VllmView`) and the hash history bound beside its KV cache; :meth:`batch`
    turns a scheduled chunk into the :class:`HashBatch` an
    :class:`~engramrt.runtime.EngramRuntime` plans.

    Args:
        history: ``"slot"`` (a :class:`SlotHashCache` over the KV blocks),
            ``"request"`` (a :class:`RequestHistory`) or ``"lookback"`` (lookback
            ids in every batch, no history object).
        max_ngram_size: N of the hashing (the history window is N-1).
        token_map: ``[V]`` compressed id of every tokenizer id (seeds rings).
        max_requests: requests admitted over the engine's life (one KV row each).
        max_len: the longest request (prompt, generated and draft tokens).
        max_tokens: the most tokens of one step.
        max_drafts: draft tokens of a verify step (the ring keeps that many more).
        block_size: KV block size.
        device: where the batches live.
        seed: the scheduler's block choice and the runner's stale buffers.

    Attributes:
        scheduler, view: the scheduler and the runner's buffers.
        history: the history object (None for ``"lookback"``).
    """

    def __init__(
        self,
        *,
        history: str,
        max_ngram_size: int,
        token_map: np.ndarray,
        max_requests: int,
        max_len: int,
        max_tokens: int,
        max_drafts: int,
        block_size: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        rng = np.random.default_rng(seed)
        blocks_per_request = -(-max_len // block_size)
        self.width = max_ngram_size - 1
        self.token_map = token_map
        self.device = device
        self.scheduler = Scheduler(
            block_size=block_size,
            num_blocks=blocks_per_request * max_requests + 1,
            max_requests=max_requests,
            max_len=max_len,
            rng=rng,
        )
        self.view = VllmView(
            rng,
            int(token_map.shape[0]),
            max_tokens=max_tokens,
            max_requests=1,
            max_blocks=blocks_per_request,
            num_slots=self.scheduler.num_blocks * block_size,
            block_size=block_size,
        )
        self.history: SlotHashCache | RequestHistory | None = None
        if history == "slot":
            self.history = vllm_slot_cache(self.scheduler.num_blocks, block_size, device)
        elif history == "request":
            window = self.width + max_drafts + 1
            self.history = RequestHistory(
                max_requests, max_ngram_size, window=window, device=device
            )

    def batch(self, chunk: Chunk) -> HashBatch:
        """The :class:`HashBatch` of a step holding ``chunk`` alone, as the runner hands it
        over and the adapter converts it (rings of newly started requests seeded first)."""
        seed_started(self.history, self.scheduler.started, self.token_map, self.width)
        self.scheduler.started = []
        request = chunk.request
        lookback: tuple[np.ndarray, np.ndarray] | None = None
        if self.history is None:  # lookback ids only: the N-1 tokens before the chunk
            ids, dead = lookback_of(request, chunk.start, self.width)
            lookback = (np.array([ids], dtype=np.int64), np.array([dead], dtype=bool))
        engine_step = self.view.express([Step(0, [chunk])], lookback, self.device)
        if isinstance(self.history, SlotHashCache):
            engine_step["cache"] = self.history
        rows = [request.row] if isinstance(self.history, RequestHistory) else None
        return adapt(from_vllm_step, engine_step, request_slots=rows)

    def serve(
        self,
        request: Request,
        prompt_len: int,
        max_new_tokens: int,
        next_tokens: Callable[[Chunk, str], list[int]],
        *,
        chunk_size: int,
        speculative_step: int | None = None,
        drafts: Sequence[int] = (),
        truncate: Callable[[int], None] | None = None,
    ) -> tuple[int, int]:
        """Serve an admitted ``request`` until it holds ``max_new_tokens`` generated tokens.

        Its prompt's tokens not in the prefix cache are prefilled in chunks of
        ``chunk_size``, then one token per decode step; decode step
        ``speculative_step`` (0-based; None: none) verifies the pending token and
        ``drafts`` in one step, keeps the drafts greedy decoding agrees with and rolls
        the rest back: in the scheduler (blocks past the kept tokens given back), in
        the hash history (:meth:`rollback`) and through ``truncate(kept tokens)`` in
        the model's own state (its KV cache).

        ``next_tokens(chunk, kind)`` runs one step holding ``chunk`` (``kind``:
        ``"prefill"``, ``"decode"`` or ``"verify"``) and returns the greedy token
        after each of the chunk's positions. Returns ``(accepted, rejected)`` drafts.
        """
        scheduler, drafts = self.scheduler, list(drafts)
        after: list[int] = []
        while request.computed < prompt_len:
            chunk = scheduler.chunk(request, min(chunk_size, prompt_len - request.computed))
            after = next_tokens(chunk, "prefill")
            scheduler.advance(chunk)
        request.tokens.append(after[-1])
        request.dead.append(False)
        accepted = rejected = decode_index = 0
        while len(request.tokens) - prompt_len < max_new_tokens:
            if decode_index == speculative_step:
                chunk = scheduler.chunk(request, 0, drafts)  # the pending token, then the drafts
                greedy = next_tokens(chunk, "verify")
                agreed = 0
                while agreed < len(drafts) and greedy[agreed] == drafts[agreed]:
                    agreed += 1
                accepted, rejected = accepted + agreed, rejected + len(drafts) - agreed
                keep = scheduler.advance(chunk, agreed)  # the pending token and the agreed
                if truncate is not None:
                    truncate(keep)
                self.rollback(request, keep)
                request.tokens.append(greedy[agreed])
            else:
                chunk = scheduler.chunk(request, 1)
                after = next_tokens(chunk, "decode")
                scheduler.advance(chunk)
                request.tokens.append(after[-1])
            request.dead.append(False)
            decode_index += 1
        del request.tokens[prompt_len + max_new_tokens :]
        del request.dead[prompt_len + max_new_tokens :]
        return accepted, rejected

    def rollback(self, request: Request, keep: int) -> None:
        """Forget request ``request``'s positions from ``keep`` on in a ring (rejected
        drafts); the other histories need nothing (the slots are rewritten)."""
        if isinstance(self.history, RequestHistory):
            self.history.rollback(request.row, keep)
