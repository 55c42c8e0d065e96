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
    """A fresh anonymous mapping of 64 MiB (what the tiers' allocations are at table
    sizes; malloc could reuse freed memory here), counted before and after touching it."""
    import mmap

    module = _module()
    size = 64 * 2**20
    before = module._status_kib()
    block = mmap.mmap(-1, size)
    mapped = module._status_kib()
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    touched = module._status_kib()
    # The address space grows by exactly the mapping; nothing is resident until written.
    assert module._delta(before, mapped)["VmSize"] == size
    assert module._delta(before, mapped)["VmRSS"] < size // 8
    assert module._delta(mapped, touched)["VmRSS"] >= size * 15 // 16
    block.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_refuses_without_cuda(capsys) -> None:
    assert _module().main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
