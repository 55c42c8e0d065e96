"""EngineStep: the engine step as a value, its host mirror, and its older name."""

from __future__ import annotations

import pytest
import torch

from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch
from engramrt.step import EngineStep


def test_host_mirror_and_older_name() -> None:
    step = EngineStep.single([5, 6, 7], start=2)
    assert HashBatch is EngineStep
    mirrored = step.with_host()
    assert mirrored.host is not None and mirrored.host.host is None
    assert torch.equal(mirrored.host.input_ids, step.input_ids)
    assert mirrored.input_ids is step.input_ids  # the step's own tensors, not copies
    # A mirror that carries a mirror of its own is flattened; to() keeps the mirror.
    again = step.with_host(mirrored)
    assert again.host is not None and again.host.host is None
    assert step.with_host().to("cpu").host is not None
    with pytest.raises(ValidationError, match=r"host is a list; expected an EngineStep"):
        step.with_host([5, 6, 7])  # type: ignore[arg-type]
