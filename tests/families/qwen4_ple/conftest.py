"""The Qwen4-Exp PLE oracle: Hugging Face transformers 5.23.0, a test-only dependency
(``pip install -e .[oracle]``; ``scripts/setup dev`` installs it when it can)."""

from __future__ import annotations

import pytest

ORACLE_VERSION = "5.23.0"

ORACLE_MODEL_FIELDS = dict(
    hc_lowrank=4,
    num_experts=2,
    num_experts_per_tok=1,
    moe_intermediate_size=8,
    shared_expert_intermediate_size=8,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
)
"""The fields of a tiny Qwen4-Exp text config that PLE does not read but the oracle's model
needs to be built (hyper-connections, experts, attention heads), small."""


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
