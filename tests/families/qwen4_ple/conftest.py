"""The Qwen4-Exp PLE oracle: Hugging Face transformers 5.23.0, a test-only dependency
(``pip install -e .[oracle]``; ``scripts/setup dev`` installs it when it can)."""

from __future__ import annotations

import pytest

ORACLE_VERSION = "5.23.0"


@pytest.fixture(scope="session")
def oracle():
    """``transformers.models.qwen4_exp.modeling_qwen4_exp``; the test is skipped, naming the
    missing oracle, where transformers 5.23.0 is not installed."""
    transformers = pytest.importorskip(
        "transformers", reason=f"the PLE oracle transformers=={ORACLE_VERSION} is not installed"
    )
    if transformers.__version__ != ORACLE_VERSION:
        pytest.skip(
            f"transformers {transformers.__version__} is installed; the PLE oracle is "
            f"{ORACLE_VERSION} (pip install -e .[oracle])"
        )
    from transformers.models.qwen4_exp import modeling_qwen4_exp

    return modeling_qwen4_exp
