"""Replays: simulated engine steps through the adapters into a hasher or a runtime, checked.

:class:`Replay` runs one or more seeded schedules (each a
:class:`~engramrt.testing.scheduler.Scheduler` driven by a
:class:`~engramrt.testing.policy.RandomSchedule`) as one engine: every step,
each schedule's chunks become requests of one vLLM runner step (or, for one
schedule, an SGLang forward batch), go through the engine's adapter into a
:class:`~engramrt.hashing.HashBatch`, and from there into an
:class:`~engramrt.hashing.NgramHasher` or an
:class:`~engramrt.runtime.EngramRuntime` (``plan`` then ``run`` of every
layer). Each schedule's rows are checked against things the adapters and
the runtime did not compute:

- row ids: :func:`~engramrt.testing.oneshot.one_shot_rows` of each
  request's sequence as the engine knows it; a padding row is the hash of
  its lone token (SPEC §5);
- the slot cache (``"slot"`` history): after the step, every computed
  position of every live request holds its token's compressed id (or DEAD),
  so padding never wrote over a live request's history;
- rows (through a runtime): the eager reference lookup
  (:func:`~engramrt.lookup.lookup_rows_reference`) of the expected ids over
  a copy of each store's packed table taken before the replay.

History modes (SPEC §5): ``"lookback"`` (every chunk carries its N-1
lookback ids), ``"slot"`` (a :class:`~engramrt.hashing.SlotHashCache` over
the KV slots; lookback ids only in the first chunk after a prefill/decode
hand-off) and ``"request"`` (a :class:`~engramrt.hashing.RequestHistory`
ring per request row: reset when a request starts, seeded when it starts
past position 0, rolled back after its drafts are verified).

A schedule draws every step from its own seed, so it runs the same steps
alone as beside others; schedule k owns KV blocks and rows of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engramrt.adapters import from_vllm_step, sglang_slot_cache, vllm_slot_cache
from engramrt.errors import ValidationError, check_choice
from engramrt.hashing import DEAD, HashBatch, HashConstants, NgramHasher, RequestHistory
from engramrt.testing.engines import (
    EngineView,
    SglangView,
    VllmView,
    adapt,
    lookback_of,
    seed_started,
    sglang_adapter,
)
from engramrt.testing.oneshot import one_shot_rows
from engramrt.testing.policy import MAX_DRAFTS, RandomSchedule
from engramrt.testing.scheduler import Scheduler, Step

__all__ = ["MODES", "SABOTAGES", "Replay", "Schedule", "run_schedules"]

MODES = ("lookback", "slot", "request")
"""History modes of SPEC §5 a replay can run through."""
SABOTAGES = ("drop_lookback", "rebind", "reset", "skip_rollback")
"""Ways to lose history on purpose, for negative controls: lookback ids all -1;
the slot cache rebound (emptied) at step 2; every live request's ring reset at
step 2; rejected drafts kept as if accepted (the engine skips its rollback)."""

MAX_LEN = 40
"""The longest a simulated request grows."""
MAX_REQUESTS = 8
MAX_TOKENS = 64


@dataclass
class Schedule:
    """One seeded schedule of a replay and its verdict.

    Attributes:
        seed: its seed.
        scheduler, policy: its scheduler and random policy.
        mismatches: every failing check, ``"step S: ..."``.
        steps: steps run.
    """

    seed: int
    scheduler: Scheduler
    policy: RandomSchedule
    mismatches: list[str] = field(default_factory=list)
    steps: int = 0

    @property
    def events(self) -> Counter[str]:
        """Engine states the schedule reached (prefix hits, preemptions, padding, ...)."""
        return self.scheduler.events


class Replay:
    """Seeded schedules run as one engine, each step checked (see the module docstring).

    Args:
        seeds: one schedule per seed.
        consts: the hash constants of the model's layout.
        token_map: the :class:`~engramrt.tokenmap.TokenMap` (its ``map`` is used
            for the expected rows).
        engine: ``"vllm"`` or ``"sglang"`` (one schedule only).
        mode: the history mode (:data:`MODES`).
        hasher: the hasher of ``consts`` (None: a reference hasher on
            ``device`` that checks every batch). Used when ``runtime`` is None.
        runtime: None, or a callable ``runtime(history) -> EngramRuntime`` whose
            runtime uses ``history`` (built here for ``mode``) and whose
            sources keep ``gather_packed`` (their tables are copied first).
        adapter: replaces the engine's adapter (negative controls).
        device: where the batches live.
        block_size, pad_slot_id, worst_padding: the vLLM runner's KV block
            size, pad slot and worst-case padding (always padded, padded
            requests owning padding tokens, whole stale buffers).
        sabotage: one of :data:`SABOTAGES`, or None.
        validate_steps: run the adapter's validation of every engine step.
        check_cache: check the slot cache after every step (``"slot"`` mode).
        handoff: schedules may hold requests prefilled elsewhere.
        graph_padding: pad steps to captured graph sizes (see
            :class:`~engramrt.testing.policy.RandomSchedule`).
    """

    def __init__(
        self,
        seeds: Sequence[int],
        consts: HashConstants,
        token_map: Any,
        *,
        engine: str = "vllm",
        mode: str = "slot",
        hasher: NgramHasher | None = None,
        runtime: Callable[[Any], Any] | None = None,
        adapter: Callable[..., HashBatch] | None = None,
        device: torch.device | str = "cpu",
        block_size: int = 4,
        pad_slot_id: int = -1,
        worst_padding: bool = False,
        sabotage: str | None = None,
        validate_steps: bool = True,
        check_cache: bool = True,
        handoff: bool = True,
        graph_padding: bool = True,
    ) -> None:
        if engine not in ("vllm", "sglang"):
            raise ValidationError(f"engine={engine!r}; expected 'vllm' or 'sglang'")
        check_choice("mode", mode, MODES)
        if sabotage is not None and sabotage not in SABOTAGES:
            raise ValidationError(f"sabotage={sabotage!r}; expected one of {SABOTAGES}")
        if engine == "sglang" and len(seeds) != 1:
            raise ValidationError(f"an SGLang replay runs one schedule; got {len(seeds)} seeds")
        if engine == "sglang" and mode == "request":
            raise ValidationError(
                "mode='request' with engine='sglang': the SGLang adapter rebases positions, "
                "which a RequestHistory tags entries with; expected 'slot' or 'lookback'"
            )
        self.consts = consts
        self.token_map = np.asarray(token_map.map)
        self.n = consts.max_ngram_size
        self.engine, self.mode, self.sabotage = engine, mode, sabotage
        self.device = torch.device(device)
        self.check_cache = check_cache and mode == "slot"
        self.validate_steps = validate_steps
        if engine == "sglang":
            block_size = 1  # one KV slot per token
        self.block_size = block_size
        count = max(len(seeds), 1)
        max_blocks = -(-(MAX_LEN + MAX_DRAFTS + 1) // block_size)
        num_blocks = MAX_REQUESTS * max_blocks + 1  # per schedule, its null block included
        num_slots = count * num_blocks * block_size
        vocab = int(self.token_map.shape[0])
        self.schedules = []
        for k, seed in enumerate(seeds):
            rng = np.random.default_rng(seed)
            scheduler = Scheduler(
                block_size=block_size,
                num_blocks=num_blocks,
                max_requests=MAX_REQUESTS,
                max_len=MAX_LEN,
                rng=rng,
                block_offset=k * num_blocks,
                row_offset=k * MAX_REQUESTS,
            )
            policy = RandomSchedule(
                scheduler,
                rng,
                vocab,
                style=engine,
                handoff=handoff,
                always_pad=worst_padding,
                graph_padding=graph_padding,
                max_tokens=MAX_TOKENS,
                max_requests=MAX_REQUESTS,
            )
            self.schedules.append(Schedule(seed, scheduler, policy))
        view_rng = np.random.default_rng([*seeds, 1]) if seeds else np.random.default_rng(1)
        self.view: EngineView
        if engine == "vllm":
            self.view = VllmView(
                view_rng,
                vocab,
                max_tokens=count * MAX_TOKENS,
                max_requests=count * MAX_REQUESTS,
                max_blocks=max_blocks,
                num_slots=num_slots,
                block_size=block_size,
                pad_slot_id=pad_slot_id,
                worst_padding=worst_padding,
            )
            self.adapter = adapter or from_vllm_step
        else:
            self.view = SglangView(
                view_rng,
                max_requests=MAX_REQUESTS,
                max_context=MAX_LEN + MAX_DRAFTS + 8,
                num_slots=num_slots,
            )
            self.adapter = adapter or sglang_adapter(consts)
        self.history: Any = None
        if mode == "slot":
            self.history = (
                vllm_slot_cache(num_slots // block_size, block_size, self.device)
                if engine == "vllm"
                else sglang_slot_cache(num_slots, self.device)
            )
        elif mode == "request":
            self.history = RequestHistory(
                count * MAX_REQUESTS, self.n, window=self.n - 1 + MAX_DRAFTS + 3, device=self.device
            )
        self.runtime = runtime(self.history) if runtime is not None else None
        self.hasher = hasher
        if self.runtime is None and hasher is None:
            self.hasher = NgramHasher(consts, token_map, self.device, check_ids=True)
        self.tables: list[tuple[torch.Tensor, int]] = []
        if self.runtime is not None:
            for source in self.runtime.sources:
                table = getattr(source, "backing", source)  # a cache's table is behind it
                every = torch.arange(table.num_rows, dtype=torch.int64, device=table.device)
                self.tables.append((table.gather_packed(every).cpu().clone(), table.row_begin))

    # -- a replay --------------------------------------------------------------

    def run(self, max_steps: int) -> Replay:
        """Run ``max_steps`` steps of every schedule, then one empty step."""
        for index in range(max_steps + 1):
            steps = [
                s.policy.next_step() if index < max_steps else Step(index, [])
                for s in self.schedules
            ]
            self.step(steps)
        return self

    def step(self, steps: list[Step]) -> None:
        """Run one engine step made of each schedule's ``steps[k]``, check it, advance."""
        for schedule in self.schedules:
            self._start_requests(schedule)
        if self.sabotage in ("rebind", "reset") and steps and steps[0].index == 2:
            self._lose_history()
        lookback = self._lookback(steps)
        engine_step = self.view.express(steps, lookback, self.device)
        if self.mode == "slot":
            engine_step["cache"] = self.history
        if not self.validate_steps:
            engine_step["validate"] = False
        rows = self.view.pool_rows(steps) if self.mode == "request" else None
        want = one_shot_rows(self._sequences(steps), self.consts)
        try:
            batch = adapt(self.adapter, engine_step, request_slots=rows)
            got, got_rows = self._hash(batch)
        except ValidationError as exc:
            for schedule in self.schedules:
                schedule.mismatches.append(f"step {steps[0].index}: {exc}")
            got, got_rows = None, None
        if got is not None:
            self._compare(steps, got, want, got_rows)
        for schedule, step in zip(self.schedules, steps, strict=True):
            verified = schedule.policy.advance(step)
            if self.sabotage == "skip_rollback":
                self._skip_rollback(schedule, step)
            elif verified and isinstance(self.history, RequestHistory):
                rows_kept = [(r.row, kept) for r, kept in verified]
                if len(rows_kept) == 1:
                    self.history.rollback(*rows_kept[0])
                else:
                    self.history.rollback_many([r for r, _ in rows_kept], [k for _, k in rows_kept])
            if step.chunks:
                events = schedule.scheduler.events
                events["requests in one step"] += len(step.chunks) > 1
                events["padded tokens"] += bool(step.pad_tokens)
                events["padded requests"] += step.pad_requests > 0
                events[f"{step.kind} step"] += 1
            schedule.steps += 1
        if self.check_cache:
            self._check_cache(steps)

    def _start_requests(self, schedule: Schedule) -> None:
        """A request's ring is reset when it (re)starts, and seeded when it starts past 0."""
        started, schedule.scheduler.started = schedule.scheduler.started, []
        seed_started(self.history, started, self.token_map, self.n - 1)

    def _lose_history(self) -> None:
        if self.sabotage == "rebind" and self.mode == "slot":
            self.history.bind(self.history.num_slots, self.history.block_size)
        if self.sabotage == "reset" and isinstance(self.history, RequestHistory):
            for schedule in self.schedules:
                for request in schedule.scheduler.live:
                    self.history.reset(request.row)

    def _skip_rollback(self, schedule: Schedule, step: Step) -> None:
        for chunk in step.chunks:
            request = chunk.request
            if chunk.drafts and request.computed < chunk.end:
                request.computed = min(chunk.end, len(request.tokens))
                schedule.scheduler.ensure_blocks(request, request.computed)

    def _lookback(self, steps: list[Step]) -> tuple[np.ndarray, np.ndarray] | None:
        if self.mode == "request":
            return None
        width = self.n - 1
        none = ([-1] * width, [False] * width)
        rows = []
        for step in steps:
            for chunk in step.chunks:
                wanted = self.mode == "lookback" or chunk.lookback
                if wanted and self.sabotage != "drop_lookback":
                    rows.append(lookback_of(chunk.request, chunk.start, width))
                else:
                    rows.append(none)
        rows += [none] * sum(s.pad_requests for s in steps)
        if self.mode == "slot" and all(ids[0] == -1 for ids, _ in rows):
            return None  # nothing to seed this step: the runner passes no lookback
        ids = np.array([i for i, _ in rows], dtype=np.int64).reshape(len(rows), width)
        dead = np.array([d for _, d in rows], dtype=bool).reshape(len(rows), width)
        return ids, dead

    def _sequences(self, steps: list[Step]) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
        """What :func:`one_shot_rows` hashes, schedule by schedule: its chunks, then its
        padding rows."""
        tm, out = self.token_map, []
        no_dead = np.zeros(1, dtype=bool)
        for step in steps:
            for c in step.chunks:
                req = c.request
                ids = tm[np.asarray(req.tokens[: c.end], dtype=np.int64)]
                out.append((ids, np.asarray(req.dead[: c.end], dtype=bool), c.start, c.end))
            for token in step.pad_tokens:
                out.append((tm[np.array([token], dtype=np.int64)], no_dead, 0, 1))
        return out

    def _hash(self, batch: HashBatch) -> tuple[np.ndarray, list[torch.Tensor] | None]:
        """Row ids ``[T, L, C]`` (and, through a runtime, every layer's rows)."""
        if self.runtime is None:
            assert self.hasher is not None
            return self.hasher(batch, self.history).cpu().numpy().astype(np.int64), None
        runtime = self.runtime
        plan = runtime.plan(batch)
        rows = [plan.rows(layer).cpu().clone() for layer in range(len(runtime.sources))]
        if runtime.heads:  # the blocks' side: every layer runs once per step
            head = runtime.heads[0]
            hidden = torch.randn(plan.num_tokens, head.hc_mult, head.hidden_size)
            hidden = hidden.bfloat16().to(runtime.device)
            for layer in range(len(runtime.heads)):
                hidden = runtime.run(layer, hidden).clone()
        return plan.row_ids.to(torch.int64).cpu().numpy(), rows

    def _compare(
        self,
        steps: list[Step],
        got: np.ndarray,
        want: np.ndarray,
        got_rows: list[torch.Tensor] | None,
    ) -> None:
        """Split the step's rows by schedule (its tokens, then its padding rows) and compare."""
        from engramrt.lookup import lookup_rows_reference

        want_rows = None
        if got_rows is not None:
            e = got_rows[0].shape[-1] if got_rows else 0
            want_rows = [
                lookup_rows_reference(torch.from_numpy(want[:, li]) - begin, packed, e)
                for li, (packed, begin) in enumerate(self.tables)
            ]
        owned = sum(s.num_tokens for s in steps)
        real_at, pad_at, want_at = 0, owned, 0
        if got.shape != want.shape:
            for schedule, step in zip(self.schedules, steps, strict=True):
                schedule.mismatches.append(
                    f"step {step.index}: row ids of shape {list(got.shape)}, expected "
                    f"{list(want.shape)}"
                )
            return
        for schedule, step in zip(self.schedules, steps, strict=True):
            n_real, n_pad = step.num_tokens, len(step.pad_tokens)
            expected = want[want_at : want_at + n_real + n_pad]
            where = f"step {step.index}"
            real, pads = slice(real_at, real_at + n_real), slice(pad_at, pad_at + n_pad)
            mine = np.concatenate([got[real], got[pads]])
            if not np.array_equal(mine, expected):
                bad = np.argwhere(mine != expected)[:3].tolist()
                schedule.mismatches.append(f"{where}: first mismatches at {bad}")
            elif want_rows is not None and got_rows is not None:
                for li, (rows, ref) in enumerate(zip(got_rows, want_rows, strict=True)):
                    mine_rows = torch.cat([rows[real], rows[pads]]).view(torch.int16)
                    theirs = ref[want_at : want_at + n_real + n_pad].view(torch.int16)
                    if not torch.equal(mine_rows, theirs):
                        schedule.mismatches.append(f"{where}: rows of layer {li} differ")
                        break
            real_at, pad_at, want_at = real_at + n_real, pad_at + n_pad, want_at + n_real + n_pad

    def _check_cache(self, steps: list[Step]) -> None:
        slots = self.history.slots.cpu().numpy()
        n = self.n
        for schedule, step in zip(self.schedules, steps, strict=True):
            sched = schedule.scheduler
            for request in sched.live:
                if request.remote and request.computed <= request.remote:
                    continue  # its lookback ids have not reached the cache yet
                first = max(0, request.remote - (n - 1)) if request.remote else 0
                for pos in range(first, request.computed):
                    code = DEAD if request.dead[pos] else int(self.token_map[request.tokens[pos]])
                    slot = sched.slot_of(request, pos)
                    if int(slots[slot]) != code:
                        schedule.mismatches.append(
                            f"step {step.index}: slot {slot} (position {pos}) holds "
                            f"{int(slots[slot])}, expected {code}"
                        )
                        break


def run_schedules(
    seeds: Sequence[int],
    mode: str,
    backend: str,
    consts: HashConstants,
    token_map: Any,
    *,
    max_steps: int = 12,
    device: torch.device | str = "cpu",
    sabotage: str | None = None,
    hasher: NgramHasher | None = None,
) -> list[Schedule]:
    """Run the schedules of ``seeds`` as one vLLM engine, one hasher call per step for all.

    Each step, every schedule's requests join one runner step (schedule k's
    blocks and rows are its own), one adapter call, one hash launch; a
    schedule's draws depend only on its seed, so ``run_schedules([seed], ...)[0]``
    runs the same steps alone. ``hasher``: one to reuse (it keeps no state between
    calls), built for ``consts``, ``backend`` and ``device``; None builds one
    that checks every batch. Returns the schedules in ``seeds`` order.
    """
    if hasher is None:
        hasher = NgramHasher(consts, token_map, device, backend=backend, check_ids=True)
    # The hasher checks every batch (check_ids); the adapter's own validation runs in
    # the replays of tests/adapters. Each padding row costs a reference hash: a few.
    replay = Replay(
        seeds,
        consts,
        token_map,
        mode=mode,
        hasher=hasher,
        device=device,
        sabotage=sabotage,
        validate_steps=False,
        check_cache=False,
        graph_padding=False,
    )
    return replay.run(max_steps).schedules
