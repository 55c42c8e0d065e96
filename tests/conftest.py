"""Test set-up shared by every test module.

Kernels run through Triton's CPU interpreter on machines without a GPU.
Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set
here, before any test module imports a kernel.
"""

from __future__ import annotations

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def token_map(tmp_path_factory: pytest.TempPathFactory):
    """The DeepSeek-V4 token map, built once per test session in a fresh cache dir."""
    from engramrt.tokenmap import TokenMap

    return TokenMap.from_tokenizer_file(cache_dir=tmp_path_factory.mktemp("tokenmap-cache"))


@pytest.fixture(scope="session")
def device():
    """Where kernel tests run: ``ENGRAMRT_TEST_DEVICE`` (e.g. ``cuda`` on a GPU machine), else CPU."""
    import torch

    return torch.device(os.environ.get("ENGRAMRT_TEST_DEVICE", "cpu"))
