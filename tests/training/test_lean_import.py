"""Importing the training ops loads no Triton and touches no GPU."""

from __future__ import annotations

import subprocess
import sys


def test_training_import_is_lean():
    code = (
        "import sys, torch, engramrt.training\n"
        "loaded = sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.'))\n"
        "assert not loaded, loaded\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
