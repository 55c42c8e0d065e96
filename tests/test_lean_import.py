"""``import engramrt`` touches no GPU and compiles no kernel; its public names resolve lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest

import engramrt


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout.strip()


def test_import_is_lean() -> None:
    code = (
        "import sys, engramrt, engramrt.cli\n"
        "heavy = [m for m in ('torch', 'triton', 'tokenizers', 'safetensors') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    assert _run(code) == "", "import engramrt pulled in: " + _run(code)


def test_import_leaves_the_engine_simulator_out() -> None:
    """``engramrt.testing`` (the simulated engine) loads only when asked for; the control
    imports it and sees it."""
    code = (
        "import sys, engramrt\n"
        "for name in engramrt._LAZY:\n"
        "    getattr(engramrt, name)\n"
        "print('engramrt.testing' in sys.modules)\n"
        "import engramrt.testing\n"
        "print('engramrt.testing' in sys.modules)\n"
    )
    assert _run(code).splitlines() == ["False", "True"]


def test_lazy_names_import_no_triton_until_a_kernel_runs() -> None:
    """Every lazy name imports torch but not Triton; running a kernel then does (the control)."""
    code = (
        "import sys, engramrt\n"
        "for name in engramrt._LAZY:\n"
        "    getattr(engramrt, name)\n"
        "print('torch' in sys.modules, 'triton' in sys.modules)\n"
        "import torch\n"
        "x = torch.randn(3, 32, device='cuda' if torch.cuda.is_available() else 'cpu')\n"
        "engramrt.quantize_rows(x, backend='triton')\n"
        "print('triton' in sys.modules)\n"
    )
    lines = _run(code).splitlines()
    assert lines[0] == "True False", f"after resolving every lazy name (torch, triton): {lines[0]}"
    # The control: the same check sees Triton once a kernel has run.
    assert lines[1] == "True", "a Triton kernel ran but 'triton' is not in sys.modules"


def test_all_lists_the_eager_and_the_lazy_names() -> None:
    assert len(engramrt.__all__) == len(set(engramrt.__all__)), "duplicates in __all__"
    eager = {name for name in engramrt.__all__ if name not in engramrt._LAZY}
    assert set(engramrt._LAZY) <= set(engramrt.__all__)
    for name in sorted(eager):
        assert name in vars(engramrt), f"{name} is in __all__ but neither imported nor lazy"
    for target in engramrt._LAZY.values():
        module, _, attribute = target.partition(":")
        assert module.startswith("engramrt.") and attribute, f"malformed target {target!r}"


def test_dir_lists_every_public_name() -> None:
    missing = sorted(set(engramrt.__all__) - set(dir(engramrt)))
    assert not missing, f"dir(engramrt) lacks {missing}"


@pytest.mark.parametrize("name", engramrt.__all__)
def test_public_name_resolves(name: str) -> None:
    import importlib

    value = getattr(engramrt, name)
    assert value is not None
    target = engramrt._LAZY.get(name)
    if target is not None:
        module, _, attribute = target.partition(":")
        assert value is getattr(importlib.import_module(module), attribute)
        assert vars(engramrt)[name] is value, f"{name} is not kept after its first access"


def test_unknown_attribute_raises_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="'no_such_name'"):
        engramrt.no_such_name  # noqa: B018
    assert not hasattr(engramrt, "EngramRuntime2")
