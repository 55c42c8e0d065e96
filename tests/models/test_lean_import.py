"""Importing the model package (and its training and serving modules) loads no Triton
and touches no GPU."""

from __future__ import annotations

import subprocess
import sys


def test_models_import_is_lean():
    code = (
        "import sys, torch, engramrt.models, engramrt.models.train, engramrt.models.serve\n"
        "loaded = sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.'))\n"
        "assert not loaded, loaded\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
