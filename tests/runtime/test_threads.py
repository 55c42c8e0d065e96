"""One step loop per runtime: ``plan`` from a second thread is refused, with real threads.

The runtime's staging slots alternate per plan; two threads planning at once
would hash into each other's slot. The first thread that plans owns the
runtime, any other is refused before a buffer is touched, and
``bind_thread`` moves the ownership.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from engramrt.config import PRESETS
from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch, HashConstants, NgramHasher, hash_sequence
from engramrt.layout import EngramLayout
from engramrt.lookup.tiers import TablePlacement
from engramrt.runtime import EngramRuntime, synthetic_stores

CFG = PRESETS["tiny"]


def _runtime(token_map, device, num_slots: int) -> EngramRuntime:
    layout = EngramLayout(CFG)
    hasher = NgramHasher(
        HashConstants.from_layout(layout, token_map.pad_id(CFG)), token_map, device
    )
    stores = synthetic_stores(layout, TablePlacement("device", device), seed=3)
    return EngramRuntime(hasher, stores, max_tokens=32, max_requests=4, num_slots=num_slots)


def _in_thread(call: Callable[[], Any], name: str) -> Any:
    """``call()`` on a new thread named ``name``; its result, or the exception it raised."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = call()
        except Exception as exc:
            box["value"] = exc

    thread = threading.Thread(target=body, name=name)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    return box["value"]


def _sequence(token_map, seed: int, length: int = 12):
    ids = np.random.default_rng(seed).integers(0, token_map.vocab_size, length)
    consts = HashConstants.from_layout(EngramLayout(CFG), token_map.pad_id(CFG))
    return ids, hash_sequence(token_map.compress(ids), consts)


def test_a_second_thread_is_refused_and_touches_nothing(token_map, device) -> None:
    runtime = _runtime(token_map, device, num_slots=1)
    ids_a, want_a = _sequence(token_map, 1)
    ids_b, _ = _sequence(token_map, 2)
    step = _in_thread(lambda: runtime.plan(HashBatch.single(ids_a, device=device)), "step-loop")
    assert not isinstance(step, Exception), step
    refused = _in_thread(lambda: runtime.plan(HashBatch.single(ids_b, device=device)), "intruder")
    assert isinstance(refused, ValidationError), refused
    message = str(refused)
    assert "'intruder'" in message and "'step-loop'" in message and "bind_thread" in message
    # The refused plan wrote nothing: the owner's step keeps its own ids (one slot).
    np.testing.assert_array_equal(step.row_ids.cpu().numpy(), want_a)
    runtime.close()


def test_two_threads_planning_at_once_never_get_foreign_ids(token_map, device) -> None:
    """Both threads start together and plan in a loop; every plan that is not refused
    holds its own batch's ids, and exactly one thread plans."""
    runtime = _runtime(token_map, device, num_slots=2)
    start = threading.Barrier(2)
    report: dict[str, Any] = {}

    def loop(seed: int) -> None:
        ids, want = _sequence(token_map, seed)
        batch = HashBatch.single(ids, device=device)
        planned, wrong = 0, 0
        start.wait()
        try:
            for _ in range(60):
                step = runtime.plan(batch)
                planned += 1
                wrong += not np.array_equal(step.row_ids.cpu().numpy(), want)
        except ValidationError as exc:
            report[f"refused-{seed}"] = str(exc)
        report[seed] = (planned, wrong)

    threads = [threading.Thread(target=loop, args=(seed,), name=f"loop-{seed}") for seed in (3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    planned = {seed: report[seed][0] for seed in (3, 4)}
    assert sorted(planned.values()) == [0, 60], report  # one owner; the other refused at once
    assert report[3][1] == report[4][1] == 0, report
    runtime.close()


def test_bind_thread_moves_the_step_loop(token_map, device) -> None:
    runtime = _runtime(token_map, device, num_slots=2)
    ids, want = _sequence(token_map, 5)
    batch = HashBatch.single(ids, device=device)
    assert runtime.plan_thread is None
    assert not isinstance(_in_thread(lambda: runtime.plan(batch), "old-loop"), Exception)

    def moved() -> Any:
        runtime.bind_thread()
        return runtime.plan(batch)

    step = _in_thread(moved, "new-loop")
    assert not isinstance(step, Exception), step
    np.testing.assert_array_equal(step.row_ids.cpu().numpy(), want)
    with pytest.raises(ValidationError, match="'new-loop'"):
        runtime.plan(batch)  # this (main) thread is not the one bound now
    runtime.close()


def test_a_new_thread_with_a_finished_owners_ident_is_still_refused(token_map, device) -> None:
    """Thread idents are reused once a thread ends (on a GPU machine the next thread often
    gets the same one): ownership is the thread object, not its ident."""
    runtime = _runtime(token_map, device, num_slots=1)
    ids, _ = _sequence(token_map, 3)

    class Finished(threading.Thread):
        """A thread that ended, whose ident the calling thread has been given again."""

        @property
        def ident(self) -> int:  # type: ignore[override]
            return threading.get_ident()

    gone = Finished(name="finished-step-loop")
    with pytest.MonkeyPatch.context() as patch:  # bind_thread() called from that thread
        patch.setattr(threading, "current_thread", lambda: gone)
        runtime.bind_thread()
    assert runtime.plan_thread == threading.get_ident()
    with pytest.raises(ValidationError, match="'finished-step-loop'"):
        runtime.plan(HashBatch.single(ids, device=device))
    runtime.bind_thread()
    runtime.plan(HashBatch.single(ids, device=device))
    runtime.close()
