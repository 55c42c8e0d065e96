"""Random engine steps drawn from a seed, over a :class:`~engramrt.testing.scheduler.Scheduler`.

Each step, as a continuous-batching engine runs: new requests arrive (some
repeat a prefix of an earlier request, live or finished, some repeat it
exactly, some were prefilled on another instance), finished requests leave,
one may be preempted; then up to four requests are scheduled, each with a
prefill chunk, a decode token or its next token plus speculative drafts, and
the step is padded for a captured CUDA graph. ``style`` picks the forward
modes: ``"vllm"`` mixes any chunks in one step; ``"sglang"`` makes each step
an extend, a decode (one token per request) or a verify (the same number of
drafts per request). Every draw comes from the schedule's own generator, so
a seed replays the same steps whatever else runs beside it.
"""

from __future__ import annotations

from engramrt.testing.scheduler import Chunk, Request, Scheduler, Step

__all__ = [
    "CAPTURE_SIZES",
    "REQUEST_CAPTURE_SIZES",
    "RandomSchedule",
    "capture_size",
]

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Token counts of the simulated engine's captured graphs."""
REQUEST_CAPTURE_SIZES = (1, 4, 8)
"""Request counts of the simulated engine's captured graphs."""
MAX_DRAFTS = 3


def capture_size(n: int, limit: int, sizes: tuple[int, ...] = CAPTURE_SIZES) -> int:
    """The smallest captured size ``>= n`` (``limit`` when none is)."""
    return min([c for c in sizes if c >= n] + [limit])


class RandomSchedule:
    """Random steps for ``scheduler`` drawn from ``rng``.

    Args:
        scheduler: the engine's scheduler (its ``max_len`` bounds requests).
        rng: the schedule's ``numpy.random.Generator``.
        vocab: tokenizer ids are drawn from ``[0, vocab)``.
        style: ``"vllm"`` or ``"sglang"`` (see the module docstring).
        dead_rate: the share of dead tokens; None draws 0, 0 or 0.1.
        handoff: requests may arrive prefilled elsewhere.
        always_pad: pad every step's tokens and requests.
        graph_padding: pad to the captured graph sizes (:data:`CAPTURE_SIZES`,
            :data:`REQUEST_CAPTURE_SIZES`); False: 0-2 padding rows and 0-1
            padded requests a step, as several schedules sharing one batch
            would pad (the soak hashes many at once: each padding row costs
            it a reference hash).
        max_tokens: the most tokens of a step, padding included.
        max_requests: the most requests of a step, padded ones included.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        rng,
        vocab: int,
        *,
        style: str = "vllm",
        dead_rate: float | None = None,
        handoff: bool = True,
        always_pad: bool = False,
        graph_padding: bool = True,
        max_tokens: int = 64,
        max_requests: int = 8,
    ) -> None:
        if style not in ("vllm", "sglang"):
            raise ValueError(f"style={style!r}; expected 'vllm' or 'sglang'")
        self.scheduler = scheduler
        self.rng = rng
        self.vocab = vocab
        self.style = style
        self.dead_rate = float(rng.choice([0.0, 0.0, 0.1])) if dead_rate is None else dead_rate
        self.handoff = handoff
        self.always_pad = always_pad
        self.graph_padding = graph_padding
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.steps = 0

    def random_tokens(self, count: int) -> tuple[list[int], list[bool]]:
        tokens = self.rng.integers(0, self.vocab, size=count).tolist()
        if not self.dead_rate:
            return tokens, [False] * count
        return tokens, (self.rng.random(count) < self.dead_rate).tolist()

    def add_request(self) -> Request | None:
        sched, rng, bs = self.scheduler, self.rng, self.scheduler.block_size
        length = int(rng.integers(1, 30))
        tokens, dead = self.random_tokens(length)
        donors = [r for r in sched.live + sched.finished[-8:] if r.computed >= bs]
        if donors and rng.random() < 0.6:
            # Repeat a prefix of another request: the prefix cache finds its blocks
            # while they are not reused.
            donor = donors[int(rng.integers(len(donors)))]
            n_tok = int(rng.integers(1, donor.computed // bs + 1)) * bs
            tokens[:n_tok], dead[:n_tok] = donor.tokens[:n_tok], donor.dead[:n_tok]
            if rng.random() < 0.3:  # the prompt is exactly the cached prefix
                tokens, dead = tokens[:n_tok], dead[:n_tok]
            return sched.admit(tokens, dead)
        remote = (
            int(rng.integers(1, length))
            if self.handoff and length > 1 and rng.random() < 0.2
            else 0
        )
        return sched.admit(tokens, dead, remote=remote)

    def next_step(self) -> Step:
        """Draw the next step (its chunks' blocks taken); run it, then :meth:`advance`."""
        sched, rng = self.scheduler, self.rng
        room = sched.max_len // sched.block_size + 2
        while rng.random() < 0.4:
            if sched.blocks_free() >= 2 * room:
                self.add_request()
        for request in [r for r in sched.live if r.remaining == 0]:
            sched.finish(request)
        if sched.live and rng.random() < 0.1:
            sched.preempt(sched.live[int(rng.integers(len(sched.live)))])
        if not sched.live:
            self.add_request()
        pick = rng.permutation(len(sched.live))[: int(rng.integers(1, 4))]
        chosen = [sched.live[int(i)] for i in pick]
        if self.style == "vllm":
            step = self._mixed(chosen)
        else:
            step = self._sglang(chosen)
        self._pad(step)
        self.steps += 1
        return step

    def _mixed(self, chosen: list[Request]) -> Step:
        sched, rng = self.scheduler, self.rng
        chunks: list[Chunk] = []
        budget = 40
        for request in chosen:
            if request.remaining >= 2 and request.computed and rng.random() < 0.35:
                drafts = self.random_tokens(int(rng.integers(1, MAX_DRAFTS + 1)))[0]
                count = len(drafts) + 1
            else:
                drafts, count = [], int(rng.integers(1, min(request.remaining, 7) + 1))
            if count > budget:
                continue
            chunks.append(sched.chunk(request, count, drafts))
            budget -= count
        return Step(self.steps, chunks)

    def _sglang(self, chosen: list[Request]) -> Step:
        sched, rng = self.scheduler, self.rng
        kind = str(rng.choice(["extend", "decode", "verify"]))
        if kind != "extend" and any(r.computed == 0 for r in chosen):
            kind = "extend"  # a request's first step is always an extend
        if kind == "extend":
            counts = [int(rng.integers(1, min(r.remaining, 7) + 1)) for r in chosen]
            chunks = [sched.chunk(r, c) for r, c in zip(chosen, counts, strict=True)]
        elif kind == "decode":
            chunks = [sched.chunk(r, 1) for r in chosen]
        else:
            drafts = int(rng.integers(1, MAX_DRAFTS + 1))
            chunks = [sched.chunk(r, 0, self.random_tokens(drafts)[0]) for r in chosen]
        return Step(self.steps, chunks, kind=kind)

    def _pad(self, step: Step) -> None:
        rng, n_tokens, n_reqs = self.rng, step.num_tokens, len(step.chunks)
        if not self.graph_padding:
            step.pad_tokens = rng.integers(0, self.vocab, size=int(rng.integers(0, 3))).tolist()
            step.pad_requests = int(rng.integers(0, 2))
            return
        pad_tokens = self.always_pad or rng.random() < 0.6
        if self.style == "vllm":
            pad_requests = self.always_pad or rng.random() < 0.4
            t_pad = capture_size(n_tokens, self.max_tokens) if pad_tokens else n_tokens
            r_pad = (
                capture_size(n_reqs, self.max_requests, REQUEST_CAPTURE_SIZES)
                if pad_requests
                else n_reqs
            )
            ids = rng.integers(0, self.vocab, size=t_pad - n_tokens).tolist()  # stale values
        elif step.kind == "extend":  # SGLang pads extends by tokens, with id 0
            r_pad = n_reqs
            ids = [0] * ((capture_size(n_tokens, 64) if pad_tokens else n_tokens) - n_tokens)
        else:  # and decode / verify by requests, each owning its tokens' share
            per_request = step.chunks[0].count if step.chunks else 1
            r_pad = (
                capture_size(n_reqs, self.max_requests, REQUEST_CAPTURE_SIZES)
                if pad_tokens
                else n_reqs
            )
            ids = [0] * max(0, r_pad * per_request - n_tokens)
        step.pad_tokens, step.pad_requests = ids, r_pad - n_reqs

    def advance(self, step: Step) -> list[tuple[Request, int]]:
        """Verify the step's drafts (a random number accepted) and advance every chunk;
        returns ``(request, kept positions)`` of the verified requests."""
        verified = []
        for chunk in step.chunks:
            if chunk.drafts:
                kept = self.scheduler.advance(chunk, int(self.rng.integers(0, chunk.drafts + 1)))
                verified.append((chunk.request, kept))
            else:
                self.scheduler.advance(chunk)
        return verified
