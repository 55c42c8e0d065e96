"""``engramrt demo`` (the shipped tiny Engram LM): its JSON, checked independently, and controls.

One run with ``--full-eval`` (the module's ``full_run``) serves every test
that only reads its result; the quick default and a one-token prompt get a
second run, and the controls monkeypatch the expensive parts away.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest

from engramrt.cli import main


def _demo(*args: str) -> tuple[int, dict, str]:
    """Run ``engramrt demo --json --device cpu ARGS`` in this process: (exit code, JSON, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as info,
    ):
        # The demo as a CPU user runs it: the torch references, not the Triton
        # interpreter (the kernels behind the same serving path are checked in tests/models).
        patch.setenv("TRITON_INTERPRET", "0")
        main(["demo", "--json", "--device", "cpu", *args])
    return int(info.value.code or 0), json.loads(out.getvalue()), err.getvalue()


def _record() -> dict:
    from engramrt_lab.models.packaged import packaged_model_dir

    return json.loads((packaged_model_dir() / "model.json").read_text())["training"]


NEW_TOKENS = 12
"""Tokens the full run generates: past the 9th, where the shipped model's unmasked
argmax after the default prompt is the document-start token."""


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[int, dict, str, object]:
    chart = tmp_path_factory.mktemp("demo") / "gates.png"
    args = ("--max-new-tokens", str(NEW_TOKENS), "--full-eval", "--plot", str(chart))
    return (*_demo(*args), chart)


def _expected_heldout(record: dict) -> dict[str, dict[str, float]]:
    """The held-out losses per set, read here from the record's two sections."""
    return {
        "stdlib": record["heldout"]["losses"],
        "site-packages": record["package_heldout"]["losses"],
    }


def test_model_demo_json_matches_an_independent_reading(full_run, monkeypatch) -> None:
    code, result, _, chart = full_run
    record = _record()
    from engramrt_lab.cli.demo_model import NOT_SERVED

    served = [name for name in record["heldout"]["sample_losses"] if name not in NOT_SERVED]
    assert code == 0
    assert [c["name"] for c in result["checks"]] == [
        "runtime_matches_eager_reference",
        "second_placement_matches",
        "engine_schedule_exercised",
        *[f"heldout_loss_{name}_reproduced" for name in served],
        "fp8_tables_within_half_percent",
    ]
    assert all(c["passed"] for c in result["checks"])
    assert result["generated_text"].strip()
    assert result["data"]["synthetic"] == "nothing"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["plot"] == str(chart.resolve())

    # The recorded losses, read straight from the shipped model.json: the shipped package
    # holds several seeds' losses (``heldout_seeds``), so each model's figure is their mean
    # and its spread their sample standard deviation, computed here with the statistics module.
    folded = record["heldout_seeds"]
    seeds = len(folded["seeds"])
    assert seeds >= 2 and result["seeds"] == seeds
    names = {"heldout": "stdlib", "package_heldout": "site-packages"}
    per_seed = {names[split]: models for split, models in folded["losses"].items()}
    assert set(per_seed) == {"stdlib", "site-packages"}
    for models in per_seed.values():
        assert {"engram", "baseline", "baseline_wide"} <= set(models)
        assert all(len(values) == seeds for values in models.values())
    expected = {
        name: {model: statistics.mean(values) for model, values in models.items()}
        for name, models in per_seed.items()
    }
    assert set(result["heldout_loss"]) == set(result["heldout_spread"]) == set(per_seed)
    for name, models in per_seed.items():
        assert result["heldout_loss"][name] == pytest.approx(expected[name], rel=1e-12)
        assert result["heldout_spread"][name] == pytest.approx(
            {model: statistics.stdev(values) for model, values in models.items()}, rel=1e-12
        )
    assert result["heldout_lowest"] == {
        name: min(models, key=models.get) for name, models in expected.items()
    }
    # The shipped seed's own run is one of the seeds folded in.
    own = _expected_heldout(record)
    for name, models in per_seed.items():
        for model, values in models.items():
            assert own[name][model] in values, (name, model)
    sets = result["heldout_sets"]
    assert sets["stdlib"]["predictions"] == record["heldout"]["predictions"]
    assert sets["site-packages"]["predictions"] == record["package_heldout"]["predictions"]
    assert "click, rich, typer" in sets["site-packages"]["what"]
    assert set(result["heldout_loss_here"]) == set(served)
    assert result["heldout_here"]["sequences"] == 32 and result["heldout_here"]["predictions"] > 0
    fp8, float_loss = own["stdlib"]["engram_fp8"], own["stdlib"]["engram"]
    assert abs(fp8 - float_loss) / float_loss <= 0.005
    assert not result["training"]["command"].startswith("/")

    # The seen / unseen split, from the record's categories: the seen row as recorded, the
    # unseen one the prediction-weighted mean of the other categories, for each set; both
    # rows' predictions add up to the set's.
    assert set(result["heldout_seen"]) == {"stdlib", "site-packages"}
    for name, key in (("stdlib", "where_it_wins"), ("site-packages", "where_it_wins_package")):
        categories = record[key]["longest_seen"]
        seen, unseen = (
            result["heldout_seen"][name]["4-gram seen"],
            result["heldout_seen"][name]["4-gram unseen"],
        )
        assert seen == categories["4-gram seen"]
        rest = [row for label, row in categories.items() if label != "4-gram seen"]
        count = sum(row["predictions"] for row in rest)
        assert unseen["predictions"] == count
        assert seen["predictions"] + count == sets[name]["predictions"]
        for model in ("engram", "baseline", "baseline_wide", "engram gate (block 3)"):
            mean = sum(row[model] * row["predictions"] for row in rest) / count
            assert unseen[model] == pytest.approx(mean, rel=1e-12), (name, model)

    # The continuation, recomputed here by the eager reference (no runtime, no demo code).
    from engramrt.lookup.tiers import TablePlacement
    from engramrt_lab.cli.demo_model import DEFAULT_PROMPT
    from engramrt_lab.models.packaged import packaged_model_dir
    from engramrt_lab.models.serve import load_model

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch references, as the demo runs
    model = load_model(
        packaged_model_dir(), TablePlacement("device", device="cpu"), load_baseline=False
    )
    prompt = model.encode(DEFAULT_PROMPT)
    want = model.reference_generate(prompt, NEW_TOKENS).tokens
    assert result["generated_text"] == model.decode(want)
    assert result["requests"][0]["prompt_tokens"] == len(prompt)
    # The gate values cover the prompt and the continuation but its last token, in [0, 1].
    gates = result["gates"]["values"]
    assert len(gates) == len(prompt) + NEW_TOKENS - 1
    assert len(result["gates"]["tokens"]) == len(gates)
    assert all(0.0 <= g <= 1.0 for row in gates for g in row)

    # No document-start token in the continuation: each generated token is the argmax,
    # computed here from the logits, over the kept ids but that one.
    from engramrt_lab.models.vocab import BOS_TOKEN_ID

    bos = model.decode([BOS_TOKEN_ID])
    assert BOS_TOKEN_ID not in want and bos not in result["generated_text"]
    logits, _ = model.reference_forward(prompt + want[:-1])
    kept = logits[len(prompt) - 1 :, : model.vocab.num_kept]
    bos_trimmed = int(model.vocab.trim([BOS_TOKEN_ID])[0])
    masked = kept.clone()
    masked[:, bos_trimmed] = float("-inf")
    assert [int(t) for t in model.vocab.untrim(masked.argmax(-1).numpy())] == want
    # Control: where a file ends, the shipped model's most likely token is the next
    # file's start; the generation takes the best token but that one.
    ending = model.encode('if __name__ == "__main__":\n    main()\n')
    last, _ = model.reference_forward(ending)
    assert int(last[-1, : model.vocab.num_kept].argmax()) == bos_trimmed
    assert BOS_TOKEN_ID not in model.reference_generate(ending, 4).tokens


def test_model_demo_says_what_it_does_first_and_reports_each_stage(full_run) -> None:
    _, _, err, _ = full_run
    lines = err.splitlines()
    assert lines[0].startswith("engramrt demo: serving the tiny Engram LM")
    assert any(line.strip().startswith("loading torch:") for line in lines)
    from engramrt_lab.cli.demo_model import NOT_SERVED

    evaluated = [line for line in lines if line.strip().startswith("held-out loss of")]
    recorded = _record()["heldout"]["sample_losses"]
    assert len(evaluated) == len([name for name in recorded if name not in NOT_SERVED])


def _result_with(full_run_result: dict, figures: dict) -> dict:
    """The full run's JSON with the held-out figures of another record (what the demo
    would report from it): its losses, spread, seed count and lowest model per set."""
    return {
        **full_run_result,
        "heldout_loss": figures["loss"],
        "heldout_spread": figures["spread"],
        "seeds": figures["seeds"],
        "heldout_lowest": {
            name: min(models, key=models.get) for name, models in figures["loss"].items()
        },
    }


def test_the_loss_table_names_every_model_and_the_lowest(full_run, capsys) -> None:
    """The text output of a one-seed record (the shipped record without its folded seeds):
    each recorded model and, in words, the lowest; no spread."""
    from engramrt_lab.cli.demo_model import print_losses
    from engramrt_lab.models.seeds import heldout_figures

    record = _record()
    del record["heldout_seeds"]
    figures = heldout_figures(record)
    assert figures["seeds"] == 1
    print_losses(_result_with(full_run[1], figures))
    text = " ".join(capsys.readouterr().out.split())
    for name, losses in _expected_heldout(record).items():
        lowest = min(losses, key=losses.get)
        for model, value in losses.items():
            assert model in text and f"{value:.4f}" in text
        assert f"lowest on {name}: {lowest} ({losses[lowest]:.4f})" in text
    assert "one seed" in text and "±" not in text


def test_the_loss_table_shows_the_spread_over_seeds(full_run, capsys) -> None:
    """A record holding three seeds' losses: the demo's figures are their mean and sample
    std (computed here with statistics), on both sets, and the text shows both."""
    import statistics

    from engramrt_lab.cli.demo_model import print_losses
    from engramrt_lab.models.seeds import heldout_figures

    record = _record()
    per_seed = {
        split: {
            model: [value, value + 0.01 * (1 + i), value - 0.02 * (1 + i)]
            for i, (model, value) in enumerate(record[split]["losses"].items())
        }
        for split in ("heldout", "package_heldout")
    }
    record["heldout_seeds"] = {"seeds": [0, 1, 2], "steps": {}, "losses": per_seed}
    figures = heldout_figures(record)
    assert figures["seeds"] == 3
    for split, name in (("heldout", "stdlib"), ("package_heldout", "site-packages")):
        for model, values in per_seed[split].items():
            assert figures["loss"][name][model] == pytest.approx(statistics.mean(values), abs=1e-12)
            assert figures["spread"][name][model] == pytest.approx(
                statistics.stdev(values), abs=1e-12
            )
    print_losses(_result_with(full_run[1], figures))
    text = " ".join(capsys.readouterr().out.split())
    assert "mean ± sample std over 3 seeds" in text
    for name, models in figures["loss"].items():
        lowest = min(models, key=models.get)
        mean, std = models[lowest], figures["spread"][name][lowest]
        assert f"lowest on {name}: {lowest} ({mean:.4f} ± {std:.4f}, 3 seeds)" in text
        for model, value in models.items():  # the table's cells (wrapped at the console's width)
            assert f"{value:.4f}" in text and f"{figures['spread'][name][model]:.4f}" in text


def test_quick_default_with_a_one_token_prompt(tmp_path, monkeypatch) -> None:
    """The default evaluates part of the sample and says so (no check against the record);
    a prompt of one token still gets chunked prefill and a prefix-cache hit; no chart is
    written unless asked."""
    monkeypatch.chdir(tmp_path)
    code, result, _ = _demo("--text", "x", "--max-new-tokens", "4")
    assert code == 0 and all(c["passed"] for c in result["checks"])
    names = [c["name"] for c in result["checks"]]
    assert not any(name.endswith("_reproduced") for name in names)
    assert result["heldout_here"]["checked_against_record"] is False
    assert 0 < result["heldout_here"]["sequences"] < result["heldout_here"]["sample_sequences"]
    assert result["requests"][0]["prompt_tokens"] == 2  # document start + "x"
    assert "plot" not in result and list(tmp_path.iterdir()) == []

    # Independent of the demo's verdict: both requests' continuations recomputed here by
    # the eager reference, from prompts built here (B: A's first half, one 1-token block,
    # then the suffix), and B's prefix hit from the prompts' common prefix.
    from engramrt.lookup.tiers import TablePlacement
    from engramrt_lab.cli.demo_model import SECOND_REQUEST_SUFFIX
    from engramrt_lab.models.packaged import packaged_model_dir
    from engramrt_lab.models.serve import load_model

    # The same arithmetic as the demo's (the torch references): greedy tokens of a
    # kernel's result, equal only within its tolerance, may part at a near tie.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = load_model(
        packaged_model_dir(), TablePlacement("device", device="cpu"), load_baseline=False
    )
    prompt_a = model.encode("x")
    prompt_b = prompt_a[:1] + model.encode(SECOND_REQUEST_SUFFIX)[1:]
    common = next(
        (i for i, (a, b) in enumerate(zip(prompt_a, prompt_b, strict=False)) if a != b),
        min(len(prompt_a), len(prompt_b)),
    )
    assert common == 1
    for request, prompt in zip(result["requests"], (prompt_a, prompt_b), strict=True):
        assert request["prompt_tokens"] == len(prompt)
        want = model.reference_generate(prompt, 4).tokens
        assert len(want) == 4
        assert request["generated_text"] == model.decode(want)
    assert result["generated_text"] == result["requests"][0]["generated_text"]
    assert result["requests"][1]["prefix_hit_tokens"] == common


def test_model_demo_checks_fail_on_wrong_tokens_and_losses(monkeypatch) -> None:
    """Controls: a corrupted served token and a held-out loss off by 5% are both reported."""
    from engramrt_lab.models import serve

    real_generate = serve.TinyEngramModel.generate
    sample = _record()["heldout"]["sample_losses"]

    def corrupted_generate(self, prompts, max_new_tokens, **kwargs):
        result = real_generate(self, prompts, max_new_tokens, **kwargs)
        kept = self.vocab.token_ids
        result.tokens[0][-1] = next(t for t in kept if t != result.tokens[0][-1])
        return result

    def evaluate_off_by_5_percent(self, segments=None, *, model="engram", batch_size=8):
        return 1.05 * sample["engram_fp8" if model == "engram" else model]

    monkeypatch.setattr(serve.TinyEngramModel, "generate", corrupted_generate)
    monkeypatch.setattr(serve.TinyEngramModel, "evaluate", evaluate_off_by_5_percent)
    code, result, _ = _demo("--max-new-tokens", "4", "--full-eval")
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
        (["--checkpoint", "x.safetensors"], "--checkpoint is for --synthetic"),
        (["--config", "tiny"], "--config is for --synthetic"),
        (["--model", "/nonexistent"], "does not exist"),
        (["--max-new-tokens", "600"], "expected 4 to 512"),
        (["--plot", "/"], "--plot='/' is a directory"),
    ],
)
def test_model_demo_bad_input(capsys, args, needle) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--json", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "Traceback" not in err
    lines = err.strip().splitlines()  # at most the line saying what the demo does, then the error
    assert len(lines) <= 2 and lines[-1].startswith("error:")


def test_heldout_seen_leaves_out_a_set_the_record_does_not_split() -> None:
    """A record without a set's where-it-wins split (or without its ``4-gram seen``
    category) gives no row for that set, rather than an empty or made-up one."""
    from engramrt_lab.cli.demo_model import heldout_seen

    record = _record()
    assert set(heldout_seen(record)) == {"stdlib", "site-packages"}
    assert set(heldout_seen({**record, "where_it_wins_package": None})) == {"stdlib"}
    stdlib = {
        "longest_seen": {
            k: v for k, v in record["where_it_wins"]["longest_seen"].items() if k != "4-gram seen"
        }
    }
    assert heldout_seen({"where_it_wins": stdlib}) == {}


def test_the_seen_table_shows_the_engram_gates_only(monkeypatch) -> None:
    """The printed split has a column per model and one for the Engram model's gates; a
    memory-sweep model's losses get a column, its gates none."""
    from engramrt.cli._console import console
    from engramrt_lab.cli.demo_model import print_seen

    def row(n: int, loss: float) -> dict:
        return {
            "predictions": n,
            "share": 0.5,
            "engram": loss,
            "engram_x1": loss + 0.5,
            "engram gate (block 1)": 0.61,
            "engram gate (block 3)": 0.37,
            "engram_x1 gate (block 1)": 0.99,
        }

    split = {"stdlib": {"4-gram seen": row(30, 1.25), "4-gram unseen": row(10, 2.75)}}
    monkeypatch.setattr(console, "width", 160)  # no column cut short, whatever the terminal
    with console.capture() as captured:
        print_seen(split, seeds=1)
    text = captured.get()
    assert "engram_x1" in text and "gate, block 1 / 3" in text
    assert "0.61 / 0.37" in text and "0.99" not in text
    assert "75.0%" in text and "25.0%" in text  # shares from the counts
    assert "1.7500" in text and "3.2500" in text
