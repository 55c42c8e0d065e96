"""Every gate launch configuration the benchmarks sweep stays within the documented
tolerance of the reference (see the derivation in test_gate.py): several programs
per token (a partial last group of streams too), unrolled D loops, masked tokens,
an empty batch."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from unittest.mock import patch

import pytest
from tests.gate.test_gate import check_against_reference, make_inputs, poisoned_out

from engramrt import tuning
from engramrt.bench.cases_gate import GATE_SWEEP, config_label
from engramrt.errors import ValidationError
from engramrt.gate import GateInputs
from engramrt.gate.config import GateKernelConfig, default_gate_config
from engramrt.gate.kernel import engram_gate_triton
from engramrt.tuning import write_tuned_config

SWEEP = [pytest.param(config, id=config_label(config)) for config in GATE_SWEEP]


@pytest.mark.parametrize("config", SWEEP)
@pytest.mark.parametrize(
    ("num_tokens", "hc", "dim", "block_d"),
    [
        (17, 4, 100, None),  # the sweep's own chunk: one chunk, D masked
        (5, 3, 100, 32),  # four chunks, the last partial; hc=3: a partial stream group
        (3, 4, 33, 16),
        (0, 4, 64, None),
    ],
)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_sweep_config_within_tolerance(
    config: GateKernelConfig,
    num_tokens: int,
    hc: int,
    dim: int,
    block_d: int | None,
    masked: bool,
) -> None:
    if block_d is not None:
        # Fewer warps with the small chunk, so the interpreter's tile stays small.
        config = dataclasses.replace(config, block_d=block_d, num_warps=1)
    inputs = make_inputs(num_tokens, hc, dim, seed=hc * 1000 + dim, masked=masked)
    out = poisoned_out(inputs["hidden"])
    result = engram_gate_triton(GateInputs(**inputs), out=out, config=config)
    assert result.data_ptr() == out.data_ptr()
    check_against_reference(out, inputs, label=config_label(config))


def test_stream_groups_cover_every_stream() -> None:
    """Negative control: a stream left unwritten (NaN) fails the check, so the groups of
    the test above really are all written."""
    inputs = make_inputs(4, 3, 40, seed=3)
    out = poisoned_out(inputs["hidden"])
    engram_gate_triton(
        GateInputs(**inputs), out=out, config=GateKernelConfig(16, 1, None, streams_per_program=2)
    )
    check_against_reference(out, inputs)
    out[:, 2, 5] = float("nan")
    with pytest.raises(AssertionError):
        check_against_reference(out, inputs)


def test_programs_per_sm_caps_the_grid_of_stream_groups() -> None:
    """A persistent grid walks (token, group) items: one program for all of them."""
    inputs = make_inputs(7, 4, 48, seed=4, masked=True)
    out = poisoned_out(inputs["hidden"])
    config = GateKernelConfig(16, 1, programs_per_sm=1, streams_per_program=1, unroll=True)
    engram_gate_triton(GateInputs(**inputs), out=out, config=config)
    check_against_reference(out, inputs)


def test_a_decode_bucket_in_a_tuned_file_holds_below_its_bound(tmp_path: Path) -> None:
    decode = GateKernelConfig(1024, 8, None, streams_per_program=2, unroll=True)
    name = "Test GPU decode"
    write_tuned_config(
        "engram_gate", name, ("hc", "dim", "element_bytes", "num_tokens"),
        [({"hc": 4, "dim": 5120, "element_bytes": 2, "num_tokens": {"max": 256}}, decode)],
        tmp_path,
    )  # fmt: skip
    with patch.object(tuning, "TUNED_DIR", tmp_path):
        tuning.clear_cache()
        assert default_gate_config(4, 5120, 2, num_tokens=256, device=name) == decode
        assert default_gate_config(4, 5120, 2, num_tokens=257, device=name) != decode
        assert default_gate_config(4, 5120, 2, device=name) != decode  # no token count
        assert default_gate_config(4, 5120, 4, num_tokens=1, device=name) != decode  # fp32
        assert default_gate_config(2, 5120, 2, num_tokens=1, device=name) != decode  # no entry
    tuning.clear_cache()
    assert default_gate_config(4, 5120, 2, num_tokens=1, device="Other GPU") != decode


def test_measured_shape_takes_its_file_entry() -> None:
    assert default_gate_config(4, 5120).streams_per_program == 1  # the measured entry
    assert default_gate_config(4, 5120, 4).streams_per_program is None  # fp32 operands: the rule
    assert default_gate_config(4, 4096, 2).streams_per_program is None  # no entry: the rule


@pytest.mark.parametrize(
    ("field", "bad", "expected"),
    [
        ("streams_per_program", 0, "expected None or an int >= 1"),
        ("streams_per_program", True, "expected None or an int >= 1"),
        ("unroll", 1, "expected a bool"),
    ],
)
def test_config_names_the_bad_field(field: str, bad: object, expected: str) -> None:
    with pytest.raises(ValidationError, match=rf"^{field} = {re.escape(repr(bad))}; {expected}"):
        GateKernelConfig(1024, 4, **{field: bad})  # type: ignore[arg-type]
