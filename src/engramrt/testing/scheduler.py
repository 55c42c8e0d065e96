"""A serving engine's scheduler: requests over paged KV blocks with prefix caching.

:class:`Scheduler` is the mechanism every simulation here shares: requests
own KV blocks of ``block_size`` slots, taken from a free list at random (so
blocks of finished requests are reused); full blocks of computed tokens are
registered in a prefix cache keyed by their content (the chain of every
token before them, as vLLM's block hashes and SGLang's radix tree are), and
a new request takes the longest chain of cached blocks, from a live request
or a finished one whose blocks were not reused yet. A hit on the whole
prompt recomputes its last token, into the shared block. Speculative drafts
sit after a request's next token until verified; rejected ones are rolled
back and the blocks past the kept tokens given back. A preempted request
loses its blocks and is recomputed (through the prefix cache). A request
whose prefill ran on another instance (a prefill/decode hand-off) arrives
with its KV blocks written and nothing in this instance's hash history: its
first chunk carries the last N-1 token ids as lookback ids.

What the scheduler decides (which requests run, how many tokens) comes from
its caller: :func:`engramrt.testing.policy.draw_step` draws random steps from
a seed; a model's generate loop schedules its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Chunk", "Request", "Scheduler", "Step"]


@dataclass(eq=False)
class Request:
    """One request as the engine knows it.

    Attributes:
        id: arrival number.
        tokens: tokenizer ids known: accepted tokens, then the current drafts.
        dead: per token, True inside a dead span (an image).
        computed: positions whose KV (and hash history) is written.
        blocks: the KV blocks of positions ``0, block_size, ...``.
        row: the request's row: persistent-batch row, request-history slot,
            SGLang request-pool row (stable while the request lives).
        remote: positions prefilled on another instance (their slots hold no
            hash history); 0 for a local request.
        prefix_hit: positions taken from the prefix cache when it (re)started.
        saved: the continuation the current drafts hide, restored at verify.
    """

    id: int
    tokens: list[int]
    dead: list[bool]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    row: int = -1
    remote: int = 0
    prefix_hit: int = 0
    saved: tuple[list[int], list[bool]] | None = None
    keys: list[int] = field(default_factory=list, repr=False)  # of its first full blocks

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.computed


@dataclass
class Chunk:
    """``count`` tokens of ``request`` from position ``start``; ``drafts`` of them are drafts.

    ``lookback``: the chunk carries the N-1 token ids before ``start`` (the
    first chunk after a prefill/decode hand-off).
    """

    request: Request
    start: int
    count: int
    drafts: int = 0
    lookback: bool = False

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass
class Step:
    """One engine step: its chunks, in batch order, and its CUDA-graph padding.

    Attributes:
        index: the step's number in its schedule.
        chunks: the scheduled chunks.
        kind: ``"mixed"`` (any chunk lengths: vLLM), ``"extend"``,
            ``"decode"`` (one token per request) or ``"verify"`` (the same
            number of drafts per request): SGLang's forward modes.
        pad_tokens: token ids of the padding rows after the real tokens.
        pad_requests: padded requests after the real ones.
    """

    index: int
    chunks: list[Chunk]
    kind: str = "mixed"
    pad_tokens: list[int] = field(default_factory=list)
    pad_requests: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.count for c in self.chunks)


class Scheduler:
    """Requests over ``num_blocks`` KV blocks of ``block_size`` slots.

    Args:
        block_size: slots per KV block (1: one slot per token, as SGLang's pool).
        num_blocks: blocks owned, ``block_offset ..``; the first is the null
            block (never handed out: padding may point at it).
        max_requests: rows owned, ``row_offset ..``; a request is admitted
            only while a row is free.
        max_len: the longest a request's accepted tokens grow (drafts past it
            are cut at verify).
        rng: a ``numpy.random.Generator`` for block choice.
        block_offset, row_offset: where this scheduler's blocks and rows start
            (several schedulers share one KV cache and one history).
        prefix_filter: None, or ``prefix_filter(request, hit_blocks) -> n``: how many
            leading blocks of a prefix-cache hit the engine can use (a model with a
            streaming state, such as PLE's conv state, can resume only where it kept
            one: vLLM's hybrid prefix caching).
    """

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_requests: int,
        max_len: int,
        rng,
        block_offset: int = 0,
        row_offset: int = 0,
        prefix_filter: Callable[[Request, list[int]], int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_len = max_len
        self.rng = rng
        self.prefix_filter = prefix_filter
        self.null_block = block_offset
        self.free_blocks = list(range(block_offset + 1, block_offset + num_blocks))
        self.refs: dict[int, int] = {}
        self.used: set[int] = set()  # blocks handed out at least once
        self.free_rows = list(range(row_offset, row_offset + max_requests))
        self.live: list[Request] = []
        self.finished: list[Request] = []
        self.started: list[Request] = []  # (re)started since the caller last looked
        self._cache: dict[int, int] = {}  # content key of a full block -> block
        self._key_of: dict[int, int] = {}
        self._next_id = 0
        self.events: Counter[str] = Counter()

    # -- requests ------------------------------------------------------------

    def slot_of(self, request: Request, position: int) -> int:
        """The KV slot of ``position`` of ``request``."""
        bs = self.block_size
        return request.blocks[position // bs] * bs + position % bs

    def admit(
        self, tokens: list[int], dead: list[bool] | None = None, *, remote: int = 0
    ) -> Request | None:
        """Add a request (None when no row is free).

        ``remote``: positions ``0 .. remote-1`` were prefilled elsewhere; their
        blocks are taken now (the KV arrives with the request) and the first
        chunk carries lookback ids. A local request takes the prefix cache's
        longest chain of its full blocks.
        """
        if not self.free_rows:
            return None
        tokens = [int(t) for t in tokens][: self.max_len]
        dead = [False] * len(tokens) if dead is None else [bool(d) for d in dead][: len(tokens)]
        request = Request(self._next_id, tokens, dead, row=self.free_rows.pop(0))
        self._next_id += 1
        remote = min(remote, len(tokens) - 1)
        if remote > 0:
            request.remote = request.computed = remote
            self.ensure_blocks(request, remote)
            self.events["prefill ran elsewhere"] += 1
        else:
            self._take_prefix(request)
        self.live.append(request)
        self.started.append(request)
        return request

    def _keys(self, request: Request, blocks: int) -> list[int]:
        """Content keys of the first ``blocks`` full blocks: each hashes the one before with
        the block's tokens (kept on the request; :meth:`chunk` and :meth:`advance` drop
        those whose tokens drafts change). Python's hash of int tuples is deterministic;
        a collision would show as a false prefix hit, that is a replay mismatch."""
        keys, bs = request.keys, self.block_size
        for b in range(len(keys), blocks):
            span = slice(b * bs, (b + 1) * bs)
            block = (keys[-1] if keys else 0, *request.tokens[span], *request.dead[span])
            keys.append(hash(block))
        return keys[:blocks]

    def _take_prefix(self, request: Request) -> None:
        hit: list[int] = []
        for key in self._keys(request, len(request.tokens) // self.block_size):
            block = self._cache.get(key)
            if block is None:
                break
            hit.append(block)
        if self.prefix_filter is not None:
            hit = hit[: self.prefix_filter(request, hit)]
        request.prefix_hit = 0
        if not hit:
            return
        finished = False  # some block is held by no live request
        for block in hit:
            if self.refs.get(block, 0) == 0:
                self.free_blocks.remove(block)
                finished = True
            self.refs[block] = self.refs.get(block, 0) + 1
        self.events["prefix hit on a finished request" if finished else "prefix hit"] += 1
        request.blocks = hit
        n_tok = len(hit) * self.block_size
        # A hit on the whole prompt recomputes its last token (into a shared block).
        request.computed = request.prefix_hit = min(n_tok, len(request.tokens) - 1)
        if request.computed < n_tok:
            self.events["whole prompt hit"] += 1

    def ensure_blocks(self, request: Request, upto: int) -> None:
        """Give ``request`` blocks for positions ``< upto``."""
        while len(request.blocks) * self.block_size < upto:
            block = self.free_blocks.pop(int(self.rng.integers(len(self.free_blocks))))
            if block in self.used:
                self.events["block reused"] += 1
            self.used.add(block)
            key = self._key_of.pop(block, None)
            if key is not None:  # its content is gone: evict it from the prefix cache
                del self._cache[key]
            self.refs[block] = 1
            request.blocks.append(block)

    def blocks_free(self) -> int:
        return len(self.free_blocks)

    def _drop_blocks(self, request: Request, keep: int) -> None:
        for block in request.blocks[keep:]:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_blocks.append(block)  # still cached until taken again
        del request.blocks[keep:]

    def finish(self, request: Request) -> None:
        """The request is done: its row and blocks are given back (blocks stay cached)."""
        self.live.remove(request)
        self._drop_blocks(request, 0)
        self.free_rows.append(request.row)
        self.free_rows.sort()
        self.finished.append(request)

    def preempt(self, request: Request) -> None:
        """Take the request's blocks; it restarts from the prefix cache, all tokens local."""
        self._drop_blocks(request, 0)
        request.computed = request.remote = 0
        request.saved = None
        self._take_prefix(request)
        self.started.append(request)
        self.events["preempted"] += 1

    # -- steps -----------------------------------------------------------------

    def chunk(self, request: Request, count: int, drafts: list[int] | None = None) -> Chunk:
        """The next ``count`` tokens of ``request``, or its next token and ``drafts``
        (then ``count`` is ignored); blocks are taken for them."""
        start = request.computed
        if drafts:
            del request.keys[(start + 1) // self.block_size :]
            request.saved = (request.tokens[start + 1 :], request.dead[start + 1 :])
            request.tokens = request.tokens[: start + 1] + [int(t) for t in drafts]
            request.dead = request.dead[: start + 1] + [False] * len(drafts)
            count = 1 + len(drafts)
        self.ensure_blocks(request, start + count)
        return Chunk(
            request,
            start,
            count,
            drafts=len(drafts or ()),
            lookback=request.remote > 0 and start == request.remote,
        )

    def advance(self, chunk: Chunk, accepted: int | None = None) -> int:
        """After the step ran: the chunk's tokens are computed; a draft chunk keeps its next
        token and ``accepted`` drafts (then the hidden continuation). Returns the request's
        computed positions (where a history store rolls back to)."""
        request = chunk.request
        if not chunk.drafts:
            request.computed = chunk.end
        else:
            assert request.saved is not None and accepted is not None
            keep = chunk.start + 1 + accepted
            del request.keys[keep // self.block_size :]
            rest_tokens, rest_dead = request.saved
            request.tokens = (request.tokens[:keep] + rest_tokens)[: self.max_len]
            request.dead = (request.dead[:keep] + rest_dead)[: self.max_len]
            # Drafts accepted past max_len are cut like rejected ones.
            request.computed = min(keep, len(request.tokens))
            request.saved = None
            if accepted < chunk.drafts:
                self.events["drafts rejected"] += 1
            # Blocks past the kept tokens go back (another request may take them).
            self._drop_blocks(request, -(-request.computed // self.block_size))
        self._register(request)
        return request.computed

    def _register(self, request: Request) -> None:
        """Put the request's full, computed, locally hashed blocks in the prefix cache."""
        full = request.computed // self.block_size
        first_local = -(-request.remote // self.block_size)
        for b, key in enumerate(self._keys(request, full)):
            if b < first_local or key in self._cache:
                continue
            block = request.blocks[b]
            if block in self._key_of:  # already cached under another key: keep that one
                continue
            self._cache[key] = block
            self._key_of[block] = key
