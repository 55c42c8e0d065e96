"""``import engramrt`` touches no GPU and compiles no kernel."""

from __future__ import annotations

import subprocess
import sys


def test_import_is_lean() -> None:
    code = (
        "import sys, engramrt, engramrt.cli\n"
        "heavy = [m for m in ('torch', 'triton', 'tokenizers', 'safetensors') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "", f"import engramrt pulled in: {proc.stdout.strip()}"
