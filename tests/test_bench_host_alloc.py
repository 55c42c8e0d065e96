"""bench/host_alloc_size.py: its accounting on this machine, and its refusal without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "bench" / "host_alloc_size.py"


def _module():
    spec = importlib.util.spec_from_file_location("host_alloc_size", _PATH)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_status_delta_sees_an_allocation_of_known_size() -> None:
    module = _module()
    torch.ones(64 * 2**20, dtype=torch.uint8)  # the first fill starts torch's threads: not counted
    before = module._status_kib()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    after = module._status_kib()
    delta = module._delta(before, after)
    # The address space grows by the block (a page or two of malloc header aside) ...
    assert 64 * 2**20 <= delta["VmSize"] <= 64 * 2**20 + 2 * 2**20, delta
    # ... and so does the resident set, since every page was written.
    assert delta["VmRSS"] >= 60 * 2**20, delta
    del block


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_refuses_without_cuda(capsys) -> None:
    assert _module().main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
