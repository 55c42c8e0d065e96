"""A small simulated serving engine that drives hashing the way real ones do.

Used by the streaming property tests and by the soak (``scripts/soak``,
:mod:`engramrt.hashing.soak`); imports torch, so ``import engramrt`` does not
import it.

Requests arrive, are prefilled in random chunks, decode one token at a time
or verify speculative drafts (some rejected), share prefix blocks, and are
batched together with padding rows. Every step's row ids are compared with
one-shot hashing of each request's sequence as the engine knows it then.

Many schedules can run at once (:func:`run_schedules`): each is one
simulated engine owning a disjoint range of KV blocks and request-history
slots of one shared history store, and every step hashes all of their
batches as the requests of one batch, one hasher call (one kernel launch)
for all of them, as an engine serving many users would. A schedule alone
(:func:`run_schedule`) draws exactly the same steps from its seed.

History modes (SPEC §5):
- ``"lookback"``: the engine sends lookback ids only;
- ``"slot"``: a SlotHashCache read through block tables, no lookback ids
  (except for requests whose prefill ran elsewhere);
- ``"request"``: a RequestHistory ring per request slot.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
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
)

__all__ = [
    "BLOCK_SIZE",
    "HISTORY_SLOTS",
    "MODES",
    "NUM_BLOCKS",
    "Engine",
    "Request",
    "StepPart",
    "one_shot_rows",
    "run_schedule",
    "run_schedules",
]

MODES = ("lookback", "slot", "request")
"""History modes of SPEC §5 that a schedule can run through."""

BLOCK_SIZE = 4
NUM_BLOCKS = 256
HISTORY_SLOTS = 16
"""KV blocks and request-history slots of one simulated engine."""


def one_shot_rows(
    sequences: Sequence[tuple[np.ndarray, np.ndarray, int, int]], consts: HashConstants
) -> np.ndarray:
    """Rows ``start..end-1`` of hashing each whole sequence at once, concatenated.

    Each entry is ``(compressed_ids [S], dead [S], start, end)`` with
    ``end <= S``; the result is ``[sum(end - start), L, C]`` int64, equal to
    ``concatenate([hash_sequence(ids[:end], consts, dead[:end])[start:end] ...])``
    (SPEC §4; a row depends only on its own and earlier positions), computed
    with numpy array ops over every requested row at once instead of a
    Python loop per token.
    """
    n, h = consts.max_ngram_size, consts.n_heads
    n_layers, n_cols = consts.n_layers, consts.n_cols
    lengths = [end - start for _, _, start, end in sequences]
    total = int(sum(lengths))
    out = np.empty((total, n_layers, n_cols), dtype=np.int64)
    if total == 0:
        return out
    flat = np.concatenate([np.asarray(ids[:end], np.int64) for ids, _, _, end in sequences])
    flat_dead = np.concatenate([np.asarray(dead[:end], bool) for _, dead, _, end in sequences])
    bases = np.cumsum([0] + [end for _, _, _, end in sequences[:-1]])
    index = np.concatenate(
        [
            base + np.arange(start, end)
            for base, (_, _, start, end) in zip(bases, sequences, strict=True)
        ]
    )  # [M] flat index of each wanted row
    positions = np.concatenate([np.arange(start, end) for _, _, start, end in sequences])
    mult = np.asarray(consts.multipliers, np.int64)  # [L, N]
    primes = np.asarray(consts.col_primes, np.int64)  # [L, C]
    offsets = np.asarray(consts.offsets, np.int64)  # [L, C]
    blocked = np.zeros(total, dtype=bool)
    rolling = np.zeros((total, n_layers), dtype=np.int64)
    with np.errstate(over="ignore"):
        for k in range(n):
            src = np.maximum(index - k, 0)
            blocked |= (positions - k < 0) | flat_dead[src]
            value = np.where(blocked, consts.pad_id, flat[src])  # [M]
            rolling ^= value[:, None] * mult[None, :, k]
            if k == 0:
                continue
            cols = slice((k - 1) * h, k * h)
            out[:, :, cols] = rolling[:, :, None] % primes[None, :, cols] + offsets[None, :, cols]
    return out


@dataclass
class Request:
    tokens: list[int]  # tokens the engine knows (accepted + current drafts)
    dead: list[bool]
    computed: int = 0  # positions already hashed (and written to history)
    blocks: list[int] = field(default_factory=list)
    slot: int = 0  # request-history slot
    remote_prefix: int = 0  # positions prefilled on another instance
    shared_prefix: int = 0  # positions whose blocks are borrowed from another request


@dataclass
class StepPart:
    """One engine's batch of one step, before it is hashed.

    ``counts`` are the requests' token counts (0 for padded requests), then
    ``pad_ids`` padding rows follow; ``expected`` lists, per request and then
    per padding row, ``(compressed ids, dead, start, end)`` for
    :func:`one_shot_rows`.
    """

    chunks: list[tuple[Request, int]]
    ids: list[int]
    positions: list[int]
    dead: list[bool]
    counts: list[int]
    slot_mapping: list[int]
    lookback: list[list[int]]
    lookback_dead: list[list[bool]]
    tables: list[list[int]]
    request_slots: list[int]
    pad_ids: list[int]
    expected: list[tuple[np.ndarray, np.ndarray, int, int]]


class Engine:
    """One simulated engine; its KV blocks and history slots start at the given offsets.

    ``cache`` and ``history`` are shared by every engine of a group (each
    uses its own blocks and slots of them), or built for this engine alone.
    """

    def __init__(
        self,
        rng: np.random.Generator,
        consts: HashConstants,
        token_map: np.ndarray,
        mode: str,
        *,
        drop_lookback: bool = False,
        device: torch.device | str = "cpu",
        cache: SlotHashCache | None = None,
        history: RequestHistory | None = None,
        block_offset: int = 0,
        slot_offset: int = 0,
    ) -> None:
        self.rng = rng
        self.consts = consts
        self.token_map = token_map
        self.mode = mode
        self.drop_lookback = drop_lookback
        self.n = consts.max_ngram_size
        self.free_blocks = list(range(block_offset, block_offset + NUM_BLOCKS))
        self.device = torch.device(device)
        self.cache = cache or SlotHashCache(NUM_BLOCKS * BLOCK_SIZE, BLOCK_SIZE, self.device)
        self.history = history or RequestHistory(
            HISTORY_SLOTS, self.n, window=self.n - 1 + 6, device=self.device
        )
        self.free_slots = list(range(slot_offset, slot_offset + HISTORY_SLOTS))
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
        if self.mode == "request":  # the other modes never read the ring: no device ops
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
    def prepare(
        self, chunks: list[tuple[Request, int]], pad_rows: int, pad_requests: int
    ) -> StepPart:
        """This engine's batch: each (request, n) hashes the next n tokens of that request."""
        part = StepPart(chunks, [], [], [], [], [], [], [], [], [], [], [])
        for req, count in chunks:
            start = req.computed
            end = start + count
            self._ensure_blocks(req, end)
            part.ids += req.tokens[start:end]
            part.dead += req.dead[start:end]
            part.positions += range(start, end)
            part.counts.append(count)
            part.slot_mapping += [
                req.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            lb, lbd = self._lookback(req, start)
            needs_lookback = self.mode == "lookback" or (
                self.mode == "slot" and req.remote_prefix and start == req.remote_prefix
            )
            if self.drop_lookback or not needs_lookback:
                lb = [-1] * (self.n - 1)
            part.lookback.append(lb)
            part.lookback_dead.append(lbd)
            part.tables.append(req.blocks)
            part.request_slots.append(req.slot)
            part.expected.append(
                (
                    self.token_map[np.array(req.tokens[:end], dtype=np.int64)],
                    np.array(req.dead[:end], dtype=bool),
                    start,
                    end,
                )
            )
        for _ in range(pad_requests):
            part.counts.append(0)
            part.lookback.append([-1] * (self.n - 1))
            part.lookback_dead.append([False] * (self.n - 1))
            part.tables.append([])
            part.request_slots.append(0)
        part.pad_ids = self.rng.integers(0, self.token_map.shape[0], size=pad_rows).tolist()
        no_dead = np.zeros(1, dtype=bool)
        for tok in part.pad_ids:
            part.expected.append((self.token_map[np.array([tok])], no_dead, 0, 1))
        return part

    def finish(self, part: StepPart, got: np.ndarray, want: np.ndarray) -> None:
        """Compare this engine's rows (its requests' tokens, then its padding rows) and advance."""
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)[:3].tolist()
            self.mismatches.append(f"step {self.steps}: first mismatches at {bad}")
        for req, count in part.chunks:
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

    def verify(self, req: Request, start: int, accepted: int) -> int:
        """Keep ``accepted`` drafts, then the true continuation; returns the tokens the
        request keeps (its history rolls back to them: :meth:`roll_back`)."""
        rest_tokens, rest_dead = req.spec_saved  # type: ignore[attr-defined]
        keep = start + 1 + accepted
        req.tokens = req.tokens[:keep] + rest_tokens
        req.dead = req.dead[:keep] + rest_dead
        req.computed = keep
        return keep

    def roll_back(self, kept: Sequence[tuple[Request, int]]) -> None:
        """Roll the request history back after a step's verifications: one request
        through ``rollback``, several at once through ``rollback_many``."""
        if self.mode != "request" or not kept:
            return
        if len(kept) == 1:
            self.history.rollback(kept[0][0].slot, kept[0][1])
        else:
            self.history.rollback_many([r.slot for r, _ in kept], [n for _, n in kept])


def _schedule(
    engine: Engine, max_steps: int, sabotage: str | None
) -> Generator[StepPart, None, None]:
    """The schedule drawn from ``engine.rng``: yields each step's batch; the caller
    hashes it and calls :meth:`Engine.finish` before resuming."""
    rng = engine.rng
    dead_rate = float(rng.choice([0.0, 0.0, 0.15]))
    first = engine.new_request(int(rng.integers(9, 24)), dead_rate)
    active = [first]
    # The first step prefills part of the first request, so later steps need history.
    yield engine.prepare(
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
        yield engine.prepare(
            chunks, pad_rows=int(rng.integers(0, 3)), pad_requests=int(rng.integers(0, 2))
        )
        engine.roll_back(
            [
                (req, engine.verify(req, start, int(rng.integers(0, drafts + 1))))
                for req, start, drafts in specs
            ]
        )
    yield engine.prepare([], pad_rows=0, pad_requests=0)  # an empty batch


def _hash_step(
    parts: Sequence[tuple[Engine, StepPart]],
    hasher: Callable[[HashBatch, Any], torch.Tensor],
    history: SlotHashCache | RequestHistory | None,
    consts: HashConstants,
    device: torch.device,
) -> None:
    """Hash every engine's batch as one batch, compare each engine's rows, advance them.

    The combined batch holds every engine's requests (padded requests
    included) in order, then every engine's padding rows: padding rows must
    come after ``query_start_loc[-1]``.
    """
    n = consts.max_ngram_size
    ids = [t for _, p in parts for t in p.ids] + [t for _, p in parts for t in p.pad_ids]
    owned = sum(len(p.ids) for _, p in parts)
    pads = len(ids) - owned
    counts = [c for _, p in parts for c in p.counts]
    tables = [t for _, p in parts for t in p.tables]
    width = max([len(t) for t in tables] + [1])
    table = np.zeros((len(tables), width), dtype=np.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = t
    qsl = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=qsl[1:])
    batch = HashBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(
            [q for _, p in parts for q in p.positions] + [0] * pads, dtype=torch.int64
        ),
        query_start_loc=torch.from_numpy(qsl),
        dead_mask=torch.tensor(
            [d for _, p in parts for d in p.dead] + [False] * pads, dtype=torch.bool
        ),
        lookback_token_ids=torch.tensor(
            [lb for _, p in parts for lb in p.lookback], dtype=torch.int64
        ).reshape(-1, n - 1),
        lookback_dead=torch.tensor(
            [lb for _, p in parts for lb in p.lookback_dead], dtype=torch.bool
        ).reshape(-1, n - 1),
        slot_mapping=torch.tensor(
            [s for _, p in parts for s in p.slot_mapping] + [-1] * pads, dtype=torch.int64
        ),
        block_table=torch.from_numpy(table),
        request_slots=torch.tensor(
            [s for _, p in parts for s in p.request_slots], dtype=torch.int32
        ),
    )
    got = hasher(batch.to(device), history).cpu().numpy().astype(np.int64)
    want = one_shot_rows([e for _, p in parts for e in p.expected], consts)
    real_at = pad_at = 0
    want_at = 0
    for engine, part in parts:
        n_real, n_pad = len(part.ids), len(part.pad_ids)
        mine = np.concatenate(
            [got[real_at : real_at + n_real], got[owned + pad_at : owned + pad_at + n_pad]]
        )
        engine.finish(part, mine, want[want_at : want_at + n_real + n_pad])
        real_at, pad_at, want_at = real_at + n_real, pad_at + n_pad, want_at + n_real + n_pad


def run_schedules(
    seeds: Sequence[int],
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
) -> list[Engine]:
    """Run the schedules of ``seeds`` at once, one hasher call per step for all of them.

    Engine k owns KV blocks ``[k*NUM_BLOCKS, (k+1)*NUM_BLOCKS)`` of one shared
    :class:`SlotHashCache` and request-history slots
    ``[k*HISTORY_SLOTS, (k+1)*HISTORY_SLOTS)`` of one shared
    :class:`RequestHistory`; every step, each engine that has not finished
    adds its batch's requests to one combined batch. A schedule's draws
    depend only on its seed, so it runs the same steps alone (as
    :func:`run_schedule` does); its rows are compared with
    :func:`one_shot_rows`. Returns the engines in ``seeds`` order, each with
    its ``mismatches``. See :func:`run_schedule` for the other arguments.
    """
    device = torch.device(device)
    if hasher is None:
        hasher = NgramHasher(consts, token_map, device, backend=backend, check_ids=True)
    count = len(seeds)
    cache = SlotHashCache(max(count, 1) * NUM_BLOCKS * BLOCK_SIZE, BLOCK_SIZE, device)
    history = RequestHistory(
        max(count, 1) * HISTORY_SLOTS,
        consts.max_ngram_size,
        window=consts.max_ngram_size - 1 + 6,
        device=device,
    )
    engines = [
        Engine(
            np.random.default_rng(seed),
            consts,
            token_map.map,
            mode,
            drop_lookback=drop_lookback,
            device=device,
            cache=cache,
            history=history,
            block_offset=k * NUM_BLOCKS,
            slot_offset=k * HISTORY_SLOTS,
        )
        for k, seed in enumerate(seeds)
    ]
    store = {"lookback": None, "slot": cache, "request": history}[mode]
    live = [(engine, _schedule(engine, max_steps, sabotage)) for engine in engines]
    while live:
        parts, still = [], []
        for engine, steps in live:
            part = next(steps, None)
            if part is not None:
                parts.append((engine, part))
                still.append((engine, steps))
        if parts:
            _hash_step(parts, hasher, store, consts, device)
        live = still
    return engines


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
    return run_schedules(
        [seed],
        mode,
        backend,
        consts,
        token_map,
        max_steps=max_steps,
        device=device,
        drop_lookback=drop_lookback,
        sabotage=sabotage,
        hasher=hasher,
    )[0]
