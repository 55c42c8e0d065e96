"""``engramrt demo`` (the shipped tiny Engram LM): its JSON, checked independently, and controls."""

from __future__ import annotations

import json

import pytest

from engramrt.cli import main


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    """The demo as a CPU user runs it: the torch references, not the Triton interpreter
    (the kernels behind the same serving path are checked in tests/models)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _run_json(capsys, *args: str) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--json", "--device", "cpu", *args])
    out = capsys.readouterr().out
    return int(info.value.code or 0), json.loads(out)


def test_model_demo_json_matches_an_independent_reading(capsys, tmp_path) -> None:
    chart = tmp_path / "gates.png"
    code, result = _run_json(capsys, "--max-new-tokens", "6", "--plot", str(chart))
    assert code == 0
    assert [c["name"] for c in result["checks"]] == [
        "runtime_matches_eager_reference",
        "second_placement_matches",
        "engine_schedule_exercised",
        "heldout_loss_engram_fp8_reproduced",
        "heldout_loss_baseline_reproduced",
        "fp8_tables_within_half_percent",
    ]
    assert all(c["passed"] for c in result["checks"])
    assert result["generated_text"].strip()
    assert result["data"]["synthetic"] == "nothing"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The recorded losses, read straight from the shipped model.json.
    from engramrt.models.packaged import packaged_model_dir

    record = json.loads((packaged_model_dir() / "model.json").read_text())["training"]
    assert result["heldout_loss"] == {
        k: record["heldout"]["losses"][k] for k in ("engram", "baseline", "engram_fp8")
    }
    fp8, float_loss = (
        record["heldout"]["losses"]["engram_fp8"],
        record["heldout"]["losses"]["engram"],
    )
    assert abs(fp8 - float_loss) / float_loss <= 0.005

    # The continuation, recomputed here by the eager reference (no runtime, no demo code).
    from engramrt.cli.demo_model import DEFAULT_PROMPT
    from engramrt.models.serve import load_model

    model = load_model(packaged_model_dir(), tier="device", device="cpu", load_baseline=False)
    prompt = model.encode(DEFAULT_PROMPT)
    want = model.reference_generate(prompt, 6).tokens
    assert result["generated_text"] == model.decode(want)
    assert result["requests"][0]["prompt_tokens"] == len(prompt)
    # The gate values cover the prompt and the continuation but its last token, in [0, 1].
    gates = result["gates"]["values"]
    assert len(gates) == len(prompt) + 6 - 1 and len(result["gates"]["tokens"]) == len(gates)
    assert all(0.0 <= g <= 1.0 for row in gates for g in row)


def test_model_demo_checks_fail_on_wrong_tokens_and_losses(capsys, monkeypatch) -> None:
    """Controls: a corrupted served token and a held-out loss off by 5% are both reported."""
    from engramrt.models import serve

    real_generate = serve.TinyEngramModel.generate
    real_evaluate = serve.TinyEngramModel.evaluate

    def corrupted_generate(self, prompts, max_new_tokens, **kwargs):
        result = real_generate(self, prompts, max_new_tokens, **kwargs)
        kept = self.vocab.token_ids
        result.tokens[0][-1] = next(t for t in kept if t != result.tokens[0][-1])
        return result

    monkeypatch.setattr(serve.TinyEngramModel, "generate", corrupted_generate)
    monkeypatch.setattr(
        serve.TinyEngramModel, "evaluate", lambda self, *a, **k: 1.05 * real_evaluate(self, *a, **k)
    )
    code, result = _run_json(capsys, "--max-new-tokens", "4", "--plot", "/dev/null")
    assert code == 1
    verdicts = {c["name"]: c["passed"] for c in result["checks"]}
    assert verdicts["runtime_matches_eager_reference"] is False
    assert verdicts["heldout_loss_engram_fp8_reproduced"] is False
    assert verdicts["heldout_loss_baseline_reproduced"] is False
    assert verdicts["fp8_tables_within_half_percent"] is True


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens=0; expected 4 to 512"),
        (["--history", "bogus"], "--history='bogus'; expected one of slot, request, lookback"),
        (["--tier", "synthetic"], "--tier='synthetic'; expected one of auto,"),
        (["--synthetic"], "--json is for the model demo"),
        (["--checkpoint", "x.safetensors"], "--checkpoint and --config are for --synthetic"),
        (["--model", "/nonexistent"], "does not exist"),
        (["--text", "x"], "the demo needs at least 16"),
    ],
)
def test_model_demo_bad_input(capsys, args, needle) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--json", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
