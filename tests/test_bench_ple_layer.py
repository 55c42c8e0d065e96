"""The PLE layer's bench cases (``ple/layer decode 256``, ``ple/layer prefill 8192``) on the
CPU, small: each case's own ``make`` at a tiny config and table, transformers' layer (the
``transformers`` implementation and baseline) beside ours, through the case's ``check``.

On the CPU the oracle is the reference bit for bit in bf16
(tests/families/qwen4_ple/test_layer.py), so its output and states, read back from its
``[B, L, hc*D]`` output and channels-first ``DynamicCache``, must be the reference's bits
here: that checks the layout conversions exactly. A perturbed oracle weight and a state
given to the wrong sequence make the check fail.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engramrt.bench import cases_ple
from engramrt.families.qwen4_ple.config import PleConfig

pytestmark = pytest.mark.skipif(
    not cases_ple._oracle_available(), reason="the PLE oracle transformers==5.23.0 is missing"
)

CPU = torch.device("cpu")
TINY = PleConfig(
    ple_layer_ids=(2,),
    ple_embed_dim=32,
    heads_per_ngram=2,  # C = 4 heads of d = 8
    hidden_size=32,
    hc_count=2,
    vocab_size=97,
    ngram_vocab_size_base=101,
    make_ngram_vocab_size_divisible_by=8,
    eos_token_id=5,
    num_hidden_layers=2,
    layer_types=("linear_attention", "linear_attention"),
)
"""A tiny config: D 32, hc 2, E 32, N 3, K 4 (S 9); PLE on decoder layer 1."""

SMALL = {"decode": {"n_req": 6, "per": 1}, "prefill": {"n_req": 1, "per": 23}}
"""Each case's shape, small: decode is B sequences of one token, prefill one sequence longer
than S (its conv reads both the state and the chunk)."""

IMPLS = ("transformers", "reference-eager", "engramrt", "torch-vectorised")
"""The implementations run here (``engramrt-compiled`` and ``engramrt-inductor`` need
Inductor's C++ toolchain; the GPU runs them)."""


def layer_cases() -> dict[str, Any]:
    return {case.name.split()[1]: case for case in cases_ple.ple_layer_cases(quick=False)}


@pytest.fixture
def tiny_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cases_ple.LAYER_TABLE_ROWS_ENV, "1000")


def make_inputs(kind: str) -> tuple[Any, dict[str, Any]]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the engramrt layer's Triton kernels run on CPU tensors: TRITON_INTERPRET=1")
    case = layer_cases()[kind]
    return case, case.make(CPU, cfg=TINY, **SMALL[kind])


def test_the_oracle_is_an_implementation_and_the_baseline() -> None:
    cases = layer_cases()
    assert sorted(cases) == ["decode", "prefill"]
    for case in cases.values():
        assert case.baseline == "transformers"
        assert set(case.impls) == {*cases_ple.LAYER_IMPLS, "transformers"}
        assert "index_select of the same bf16 table" in case.params["transformers"]


@pytest.mark.usefixtures("tiny_table")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_case_runs_and_checks_on_the_cpu(kind: str) -> None:
    case, inputs = make_inputs(kind)
    n_req, per = SMALL[kind]["n_req"], SMALL[kind]["per"]
    assert inputs["hidden"].shape == (n_req * per, TINY.hc_count * TINY.hidden_size)
    outputs = {name: case.impls[name](inputs) for name in IMPLS}
    out, _ = outputs["transformers"]
    assert out.shape == (n_req, per, TINY.hc_count * TINY.hidden_size)
    case.check(inputs, outputs)
    # The oracle is the reference's bits on the CPU: the layouts are read back exactly.
    oracle_out, oracle_pool = cases_ple._oracle_as_pool(inputs, outputs["transformers"])
    want_out, want_pool = outputs["reference-eager"]
    assert torch.equal(oracle_out.view(torch.int16), want_out.view(torch.int16))
    assert torch.equal(oracle_pool.view(torch.int16), want_pool.view(torch.int16))
    assert not torch.equal(want_pool, inputs["initial_pool"])  # the states moved on
    # A timed call goes on from the first one's states, as the pools do.
    case.impls["transformers"](inputs)
    case.impls["reference-eager"](inputs)
    _, again_pool = cases_ple._oracle_as_pool(inputs, outputs["transformers"])
    assert torch.equal(again_pool.view(torch.int16), want_pool.view(torch.int16))


@pytest.mark.usefixtures("tiny_table")
@pytest.mark.parametrize("mistake", ["perturbed conv tap", "another sequence's state"])
def test_check_fails_when_the_oracle_is_given_something_else(mistake: str) -> None:
    case, inputs = make_inputs("decode")
    oracle, cache = inputs["oracle"], inputs["oracle_cache"]
    if mistake == "perturbed conv tap":
        # A new parameter: the oracle's weights share memory with the cached shared ones.
        conv1d = oracle.conv1d.weight.detach().clone()
        conv1d[:, 0, 0] = conv1d[:, 0, 1]
        oracle.conv1d.weight = torch.nn.Parameter(conv1d, requires_grad=False)
    else:
        state = cache.get_conv_state(TINY.decoder_layer_indices[0], state_idx=1)
        state.copy_(state.roll(1, dims=0))
    outputs = {name: case.impls[name](inputs) for name in ("transformers", "reference-eager")}
    with pytest.raises(AssertionError, match=r"transformers out: .* outside the enclosure"):
        case.check(inputs, outputs)
