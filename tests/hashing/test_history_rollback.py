"""``RequestHistory.rollback`` / ``rollback_many``: what they forget, and that they never
wait for the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engramrt.errors import ValidationError
from engramrt.hashing import RequestHistory
from engramrt.hashing.types import EMPTY


def _filled(device: torch.device, max_requests: int = 5, window: int = 7) -> RequestHistory:
    """A history whose slot r holds positions 10r .. 10r + window - 1 (token = 100r + pos)."""
    history = RequestHistory(max_requests, 4, window=window, device=device)
    for r in range(max_requests):
        positions = np.arange(10 * r, 10 * r + window)
        ring = r * window + positions % window
        history.slots[torch.as_tensor(ring, device=device)] = torch.as_tensor(
            100 * r + positions, dtype=torch.int32, device=device
        )
        history.tags[torch.as_tensor(ring, device=device)] = torch.as_tensor(
            positions, device=device
        )
    return history


def _expected(history: RequestHistory, keep: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The ring after forgetting positions >= keep[r] of each slot r in ``keep`` (numpy)."""
    slots = history.slots.cpu().numpy().reshape(history.max_requests, history.window).copy()
    tags = history.tags.cpu().numpy().reshape(history.max_requests, history.window).copy()
    for r, n in keep.items():
        stale = tags[r] >= n
        slots[r][stale] = EMPTY
        tags[r][stale] = -1
    return slots.reshape(-1), tags.reshape(-1)


@pytest.mark.parametrize("as_tensors", [False, True])
def test_rollback_many_equals_one_rollback_per_request(device, as_tensors) -> None:
    keep = {3: 33, 0: 2, 4: 40}  # part of slot 3, most of slot 0, all of slot 4 (44 positions)
    want_slots, want_tags = _expected(_filled(device), keep)
    one_by_one = _filled(device)
    for r, n in keep.items():
        one_by_one.rollback(r, n)
    many = _filled(device)
    slots, counts = list(keep), list(keep.values())
    if as_tensors:
        many.rollback_many(torch.tensor(slots, device=device), torch.tensor(counts, device=device))
    else:
        many.rollback_many(slots, counts)
    for history in (one_by_one, many):
        np.testing.assert_array_equal(history.slots.cpu().numpy(), want_slots)
        np.testing.assert_array_equal(history.tags.cpu().numpy(), want_tags)
    # Slots not named keep everything; a named slot lost exactly its stale positions.
    assert (many.tags.view(5, 7)[1] >= 0).all() and (many.tags.view(5, 7)[2] >= 0).all()
    assert int((many.tags.view(5, 7)[0] >= 0).sum()) == 2
    assert int((many.tags.view(5, 7)[4] >= 0).sum()) == 0
    # Control: the untouched history differs from the expected one.
    assert not np.array_equal(_filled(device).tags.cpu().numpy(), want_tags)


def test_rollback_many_checks_sequences(device) -> None:
    history = _filled(device)
    with pytest.raises(
        ValidationError, match=r"request_slots\[1\]=5; expected a request slot, an integer in "
    ):
        history.rollback_many([0, 5], [1, 1])
    with pytest.raises(ValidationError, match=r"request_slots=\[2, 2\] names a slot twice"):
        history.rollback_many([2, 2], [1, 1])
    with pytest.raises(ValidationError, match="expected two 1-D tensors of one length"):
        history.rollback_many([0, 1], [1])
    history.rollback_many([], [])  # nothing to roll back
    np.testing.assert_array_equal(history.tags.cpu().numpy(), _filled(device).tags.cpu().numpy())


@pytest.mark.parametrize(
    ("slots", "counts", "message"),
    [
        (
            [9],
            [1],
            r"request_slots\[0\]=9; expected a request slot, an integer in \[0, "
            r"max_requests=5\)",
        ),
        ([-1], [1], r"request_slots\[0\]=-1; expected a request slot"),
        ([1, 1], [1, 2], r"request_slots=\[1, 1\] names a slot twice"),
        ([1], [-1], r"num_tokens\[0\]=-1 \(int\); expected a token count"),
    ],
)
def test_rollback_many_checks_tensors_by_default(device, slots, counts, message) -> None:
    """Tensors are checked like sequences unless validate=False (was: a raw IndexError for
    slot 9 or -1, and a negative count erasing the slot silently)."""
    history = _filled(device)
    before = history.tags.cpu().numpy().copy(), history.slots.cpu().numpy().copy()
    with pytest.raises(ValidationError, match=message):
        history.rollback_many(
            torch.tensor(slots, device=device), torch.tensor(counts, device=device)
        )
    np.testing.assert_array_equal(history.tags.cpu().numpy(), before[0])  # nothing forgotten
    np.testing.assert_array_equal(history.slots.cpu().numpy(), before[1])
    with pytest.raises(ValidationError, match=r"request_slots is a torch.float32 tensor"):
        history.rollback_many(torch.tensor([1.0], device=device), torch.tensor([1], device=device))
    with pytest.raises(ValidationError, match=r"num_tokens has shape \[1, 1\]; expected a 1-D"):
        history.rollback_many(torch.tensor([1], device=device), torch.tensor([[1]], device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="synchronisation is a CUDA notion")
def test_rollbacks_never_synchronise() -> None:
    history = _filled(torch.device("cuda"))
    slots = torch.tensor([1, 3], device="cuda")
    counts = torch.tensor([12, 35], device="cuda")
    history.rollback(0, 3)
    history.rollback_many(slots, counts, validate=False)  # first use outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        history.rollback(2, 22)
        history.rollback_many(slots, counts, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


BAD_COUNTS = [-1, -(2**40), True, False, 2**63, 2**70, 3.0, float("nan"), "3", None]


@pytest.mark.parametrize("count", BAD_COUNTS, ids=repr)
def test_rollback_refuses_counts_that_are_not_token_counts(device, count) -> None:
    """A negative or boolean count would erase history silently; huge or non-int ones raised raw."""
    history = _filled(device)
    before = history.tags.cpu().numpy().copy(), history.slots.cpu().numpy().copy()
    with pytest.raises(ValidationError, match=r"num_tokens=.*expected a token count"):
        history.rollback(1, count)
    with pytest.raises(ValidationError, match=r"num_tokens\[1\]=.*expected a token count"):
        history.rollback_many([0, 1], [3, count])
    np.testing.assert_array_equal(history.tags.cpu().numpy(), before[0])  # nothing forgotten
    np.testing.assert_array_equal(history.slots.cpu().numpy(), before[1])


@pytest.mark.parametrize("slot", [True, 1.0, -1, 5], ids=repr)
def test_rollback_refuses_slots_that_are_not_slots(device, slot) -> None:
    history = _filled(device)
    with pytest.raises(ValidationError, match=r"request_slot=.* must be in \[0, 5\)"):
        history.rollback(slot, 3)


def test_rollback_accepts_numpy_and_the_largest_count(device) -> None:
    history = _filled(device)
    history.rollback(np.int64(1), np.int32(12))  # slot 1 keeps positions 10, 11
    history.rollback(2, 2**63 - 1)  # keeps everything
    tags = history.tags.view(5, 7).cpu().numpy()
    assert sorted(tags[1][tags[1] >= 0].tolist()) == [10, 11]
    assert (tags[2] >= 0).all()
