"""``bench/profile_tiny_lm_step.py`` on a CPU, small: both models, both hyper-connection
implementations, the record's fields, and its agreement check (a mixing that is not the
model's is caught, and the script exits 1)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--steps", "2"]
SMALL += ["--profile-steps", "1", "--top", "5"]


def _script():
    spec = importlib.util.spec_from_file_location(
        "profile_tiny_lm_step", ROOT / "bench" / "profile_tiny_lm_step.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_record_of_both_models_and_implementations(tmp_path: Path) -> None:
    script = _script()
    out = tmp_path / "step.json"
    assert script.main([*SMALL, "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["batch_size"] == 2 and record["seq_len"] == 16
    assert record["environment"]["device"] == "cpu" and "torch" in record["environment"]
    assert set(record["models"]) == {"engram", "baseline"}
    for case in record["models"].values():
        assert case["agrees"]["relative"] <= case["agrees"]["bound"]
        for implementation in script.IMPLEMENTATIONS:
            figures = case[implementation]
            assert figures["step_ms"] > 0 and len(figures["kernels"]) == 5
            assert figures["tokens_per_s"] == pytest.approx(2 * 16 / (figures["step_ms"] / 1e3))
    # The Engram model's step gathers rows; the baseline's does not.
    names = [k["kernel"] for k in record["models"]["engram"]["einsum"]["kernels"]]
    assert record["models"]["engram"]["einsum"]["kernel_us_total"] > 0 and names


def test_the_implementations_change_what_runs_and_restore_it() -> None:
    script = _script()
    from engramrt_lab.models.lm import HyperConnection

    before = HyperConnection.update
    hc = HyperConnection(4, 1)
    with torch.no_grad():
        hc.mix.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(3)))
    streams = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(4))
    output = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    expected = hc.update(streams, output)
    with script.hyper_connections("broadcast"):
        assert HyperConnection.update is not before
        torch.testing.assert_close(hc.update(streams, output), expected)
        torch.testing.assert_close(hc.read_input(streams), (streams * hc.read[:, None]).sum(-2))
    assert HyperConnection.update is before
    with pytest.raises(ValueError, match="expected one of"), script.hyper_connections("fused"):
        pass


def test_a_wrong_mixing_is_caught(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    script = _script()
    from engramrt_lab.models.lm import no_autocast

    def untransposed(self, streams, output):  # mix[j, i] where the model has mix[i, j]
        with no_autocast(streams.device.type):
            mixed = torch.matmul(self.mix.float(), streams.float())
            return mixed + self.write.float()[:, None] * output.float().unsqueeze(-2)

    monkeypatch.setattr(script, "_update_broadcast", untransposed)
    assert script.main(SMALL) == 1
    assert "disagree" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--steps", "--batch-size", "--seq-len", "--profile-steps", "--top"]
)
def test_a_count_below_one_is_refused(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _script().main(["--device", "cpu", flag, "0"])
    assert exc.value.code == 2
    assert f"{flag}=0; expected >= 1" in capsys.readouterr().err
