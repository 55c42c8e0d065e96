"""Simulated serving engines that hold a step's metadata in their own shapes.

:class:`VllmRunner` keeps a vLLM-style V1 model runner's persistent buffers
(``input_ids``, ``positions``, ``query_start_loc``, ``slot_mapping``, a
block table) with stale contents past the live rows, pads steps for CUDA
graphs and allocates KV blocks with prefix caching, speculative drafts,
preemption and block reuse. :class:`SglangRunner` keeps an SGLang-style
request-to-token pool and token-slot KV pool, and builds forward batches
(extend, mixed, decode, chain-draft verify) padded as its CUDA-graph runner
pads them.

Each step goes through an adapter (engine tensors -> HashBatch), is hashed
with a :class:`SlotHashCache`, and is checked against two things the
adapters did not compute:

- rows: every row id equals one-shot hashing of the request's sequence as
  the engine knows it (``hash_sequence``); a padding row equals the hash of
  its lone token (SPEC §5);
- cache: after the step, the slot of every accepted position of every live
  request holds that token's compressed id (or DEAD): padding never wrote
  over a live request's history.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engramrt.adapters import (
    from_sglang_batch,
    from_vllm_step,
    sglang_slot_cache,
    vllm_slot_cache,
)
from engramrt.errors import ValidationError
from engramrt.hashing import DEAD, HashBatch, HashConstants, NgramHasher, hash_sequence

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # token counts of captured graphs
REQUEST_CAPTURE_SIZES = (1, 4, 8)  # request counts of captured graphs
MAX_LEN = 40  # longest sequence a request reaches


@dataclass
class Request:
    tokens: list[int]  # what the engine knows: accepted tokens, then current drafts
    dead: list[bool]
    computed: int = 0  # accepted positions whose KV (and history) is written
    blocks: list[int] = field(default_factory=list)  # vLLM: KV blocks
    slots: list[int] = field(default_factory=list)  # SGLang: KV slot per position
    pool_row: int = -1  # SGLang: row of req_to_token
    saved: tuple[list[int], list[bool]] | None = None  # continuation hidden by drafts

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.computed


def _capture_size(n: int, limit: int, sizes: tuple[int, ...] = CAPTURE_SIZES) -> int:
    return min([c for c in sizes if c >= n] + [limit])


class _Engine:
    """What both simulated engines share: requests, drafts, checks."""

    # The engine's adapter; tests may pass a deliberately wrong one instead.
    real_adapter: Callable[..., HashBatch]

    def __init__(
        self,
        rng: np.random.Generator,
        consts: HashConstants,
        token_map: np.ndarray,
        hasher: NgramHasher,
        adapter: Callable[..., HashBatch] | None = None,
        dead_rate: float = 0.0,
    ) -> None:
        self.rng = rng
        self.consts = consts
        self.token_map = token_map
        self.hasher = hasher
        self.adapter = adapter or self.real_adapter
        self.dead_rate = dead_rate
        self.vocab = int(token_map.shape[0])
        self.device = hasher.device
        self.live: list[Request] = []
        self.row_mismatches: list[str] = []
        self.cache_mismatches: list[str] = []
        self.steps = 0
        self.events: Counter[str] = Counter()  # engine states the schedule reached

    def random_tokens(self, count: int) -> tuple[list[int], list[bool]]:
        tokens = self.rng.integers(0, self.vocab, size=count).tolist()
        dead = (self.rng.random(count) < self.dead_rate).tolist()
        return tokens, dead

    # Speculative drafts ----------------------------------------------------
    def draft(self, req: Request, drafts: int) -> int:
        """Put ``drafts`` draft tokens after the next real token; return the chunk length."""
        start = req.computed
        req.saved = (req.tokens[start + 1 :], req.dead[start + 1 :])
        tokens, _ = self.random_tokens(drafts)
        req.tokens = req.tokens[: start + 1] + tokens
        req.dead = req.dead[: start + 1] + [False] * drafts
        return drafts + 1

    def accept(self, req: Request, start: int, accepted: int) -> None:
        """Keep ``accepted`` drafts, then the real continuation."""
        assert req.saved is not None
        drafts = len(req.tokens) - (start + 1)
        keep = start + 1 + accepted
        rest_tokens, rest_dead = req.saved
        req.tokens = (req.tokens[:keep] + rest_tokens)[:MAX_LEN]
        req.dead = (req.dead[:keep] + rest_dead)[:MAX_LEN]
        # Drafts accepted past MAX_LEN are cut like rejected ones (their slots
        # are given back by the caller): the request ends at MAX_LEN.
        req.computed = min(keep, len(req.tokens))
        req.saved = None
        if accepted < drafts:
            self.events["drafts rejected"] += 1

    # Checks ------------------------------------------------------------------
    def expected_rows(self, chunks: list[tuple[Request, int, int]], pad_ids: list[int]):
        parts = []
        for req, start, count in chunks:
            full = hash_sequence(
                self.token_map[np.array(req.tokens[: start + count], dtype=np.int64)],
                self.consts,
                np.array(req.dead[: start + count], dtype=bool),
            )
            parts.append(full[start:])
        for tok in pad_ids:
            parts.append(
                hash_sequence(self.token_map[np.array([tok], dtype=np.int64)], self.consts)
            )
        shape = (0, self.consts.n_layers, self.consts.n_cols)
        return np.concatenate(parts) if parts else np.zeros(shape, dtype=np.int64)

    def hash_and_compare(self, engine_step: dict, want: np.ndarray) -> None:
        try:
            batch = self.adapter(**engine_step)
            got = self.hasher(batch, self.cache).cpu().numpy().astype(np.int64)
        except ValidationError as exc:
            self.row_mismatches.append(f"step {self.steps}: {exc}")
            return
        if got.shape != want.shape or not np.array_equal(got, want):
            bad = np.argwhere(got != want)[:3].tolist() if got.shape == want.shape else got.shape
            self.row_mismatches.append(f"step {self.steps}: rows differ at {bad}")

    def slot_of(self, req: Request, pos: int) -> int:
        raise NotImplementedError

    def check_cache(self) -> None:
        slots = self.cache.slots.cpu().numpy()
        for req in self.live:
            for pos in range(req.computed):
                code = DEAD if req.dead[pos] else int(self.token_map[req.tokens[pos]])
                slot = self.slot_of(req, pos)
                if int(slots[slot]) != code:
                    self.cache_mismatches.append(
                        f"step {self.steps}: slot {slot} (position {pos}) holds "
                        f"{int(slots[slot])}, expected {code}"
                    )
                    return

    @property
    def mismatches(self) -> list[str]:
        return self.row_mismatches + self.cache_mismatches


# vLLM-style V1 runner -----------------------------------------------------------


class VllmRunner(_Engine):
    """Persistent buffers, CUDA-graph padding and a paged KV cache with prefix caching."""

    MAX_TOKENS = 64
    MAX_REQS = 8
    real_adapter = staticmethod(from_vllm_step)

    def __init__(
        self,
        *args,
        block_size: int = 4,
        pad_slot_id: int = -1,
        worst_padding: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.block_size = block_size
        self.pad_slot_id = pad_slot_id
        # Every step padded, padded requests owning padding tokens, whole stale buffers passed.
        self.worst_padding = worst_padding
        self.max_blocks = -(-(MAX_LEN + 4) // block_size)  # drafts reach past MAX_LEN
        self.num_blocks = self.MAX_REQS * self.max_blocks + 1
        self.cache = vllm_slot_cache(self.num_blocks, block_size, self.device)
        # Block 0 is the null block: never handed to a request.
        self.free_blocks = list(range(1, self.num_blocks))
        self.block_refs = [0] * self.num_blocks
        self.block_gen = [0] * self.num_blocks
        self.cached: list[tuple[Request, list[int], list[int]]] = []  # (req, blocks, gens)
        rng = self.rng
        # Persistent buffers with stale contents, as a runner holds them.
        self.input_ids = torch.from_numpy(rng.integers(0, self.vocab, self.MAX_TOKENS))
        self.positions = torch.from_numpy(rng.integers(0, MAX_LEN, self.MAX_TOKENS))
        self.qsl = torch.from_numpy(rng.integers(0, 50, self.MAX_REQS + 1).astype(np.int32))
        self.slot_mapping = torch.from_numpy(
            rng.integers(0, self.num_blocks * block_size, self.MAX_TOKENS)
        )
        self.block_table = torch.from_numpy(
            rng.integers(0, self.num_blocks, (self.MAX_REQS, self.max_blocks)).astype(np.int32)
        )

    def slot_of(self, req: Request, pos: int) -> int:
        return req.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    # Blocks ------------------------------------------------------------------
    def _take_block(self) -> int:
        block = self.free_blocks.pop(int(self.rng.integers(len(self.free_blocks))))
        if self.block_gen[block]:
            self.events["block reused"] += 1
        self.block_refs[block] += 1
        self.block_gen[block] += 1
        return block

    def _ensure_blocks(self, req: Request, upto: int) -> None:
        while len(req.blocks) * self.block_size < upto:
            req.blocks.append(self._take_block())

    def _release(self, req: Request) -> None:
        for block in req.blocks:
            self.block_refs[block] -= 1
            if self.block_refs[block] == 0:
                self.free_blocks.append(block)
        req.blocks = []

    def add_request(self) -> None:
        if len(self.live) >= self.MAX_REQS:
            return
        length = int(self.rng.integers(1, 30))
        tokens, dead = self.random_tokens(length)
        req = Request(tokens, dead)
        donors = [(r, r.blocks) for r in self.live if r.computed >= self.block_size] + [
            (r, blocks)
            for r, blocks, gens in self.cached
            if gens == [self.block_gen[b] for b in blocks] and r.computed >= self.block_size
        ]
        if donors and self.rng.random() < 0.6:
            # Prefix-cache hit: the first full blocks are another request's.
            donor, donor_blocks = donors[int(self.rng.integers(len(donors)))]
            self.events[
                "prefix hit" if donor in self.live else "prefix hit on a finished request"
            ] += 1
            shared = int(self.rng.integers(1, donor.computed // self.block_size + 1))
            n_tok = shared * self.block_size
            req.tokens[:n_tok] = donor.tokens[:n_tok]
            req.dead[:n_tok] = donor.dead[:n_tok]
            if self.rng.random() < 0.3:  # the prompt is exactly the cached prefix
                req.tokens, req.dead = req.tokens[:n_tok], req.dead[:n_tok]
            req.tokens, req.dead = req.tokens[:MAX_LEN], req.dead[:MAX_LEN]
            for block in donor_blocks[:shared]:
                if self.block_refs[block] == 0:  # a cached block of a finished request
                    self.free_blocks.remove(block)
                self.block_refs[block] += 1
            req.blocks = list(donor_blocks[:shared])
            # A hit on the whole prompt recomputes its last token (into a shared block).
            req.computed = min(n_tok, len(req.tokens) - 1)
            if req.computed < n_tok:
                self.events["whole prompt hit"] += 1
        self.live.append(req)

    def finish_or_preempt(self) -> None:
        for req in list(self.live):
            if req.remaining == 0:
                self.live.remove(req)
                blocks = list(req.blocks)
                self.cached.append((req, blocks, [self.block_gen[b] for b in blocks]))
                self._release(req)
        if self.live and self.rng.random() < 0.1:  # preempted: recomputed from scratch later
            req = self.live[int(self.rng.integers(len(self.live)))]
            self._release(req)
            req.computed = 0
            self.events["preempted"] += 1

    # One step ------------------------------------------------------------------
    def step(self, plan: list[tuple[Request, int, int]], pad: bool, pad_requests: bool) -> None:
        """``plan``: (request, tokens, drafts) in persistent-batch order."""
        bs = self.block_size
        chunks = []
        qsl = [0]
        ids, positions, slots, dead = [], [], [], []
        for row, (req, count, _drafts) in enumerate(plan):
            start = req.computed
            self._ensure_blocks(req, start + count)
            chunks.append((req, start, count))
            ids += req.tokens[start : start + count]
            dead += req.dead[start : start + count]
            positions += list(range(start, start + count))
            slots += [self.slot_of(req, p) for p in range(start, start + count)]
            qsl.append(qsl[-1] + count)
            self.block_table[row, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        num_tokens, num_reqs = qsl[-1], len(plan)
        t_pad = _capture_size(num_tokens, self.MAX_TOKENS) if pad else num_tokens
        r_pad = (
            _capture_size(num_reqs, self.MAX_REQS, REQUEST_CAPTURE_SIZES)
            if pad_requests
            else num_reqs
        )
        self.input_ids[:num_tokens] = torch.tensor(ids, dtype=torch.int64)
        self.positions[:num_tokens] = torch.tensor(positions, dtype=torch.int64)
        self.slot_mapping[:num_tokens] = torch.tensor(slots, dtype=torch.int64)
        self.slot_mapping[num_tokens:t_pad] = self.pad_slot_id
        self.qsl[: num_reqs + 1] = torch.tensor(qsl, dtype=torch.int32)
        if not self.worst_padding and self.rng.random() < 0.5:
            # Padded requests repeat the last boundary.
            self.qsl[num_reqs + 1 : r_pad + 1] = num_tokens
        else:  # or own one padding token each, as a uniform-decode graph pads them
            trailing = num_tokens + torch.arange(1, r_pad - num_reqs + 1, dtype=torch.int32)
            self.qsl[num_reqs + 1 : r_pad + 1] = trailing.clamp(max=t_pad)
        dead_mask = torch.zeros(t_pad, dtype=torch.bool)
        dead_mask[:num_tokens] = torch.tensor(dead, dtype=torch.bool)
        # Engines hand over either the whole slot mapping buffer or its live part.
        whole = self.worst_padding or self.rng.random() < 0.5
        slot_len = self.MAX_TOKENS if whole else num_tokens
        whole = self.worst_padding or self.rng.random() < 0.5
        table_rows = self.MAX_REQS if whole else num_reqs
        engine_step = {
            "input_ids": self.input_ids[:t_pad].to(self.device),
            "positions": self.positions[:t_pad].to(self.device),
            "query_start_loc": self.qsl[: r_pad + 1].to(self.device),
            "slot_mapping": self.slot_mapping[:slot_len].to(self.device),
            "block_table": self.block_table[:table_rows].to(self.device),
            "block_size": bs,
            "num_actual_tokens": num_tokens,
            "num_reqs": num_reqs,
            "pad_slot_id": self.pad_slot_id,
            "dead_mask": dead_mask.to(self.device),
            "cache": self.cache,
        }
        pad_ids = self.input_ids[num_tokens:t_pad].tolist()
        self.events["padded tokens"] += bool(pad_ids)
        self.events["padded requests"] += r_pad > num_reqs
        self.events["requests in one step"] += num_reqs > 1
        self.hash_and_compare(engine_step, self.expected_rows(chunks, pad_ids))
        for req, _count, drafts in plan:
            if drafts:
                self.accept(req, req.computed, int(self.rng.integers(0, drafts + 1)))
            else:
                req.computed += _count
        self.steps += 1
        self.check_cache()

    def run(self, max_steps: int) -> None:
        self.add_request()
        for _ in range(max_steps):
            while self.rng.random() < 0.4:
                self.add_request()
            self.finish_or_preempt()
            if not self.live:
                self.add_request()
            order = self.rng.permutation(len(self.live))[: int(self.rng.integers(1, 5))]
            plan, budget = [], 40
            for idx in order:
                req = self.live[int(idx)]
                if req.remaining >= 2 and req.computed and self.rng.random() < 0.35:
                    drafts = int(self.rng.integers(1, 4))
                    count = drafts + 1
                else:
                    drafts, count = 0, int(self.rng.integers(1, min(req.remaining, 9) + 1))
                if count > budget:
                    continue
                if drafts:
                    self.draft(req, drafts)
                plan.append((req, count, drafts))
                budget -= count
            pad = self.worst_padding or self.rng.random() < 0.6
            pad_requests = self.worst_padding or self.rng.random() < 0.4
            self.step(plan, pad=pad, pad_requests=pad_requests)


# SGLang-style forward batches ---------------------------------------------------


class SglangRunner(_Engine):
    """A request-to-token pool over a token-slot KV pool (slot 0 reserved for padding)."""

    MAX_REQS = 8
    NUM_SLOTS = 1 + 400
    real_adapter = staticmethod(from_sglang_batch)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cache = sglang_slot_cache(self.NUM_SLOTS, self.device)
        self.free_slots = list(range(1, self.NUM_SLOTS))
        self.slot_refs = [0] * self.NUM_SLOTS
        self.slot_gen = [0] * self.NUM_SLOTS
        self.free_rows = list(range(self.MAX_REQS))  # handed out lowest first
        self.cached: list[tuple[Request, list[int]]] = []
        self.req_to_token = torch.from_numpy(
            self.rng.integers(0, self.NUM_SLOTS, (self.MAX_REQS, MAX_LEN + 8)).astype(np.int32)
        )

    def slot_of(self, req: Request, pos: int) -> int:
        return req.slots[pos]

    def _take_slot(self) -> int:
        slot = self.free_slots.pop(int(self.rng.integers(len(self.free_slots))))
        if self.slot_gen[slot]:
            self.events["slot reused"] += 1
        self.slot_refs[slot] += 1
        self.slot_gen[slot] += 1
        return slot

    def _drop_slots(self, slots: list[int]) -> None:
        for slot in slots:
            self.slot_refs[slot] -= 1
            if self.slot_refs[slot] == 0:
                self.free_slots.append(slot)

    def add_request(self) -> None:
        if not self.free_rows:
            return
        length = int(self.rng.integers(1, 30))
        tokens, dead = self.random_tokens(length)
        req = Request(tokens, dead, pool_row=self.free_rows.pop(0))
        donors = [r for r in self.live if r.computed >= 1] + [
            r for r, gens in self.cached if gens == [self.slot_gen[s] for s in r.slots]
        ]
        if donors and self.rng.random() < 0.6:
            # Radix-cache hit of any length: the first slots are another request's.
            donor = donors[int(self.rng.integers(len(donors)))]
            self.events[
                "prefix hit" if donor in self.live else "prefix hit on a finished request"
            ] += 1
            hit = int(self.rng.integers(1, donor.computed + 1))
            req.tokens = (donor.tokens[:hit] + req.tokens)[:MAX_LEN]
            req.dead = (donor.dead[:hit] + req.dead)[:MAX_LEN]
            for slot in donor.slots[:hit]:
                if self.slot_refs[slot] == 0:
                    self.free_slots.remove(slot)
                self.slot_refs[slot] += 1
            req.slots = list(donor.slots[:hit])
            req.computed = min(hit, len(req.tokens) - 1)  # at least one token to extend
            self._drop_slots(req.slots[req.computed :])
            req.slots = req.slots[: req.computed]
            self.req_to_token[req.pool_row, : req.computed] = torch.tensor(
                req.slots, dtype=torch.int32
            )
        self.live.append(req)

    def finish(self) -> None:
        for req in list(self.live):
            if req.remaining == 0:
                self.live.remove(req)
                self.cached.append((req, [self.slot_gen[s] for s in req.slots]))
                self._drop_slots(req.slots)
                self.free_rows.append(req.pool_row)

    def _allocate(self, req: Request, count: int) -> None:
        new = [self._take_slot() for _ in range(count)]
        start = len(req.slots)
        req.slots += new
        self.req_to_token[req.pool_row, start : start + count] = torch.tensor(
            new, dtype=torch.int32
        )

    def step(self, plan: list[tuple[Request, int, int]], kind: str, pad: bool) -> None:
        """``kind``: "extend" (chunks of any length), "decode" or "verify" (drafts)."""
        chunks, ids, dead = [], [], []
        for req, count, _drafts in plan:
            start = req.computed
            assert len(req.slots) == start
            self._allocate(req, count)
            chunks.append((req, start, count))
            ids += req.tokens[start : start + count]
            dead += req.dead[start : start + count]
        num_reqs, num_tokens = len(plan), len(ids)
        per_req = plan[0][1] if kind != "extend" and plan else 1
        r_pad = (
            _capture_size(num_reqs, self.MAX_REQS, REQUEST_CAPTURE_SIZES)
            if pad and kind != "extend"
            else num_reqs
        )
        t_pad = (
            _capture_size(num_tokens, 64)
            if pad and kind == "extend"
            else max(num_tokens, r_pad * per_req)
        )
        extra = r_pad - num_reqs
        input_ids = torch.zeros(t_pad, dtype=torch.int64)  # padding rows hold 0
        input_ids[:num_tokens] = torch.tensor(ids, dtype=torch.int64)
        dead_mask = torch.zeros(t_pad, dtype=torch.bool)
        dead_mask[:num_tokens] = torch.tensor(dead, dtype=torch.bool)
        rows = [req.pool_row for req, _, _ in plan] + [0] * extra  # padded: row 0, length 1
        prefix = [start for _, start, _ in chunks]
        counts = [count for _, _, count in chunks]
        dev = self.device
        engine_step: dict = {
            "input_ids": input_ids.to(dev),
            "req_pool_indices": torch.tensor(rows, dtype=torch.int64, device=dev),
            "req_to_token": self.req_to_token.to(dev),
            "hasher": self.consts,
            "num_reqs": num_reqs,
            "num_actual_tokens": num_tokens,
            "dead_mask": dead_mask.to(dev),
            "cache": self.cache,
        }
        if kind == "decode":
            seq_lens = [s + 1 for s in prefix] + [1] * extra
            engine_step["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        else:
            lens = torch.tensor(counts + [per_req] * extra, dtype=torch.int32, device=dev)
            engine_step["extend_prefix_lens"] = torch.tensor(
                prefix + [1] * extra, dtype=torch.int32, device=dev
            )
            engine_step["extend_seq_lens"] = lens
            engine_step["seq_lens"] = torch.tensor(
                [s + c for s, c in zip(prefix, counts, strict=True)] + [1] * extra,
                dtype=torch.int64,
                device=dev,
            )
        pad_ids = [0] * (t_pad - num_tokens)
        self.events["padded tokens"] += bool(pad_ids)
        self.events["padded requests"] += extra > 0
        self.events["requests in one step"] += num_reqs > 1
        self.events[f"{kind} step"] += 1
        self.hash_and_compare(engine_step, self.expected_rows(chunks, pad_ids))
        for req, count, drafts in plan:
            if drafts:
                start = req.computed
                self.accept(req, start, int(self.rng.integers(0, drafts + 1)))
                # Rejected drafts give their slots back: another request may take them.
                self._drop_slots(req.slots[req.computed :])
                req.slots = req.slots[: req.computed]
            else:
                req.computed += count
        self.steps += 1
        self.check_cache()

    def run(self, max_steps: int) -> None:
        self.add_request()
        for _ in range(max_steps):
            while self.rng.random() < 0.4:
                self.add_request()
            self.finish()
            if not self.live:
                self.add_request()
            pick = self.rng.permutation(len(self.live))[: int(self.rng.integers(1, 5))]
            chosen = [self.live[int(i)] for i in pick]
            kind = str(self.rng.choice(["extend", "decode", "verify"]))
            if kind != "extend" and any(r.computed == 0 for r in chosen):
                kind = "extend"  # a request's first step is always an extend
            plan = []
            if kind == "extend":
                for req in chosen:
                    plan.append((req, int(self.rng.integers(1, min(req.remaining, 9) + 1)), 0))
            elif kind == "decode":
                plan = [(req, 1, 0) for req in chosen]
            else:
                drafts = int(self.rng.integers(1, 4))
                plan = [(req, self.draft(req, drafts), drafts) for req in chosen]
            self.step(plan, kind, pad=self.rng.random() < 0.6)
