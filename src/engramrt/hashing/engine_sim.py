"""A small simulated serving engine that drives hashing the way real ones do.

Used by the streaming property tests and by the soak (``scripts/soak``,
:mod:`engramrt.hashing.soak`); imports torch, so ``import engramrt`` does not
import it.

Requests arrive, are prefilled in random chunks, decode one token at a time
or verify speculative drafts (some rejected), share prefix blocks, and are
batched together with padding rows. Every step's row ids are compared with
one-shot hashing of each request's sequence as the engine knows it then.

History modes (SPEC §5):
- ``"lookback"``: the engine sends lookback ids only;
- ``"slot"``: a SlotHashCache read through block tables, no lookback ids
  (except for requests whose prefill ran elsewhere);
- ``"request"``: a RequestHistory ring per request slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engramrt.hashing import (
    HashBatch,
    HashConstants,
    NgramHasher,
    RequestHistory,
    SlotHashCache,
    hash_sequence,
)

__all__ = ["BLOCK_SIZE", "MODES", "NUM_BLOCKS", "Engine", "Request", "run_schedule"]

MODES = ("lookback", "slot", "request")
"""History modes of SPEC §5 that a schedule can run through."""

BLOCK_SIZE = 4
NUM_BLOCKS = 256


@dataclass
class Request:
    tokens: list[int]  # tokens the engine knows (accepted + current drafts)
    dead: list[bool]
    computed: int = 0  # positions already hashed (and written to history)
    blocks: list[int] = field(default_factory=list)
    slot: int = 0  # request-history slot
    remote_prefix: int = 0  # positions prefilled on another instance
    shared_prefix: int = 0  # positions whose blocks are borrowed from another request


class Engine:
    def __init__(
        self,
        rng: np.random.Generator,
        consts: HashConstants,
        token_map: np.ndarray,
        hasher_factory: Callable[[HashBatch, Any], torch.Tensor],
        mode: str,
        *,
        drop_lookback: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rng = rng
        self.consts = consts
        self.token_map = token_map
        self.mode = mode
        self.drop_lookback = drop_lookback
        self.n = consts.max_ngram_size
        self.hashers = hasher_factory
        self.free_blocks = list(range(NUM_BLOCKS))
        self.device = torch.device(device)
        self.cache = SlotHashCache(NUM_BLOCKS * BLOCK_SIZE, BLOCK_SIZE, self.device)
        self.history = RequestHistory(16, self.n, window=self.n - 1 + 6, device=self.device)
        self.free_slots = list(range(16))
        self.mismatches: list[str] = []
        self.steps = 0

    # Request life cycle ------------------------------------------------------
    def new_request(
        self,
        length: int,
        dead_rate: float,
        prefix_of: Request | None = None,
        remote_prefix: int = 0,
    ) -> Request:
        vocab = self.token_map.shape[0]
        tokens = self.rng.integers(0, vocab, size=length).tolist()
        dead = (self.rng.random(length) < dead_rate).tolist()
        req = Request(tokens=tokens, dead=dead, slot=self.free_slots.pop())
        self.history.reset(req.slot)
        if prefix_of is not None:
            # Prefix-cache hit: borrow the other request's full blocks.
            shared_blocks = min(prefix_of.computed, len(prefix_of.tokens)) // BLOCK_SIZE
            shared = shared_blocks * BLOCK_SIZE
            req.tokens[:shared] = prefix_of.tokens[:shared]
            req.dead[:shared] = prefix_of.dead[:shared]
            req.blocks = list(prefix_of.blocks[:shared_blocks])
            req.computed = req.shared_prefix = shared
            if self.mode == "request":  # the ring knows nothing of the borrowed prefix
                self.history.seed(req.slot, shared, *self._lookback(req, shared, compressed=True))
        elif remote_prefix:
            # Disaggregated prefill: another instance hashed the prefix; we get
            # KV (blocks) but an empty hash cache, plus lookback ids.
            req.computed = req.remote_prefix = min(remote_prefix, length)
            self._ensure_blocks(req, req.computed)
            if self.mode == "request":
                self.history.seed(
                    req.slot, req.computed, *self._lookback(req, req.computed, compressed=True)
                )
        return req

    def _ensure_blocks(self, req: Request, upto: int) -> None:
        while len(req.blocks) * BLOCK_SIZE < upto:
            req.blocks.append(self.free_blocks.pop(int(self.rng.integers(len(self.free_blocks)))))

    def _lookback(self, req: Request, start: int, compressed: bool = False):
        ids, dead = [], []
        for j in range(self.n - 1):
            pos = start - 1 - j
            if pos < 0:
                ids.append(-1)
                dead.append(False)
            else:
                tok = req.tokens[pos]
                ids.append(int(self.token_map[tok]) if compressed else tok)
                dead.append(req.dead[pos])
        return ids, dead

    # One step ------------------------------------------------------------------
    def step(self, chunks: list[tuple[Request, int]], pad_rows: int, pad_requests: int) -> None:
        """Hash one batch: each (request, n) hashes the next n tokens of that request."""
        ids, positions, dead, qsl, slot_map = [], [], [], [0], []
        lookback, lookback_dead, tables, req_slots = [], [], [], []
        expected = []
        for req, count in chunks:
            start = req.computed
            end = start + count
            self._ensure_blocks(req, end)
            ids += req.tokens[start:end]
            dead += req.dead[start:end]
            positions += list(range(start, end))
            qsl.append(qsl[-1] + count)
            slot_map += [
                req.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            lb, lbd = self._lookback(req, start)
            needs_lookback = self.mode == "lookback" or (
                self.mode == "slot" and req.remote_prefix and start == req.remote_prefix
            )
            if self.drop_lookback or not needs_lookback:
                lb = [-1] * (self.n - 1)
            lookback.append(lb)
            lookback_dead.append(lbd)
            tables.append(req.blocks)
            req_slots.append(req.slot)
            full = hash_sequence(
                self.token_map[np.array(req.tokens[:end], dtype=np.int64)],
                self.consts,
                np.array(req.dead[:end], dtype=bool),
            )
            expected.append(full[start:end])
        for _ in range(pad_requests):
            qsl.append(qsl[-1])
            lookback.append([-1] * (self.n - 1))
            lookback_dead.append([False] * (self.n - 1))
            tables.append([])
            req_slots.append(0)
        pad_ids = self.rng.integers(0, self.token_map.shape[0], size=pad_rows).tolist()
        for tok in pad_ids:
            ids.append(tok)
            dead.append(False)
            positions.append(0)
            slot_map.append(-1)
            expected.append(hash_sequence(self.token_map[np.array([tok])], self.consts))
        width = max([len(t) for t in tables] + [1])
        table = np.zeros((len(tables), width), dtype=np.int32)
        for r, t in enumerate(tables):
            table[r, : len(t)] = t
        batch = HashBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            dead_mask=torch.tensor(dead, dtype=torch.bool),
            lookback_token_ids=torch.tensor(lookback, dtype=torch.int64).reshape(-1, self.n - 1),
            lookback_dead=torch.tensor(lookback_dead, dtype=torch.bool).reshape(-1, self.n - 1),
            slot_mapping=torch.tensor(slot_map, dtype=torch.int64),
            block_table=torch.from_numpy(table),
            request_slots=torch.tensor(req_slots, dtype=torch.int32),
        )
        history = {"lookback": None, "slot": self.cache, "request": self.history}[self.mode]
        batch = batch.to(self.device)
        got = self.hashers(batch, history).cpu().numpy().astype(np.int64)
        want = np.concatenate(expected) if expected else np.zeros((0, *got.shape[1:]), np.int64)
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)[:3].tolist()
            self.mismatches.append(f"step {self.steps}: first mismatches at {bad}")
        for req, count in chunks:
            req.computed += count
        self.steps += 1

    def speculate(self, req: Request, drafts: int) -> tuple[int, int]:
        """Append ``drafts`` random draft tokens after the next real token; return (start, count)."""
        vocab = self.token_map.shape[0]
        start = req.computed
        draft = self.rng.integers(0, vocab, size=drafts).tolist()
        # The engine's view this step: accepted tokens, then the drafts.
        req.spec_saved = (req.tokens[start + 1 :], req.dead[start + 1 :])  # type: ignore[attr-defined]
        req.tokens = req.tokens[: start + 1] + draft
        req.dead = req.dead[: start + 1] + [False] * drafts
        return start, drafts + 1

    def verify(self, req: Request, start: int, accepted: int) -> None:
        """Keep ``accepted`` drafts, then the true continuation; roll history back."""
        rest_tokens, rest_dead = req.spec_saved  # type: ignore[attr-defined]
        keep = start + 1 + accepted
        req.tokens = req.tokens[:keep] + rest_tokens
        req.dead = req.dead[:keep] + rest_dead
        req.computed = keep
        self.history.rollback(req.slot, keep)


def run_schedule(
    seed: int,
    mode: str,
    backend: str,
    consts: HashConstants,
    token_map: Any,
    *,
    max_steps: int = 12,
    device: torch.device | str = "cpu",
    drop_lookback: bool = False,
    sabotage: str | None = None,
    hasher: NgramHasher | None = None,
) -> Engine:
    """Run one random schedule drawn from ``seed``; returns the engine (``mismatches`` lists failures).

    The schedule: a first request prefilled in part, then up to ``max_steps``
    batches mixing chunked prefill, decode, speculative drafts verified with
    random rejections, a prefix-cache hit that borrows the first request's
    blocks, a request whose prefix was prefilled elsewhere (lookback ids
    only), dead spans, padding rows and padded requests, then an empty batch.
    ``sabotage`` (``"rebind"``, ``"reset"``) loses history on purpose, for
    negative controls. ``hasher``: one to reuse across schedules (it keeps no
    state between calls; building one per run costs a soak most of its time
    on a GPU), built for ``consts``, ``backend`` and ``device`` with
    ``check_ids=True``; None builds it.
    """
    rng = np.random.default_rng(seed)
    if hasher is None:
        hasher = NgramHasher(consts, token_map, device, backend=backend, check_ids=True)
    engine = Engine(
        rng, consts, token_map.map, hasher, mode, drop_lookback=drop_lookback, device=device
    )
    dead_rate = float(rng.choice([0.0, 0.0, 0.15]))
    first = engine.new_request(int(rng.integers(9, 24)), dead_rate)
    active = [first]
    # The first step prefills part of the first request, so later steps need history.
    engine.step(
        [(first, int(rng.integers(1, 6)))], pad_rows=int(rng.integers(0, 3)), pad_requests=0
    )
    spawned_prefix = spawned_remote = False
    for _ in range(max_steps):
        # Each ``rng.random()`` comes first, so a seed draws the same schedule whatever
        # ``max_steps``; a request is only added while a history slot and blocks are free.
        room = len(engine.free_slots) > 0 and len(engine.free_blocks) >= 32
        if not spawned_prefix and first.computed >= BLOCK_SIZE and rng.random() < 0.5 and room:
            # Longer than what it borrows: accepted drafts can take ``first``
            # past any fixed bound, so the upper end follows ``computed``.
            length = int(rng.integers(first.computed + 1, max(30, first.computed + 8)))
            active.append(engine.new_request(length, dead_rate, prefix_of=first))
            spawned_prefix = True
        room = len(engine.free_slots) > 0 and len(engine.free_blocks) >= 32
        if not spawned_remote and rng.random() < 0.3 and room:
            active.append(
                engine.new_request(
                    int(rng.integers(6, 20)), dead_rate, remote_prefix=int(rng.integers(1, 6))
                )
            )
            spawned_remote = True
        room = len(engine.free_slots) > 0 and len(engine.free_blocks) >= 32
        if rng.random() < 0.2 and room:
            active.append(engine.new_request(int(rng.integers(1, 12)), dead_rate))
        live = [r for r in active if r.computed < len(r.tokens)]
        if not live:
            break
        order = rng.permutation(len(live))
        chunks, specs = [], []
        for idx in order[: int(rng.integers(1, len(live) + 1))]:
            req = live[idx]
            remaining = len(req.tokens) - req.computed
            if remaining >= 2 and rng.random() < 0.3:
                drafts = int(rng.integers(1, min(4, remaining)))
                start, count = engine.speculate(req, drafts)
                chunks.append((req, count))
                specs.append((req, start, drafts))
            else:
                chunks.append((req, int(rng.integers(1, min(remaining, 7) + 1))))
        if sabotage == "rebind" and engine.steps == 2:
            engine.cache.bind(engine.cache.num_slots, BLOCK_SIZE)
        if sabotage == "reset" and engine.steps == 2:
            for req in active:
                engine.history.reset(req.slot)
        engine.step(chunks, pad_rows=int(rng.integers(0, 3)), pad_requests=int(rng.integers(0, 2)))
        for req, start, drafts in specs:
            engine.verify(req, start, int(rng.integers(0, drafts + 1)))
    engine.step([], pad_rows=0, pad_requests=0)  # an empty batch
    return engine
