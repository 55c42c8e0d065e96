"""The simulator's scheduler: blocks, the content-keyed prefix cache, drafts, preemption.

The replays (tests/adapters, tests/hashing) trust the scheduler to model an
engine; these tests pin what it does on small hand-made cases, and a property
test checks its block bookkeeping on random schedules.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engramrt.testing import RandomSchedule, Scheduler


def _scheduler(block_size: int = 4, num_blocks: int = 16, max_len: int = 40) -> Scheduler:
    return Scheduler(
        block_size=block_size,
        num_blocks=num_blocks,
        max_requests=4,
        max_len=max_len,
        rng=np.random.default_rng(0),
    )


def _compute(scheduler: Scheduler, request, count: int) -> None:
    scheduler.advance(scheduler.chunk(request, count))


def test_prefix_hits_take_full_computed_blocks_of_equal_content() -> None:
    s = _scheduler()
    first = s.admit(list(range(10)))
    _compute(s, first, 9)  # blocks 0 and 1 full; block 2 holds position 8 only
    same = s.admit(list(range(10)))
    assert same.computed == same.prefix_hit == 8 and same.blocks == first.blocks[:2]
    other = s.admit([0, 1, 2, 3, 9, 9, 9, 9, 9])
    assert other.computed == 4 and other.blocks == first.blocks[:1]
    dead = s.admit(list(range(10)), [False, True] + [False] * 8)  # a dead flag is content
    assert dead.computed == 0 and dead.blocks == []
    assert s.refs[first.blocks[0]] == 3 and s.refs[first.blocks[1]] == 2


def test_a_hit_on_the_whole_prompt_recomputes_its_last_token() -> None:
    s = _scheduler()
    first = s.admit(list(range(8)))
    _compute(s, first, 8)
    again = s.admit(list(range(8)))
    assert again.computed == 7 and again.blocks == first.blocks
    assert s.events["whole prompt hit"] == 1


def test_finished_blocks_stay_cached_until_reused() -> None:
    s = _scheduler(num_blocks=4)  # the null block and three others
    first = s.admit(list(range(8)))
    _compute(s, first, 8)
    s.finish(first)
    assert sorted(s.free_blocks) == [1, 2, 3]
    hit = s.admit(list(range(9)))
    assert hit.computed == 8 and s.events["prefix hit on a finished request"] == 1
    s.finish(hit)
    # Another request takes every free block: the cached ones are evicted.
    filler = s.admit([50 + i for i in range(12)])
    _compute(s, filler, 12)
    s.finish(filler)
    assert s.admit(list(range(9))).computed == 0  # the old content is gone


def test_rejected_drafts_roll_back_and_give_back_their_blocks() -> None:
    s = _scheduler(block_size=2)
    request = s.admit(list(range(5)))
    _compute(s, request, 3)
    chunk = s.chunk(request, 0, [90, 91, 92])  # position 3, then drafts 4..6
    assert request.tokens == [0, 1, 2, 3, 90, 91, 92] and len(request.blocks) == 4
    kept = s.advance(chunk, accepted=0)
    assert kept == 4 and request.tokens == [0, 1, 2, 3, 4] and len(request.blocks) == 2
    assert s.events["drafts rejected"] == 1


def test_drafts_accepted_past_max_len_are_cut() -> None:
    s = _scheduler(max_len=6)
    request = s.admit(list(range(5)))
    _compute(s, request, 4)
    kept = s.advance(s.chunk(request, 0, [90, 91, 92]), accepted=3)
    assert kept == 6 and request.tokens == [0, 1, 2, 3, 4, 90]


def test_a_handed_off_request_carries_lookback_once_and_caches_no_remote_block() -> None:
    s = _scheduler()
    request = s.admit(list(range(12)), remote=9)
    assert request.computed == 9 and len(request.blocks) == 3
    chunk = s.chunk(request, 2)
    assert chunk.lookback
    s.advance(chunk)
    assert not s.chunk(request, 1).lookback
    # Its blocks hold KV from elsewhere but no local hash history: never a prefix hit.
    assert s.admit(list(range(12))).computed == 0


def test_preemption_restarts_through_the_prefix_cache() -> None:
    s = _scheduler()
    request = s.admit(list(range(10)))
    _compute(s, request, 9)
    s.preempt(request)
    assert request.computed == 8 and s.events["preempted"] == 1


@given(seed=st.integers(0, 2**32 - 1), style=st.sampled_from(["vllm", "sglang"]))
@settings(max_examples=60, deadline=None)
def test_block_references_match_the_requests_holding_them(seed: int, style: str) -> None:
    """On random schedules: a block's reference count is the number of live requests
    holding it, free blocks are held by none, and no block is both."""
    rng = np.random.default_rng(seed)
    s = Scheduler(block_size=1 if style == "sglang" else 4, num_blocks=200, max_requests=8,
                  max_len=40, rng=rng)  # fmt: skip
    policy = RandomSchedule(s, rng, 1000, style=style)
    for _ in range(25):
        step = policy.next_step()
        policy.advance(step)
        held = Counter(b for r in s.live for b in r.blocks)
        assert all(s.refs[b] == n for b, n in held.items())
        assert not set(held) & set(s.free_blocks)
        assert s.null_block not in held and s.null_block not in s.free_blocks
        assert len(s.free_blocks) + len(held) == s.num_blocks - 1
        for r in s.live:  # every computed position has a block
            assert len(r.blocks) * s.block_size >= r.computed


def test_control_the_reference_count_check_sees_a_leak() -> None:
    """A block dropped without giving back its reference breaks the invariant above."""
    s = _scheduler()
    request = s.admit(list(range(10)))
    _compute(s, request, 8)
    request.blocks.pop()  # leaked: still referenced, held by no one, not free
    held = Counter(b for r in s.live for b in r.blocks)
    assert len(s.free_blocks) + len(held) != s.num_blocks - 1
