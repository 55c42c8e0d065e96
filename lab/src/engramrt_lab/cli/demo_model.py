"""``engramrt demo``: the shipped tiny Engram LM, served through the runtime and checked.

What is real here: the DeepSeek-V4 tokenizer, its token map and the exact
hashing; the model (:mod:`engramrt_lab.models.packaged`), trained on an H200 on
CPython's standard library sources, with its Engram tables converted to fp8
by ``engramrt convert``'s code; the prompt. Nothing is synthetic.

The demo:

1. generates greedily from the prompt through :class:`~engramrt.runtime.EngramRuntime`
   as an engine would (:meth:`TinyEngramModel.generate
   <engramrt_lab.models.serve.TinyEngramModel.generate>`): request A prefilled in
   chunks, decode steps, one speculative step whose drafts are rejected and
   rolled back; request B shares A's first KV blocks (a prefix-cache hit);
2. checks both requests' tokens against the eager reference of the same
   fp8 model (its greedy choice at every position from one full forward of
   prompt and continuation, no runtime, no KV cache, rows read from the
   checkpoint's bytes), and against a second placement (another tier with a
   hot-row cache in front, another history mode);
3. reports every model's loss on both held-out sets as the record holds
   them (:func:`~engramrt_lab.models.seeds.heldout_figures`): ``stdlib``, CPython
   standard-library files never trained on, and ``site-packages``, whole
   top-level packages (click, rich, typer) never trained on; over every seed
   the record holds (mean ± sample standard deviation) when it holds
   several, and names the lowest model of each set. Then it evaluates every
   served model on held-out sequences on this machine: the first
   :data:`QUICK_SEQUENCES` of the shipped (stdlib) sample by default, the
   whole sample with ``--full-eval``, which also compares each loss with
   the value recorded for the same sequences where the model was trained;
4. shows where the gate opens: per generated or prompt token, the gate of
   each Engram layer (mean over the hyper-connection streams).

``--json`` prints one JSON object instead of the tables (see :func:`run_model_demo`).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_PROMPT = (
    "import os\n"
    "import sys\n"
    "\n"
    "\n"
    "def main(argv=None):\n"
    '    """Parse the command line and run the program."""\n'
    "    if argv is None:\n"
    "        argv = sys.argv[1:]\n"
)
SECOND_REQUEST_SUFFIX = "\n\nclass Error(Exception):\n"
"""Request B: A's first whole KV blocks (about half its prompt), then this text."""

LOSS_TOLERANCE = 0.01
"""Relative difference allowed between the held-out loss measured here (fp32)
and the H200's record (bf16 autocast) for the same sequences and weights.

bf16 keeps 8 significant bits: each rounded matmul input is off by at most
2^-9 (0.2%) relative, and these errors, of either sign, average over the
sample's ~15,600 predictions; the H200 and CPU values of the shipped model
differ by 0.02%. 1% is five times the per-element rounding bound, while a
wrong table or weight file moves the loss by tens of percent (the tests
swap the tables to show it)."""

FP8_TARGET = 0.005
"""fp8 tables must keep the held-out loss within 0.5% of the float tables."""

QUICK_SEQUENCES = 8
"""Held-out sequences evaluated by default: a quarter of the shipped sample,
about two seconds per model on two CPU cores (``--full-eval``: all of it)."""

SERVED_AS = {"engram_fp8": "engram"}
"""Record names whose model :meth:`TinyEngramModel.evaluate` knows by another
name: the Engram model as served is the one with fp8 tables."""
NOT_SERVED = {
    "engram": "float tables: not shipped",
    "engram_fp8_served": "through the runtime where it was trained; the runtime's tokens are "
    "checked against the eager reference here instead",
}
"""Record names of models not shipped, so shown as recorded only."""


def _check(name: str, passed: bool, compared: str) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "compared": compared}


def _second_placement(tier: str, history: str) -> tuple[str, str]:
    """Another tier and history mode than the demo's, for the cross-check."""
    other_tier = "host" if tier != "host" else "device"
    other_history = "request" if history != "request" else "slot"
    return other_tier, other_history


def run_model_demo(
    *,
    text: str | None,
    device: str,
    tier: str,
    history: str,
    max_new_tokens: int,
    cache_mib: float,
    plot: Path | None,
    model_dir: Path | None,
    as_json: bool,
    full_eval: bool = False,
) -> dict[str, Any]:
    """Run the demo; returns (and prints) its result.

    The JSON object (``--json``) holds ``checks`` (``{name, passed,
    compared}``), ``prompt``, ``generated_text`` (request A's continuation),
    ``requests``, ``heldout_loss`` (``{set: {model: loss}}``: every model's
    loss on each held-out set, ``"stdlib"`` and ``"site-packages"``, as
    recorded where it was trained; the mean over the seeds when the record
    holds several), ``heldout_spread`` (the same shape: the sample standard
    deviation over the seeds, None for one seed), ``seeds`` (how many seeds
    the figures rest on), ``heldout_lowest`` (``{set: model}``, the lowest
    mean), ``heldout_sets`` (``{set: {what, sequences, predictions}}``),
    ``heldout_loss_here`` (the models evaluated on this machine, on
    ``heldout_here["sequences"]`` sequences of the shipped stdlib sample),
    ``heldout_sample_recorded`` (the record's losses on the whole sample),
    ``heldout_seen`` (each set's losses and gates where training saw the predicted
    token's 4-gram and where not: :func:`heldout_seen`), ``gates``, ``tier``,
    ``history``, ``device``, ``data`` (what is real),
    ``training`` (the record: its path-free command, the corpus, the steps),
    ``plot`` (the chart's absolute path, with ``--plot``) and ``seconds``.
    """
    from engramrt.cli._console import console, err_console
    from engramrt.cli._stages import Stages
    from engramrt.errors import EngramError

    began = time.perf_counter()
    _check_options(max_new_tokens, cache_mib, plot, model_dir)
    stages = Stages(err_console if as_json else console)
    sequences = "the whole shipped held-out sample" if full_eval else "a held-out sample"
    stages.say(
        "[bold]engramrt demo[/]: serving the tiny Engram LM shipped with engramrt-lab through "
        "EngramRuntime (2 requests, as an engine would), checking its tokens against an eager "
        f"reference and a second placement, then the held-out loss of each model on {sequences}"
    )
    with stages.stage("loading torch"):
        import numpy as np

        from engramrt.cli._checks import parse_device
        from engramrt.lookup.tiers import TIERS, TablePlacement
        from engramrt_lab.models.packaged import packaged_model_dir
        from engramrt_lab.models.serve import HISTORY_MODES, load_model

        tiers = ["auto", *(name for name in TIERS if name != "synthetic")]  # real rows only
        if tier not in tiers:
            raise EngramError(f"--tier={tier!r}; expected one of {', '.join(tiers)}")
        if history not in HISTORY_MODES:
            raise EngramError(f"--history={history!r}; expected one of {', '.join(HISTORY_MODES)}")
        dev = parse_device("--device", device, allow_auto=True)
    directory = model_dir if model_dir is not None else packaged_model_dir()
    prompt_text = DEFAULT_PROMPT if text is None else text

    with tempfile.TemporaryDirectory(prefix="engramrt-demo-") as scratch, _one_thread():
        with stages.stage(f"loading the model, its fp8 tables (tier {tier}) and the tokenizer"):
            model = load_model(
                directory,
                TablePlacement(tier, device=dev, disk_dir=Path(scratch) / "a"),
                cache_mib=cache_mib,
            )
            served = getattr(model.stores[0], "backing", model.stores[0])  # behind a cache
            tier = str(getattr(served, "tier", tier))  # "auto" resolved
            prompt_a = model.encode(prompt_text)
        chunk, block = _schedule(len(prompt_a))
        cut = (len(prompt_a) // 2) // block * block
        prompt_b = prompt_a[:cut] + model.encode(SECOND_REQUEST_SUFFIX)[1:]

        def serve(served_model: Any, history_mode: str) -> Any:  # both requests, one schedule
            return served_model.generate(
                [prompt_a, prompt_b],
                max_new_tokens,
                history=history_mode,
                chunk_size=chunk,
                block_size=block,
            )

        with stages.stage(
            f"generating {max_new_tokens} tokens for each of 2 requests through EngramRuntime "
            f"(tier {tier}, history {history})"
        ):
            result = serve(model, history)
        with stages.stage("the eager reference: one full forward per request"):
            references = [
                model.reference_check(p, tokens)
                for p, tokens in zip((prompt_a, prompt_b), result.tokens, strict=True)
            ]

        other_tier, other_history = _second_placement(tier, history)
        with stages.stage(
            f"the same requests again: tier {other_tier} behind a hot-row cache, "
            f"history {other_history}"
        ):
            other = load_model(
                directory,
                TablePlacement(other_tier, device=dev, disk_dir=Path(scratch) / "b"),
                cache_mib=max(cache_mib, 1.0),
                load_baseline=False,
                token_map=model.token_map,
            )
            again = serve(other, other_history)

        recorded = model.record["heldout"]
        recorded_sample = recorded.get("sample_losses", {})
        here, part = _heldout_here(model, stages, recorded_sample, full_eval)
        count = part.num_sequences

    checks = _served_checks(
        result,
        again=again,
        references=references,
        placements=((tier, history), (other_tier, other_history)),
        chunk=chunk,
        block=block,
    )
    checks += _loss_checks(recorded, recorded_sample, here, count=count, full_eval=full_eval)

    sequence = prompt_a + result.tokens[0]
    gates = np.asarray(result.gates[0])  # [positions, L]
    layer_ids = list(model.lm_config.engram_layer_ids)
    pieces = [model.decode([t]) for t in sequence[: gates.shape[0]]]
    out = _report(
        model,
        directory=directory,
        placement=(tier, history, str(dev)),
        prompts=(prompt_text, prompt_a, prompt_b),
        result=result,
        checks=checks,
        heldout=(here, count, part.num_predictions, full_eval),
        gates=(layer_ids, pieces, gates),
    )
    if plot is not None:
        with stages.stage("writing the gate chart"):
            _write_gate_chart(plot, pieces, gates, layer_ids, len(prompt_a))
        out["plot"] = str(plot.resolve())
    out["seconds"] = round(time.perf_counter() - began, 1)
    if as_json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        _print_tables(out, gates, pieces, len(prompt_a))
    return out


def _check_options(
    max_new_tokens: int, cache_mib: float, plot: Path | None, model_dir: Path | None
) -> None:
    """Refuse the demo's options that cannot run, naming the flag."""
    from engramrt.cli._checks import check_output_path
    from engramrt.errors import EngramError

    if not 4 <= max_new_tokens <= 512:
        raise EngramError(
            f"--max-new-tokens={max_new_tokens}; expected 4 to 512 (a speculative step with "
            f"two drafts runs among the decode steps)"
        )
    if not 0 <= cache_mib < 2**40:
        raise EngramError(f"--cache-mib={cache_mib}; expected a finite size in MiB >= 0")
    if plot is not None:
        check_output_path("--plot", plot)
    if model_dir is not None and not (Path(model_dir) / "model.json").is_file():
        raise EngramError(
            f"--model={str(model_dir)!r} holds no model.json (or does not exist); expected a "
            f"directory written by python -m engramrt_lab.models.train"
        )


def _heldout_here(
    model: Any, stages: Any, recorded_sample: dict[str, Any], full_eval: bool
) -> tuple[dict[str, float], Any]:
    """The held-out loss, on this machine, of every served model the record holds a sample
    loss for, on the whole shipped sample (``full_eval``) or its first sequences; returns
    ``({name: loss}, the sequences evaluated)``."""
    from engramrt.errors import ValidationError

    sample = model.sample
    count = sample.num_sequences if full_eval else min(QUICK_SEQUENCES, sample.num_sequences)
    part = sample.subset(range(count))
    here: dict[str, float] = {}
    for name in recorded_sample:
        if name in NOT_SERVED:
            continue
        with stages.stage(
            f"held-out loss of {name} on {count} of {sample.num_sequences} sample "
            f"sequences ({part.num_predictions:,} predictions)"
        ):
            try:
                here[name] = model.evaluate(part, model=SERVED_AS.get(name, name))
            except ValidationError:  # a model of the record this loader does not load
                continue
    return here, part


def _served_checks(
    result: Any,
    *,
    again: Any,
    references: list[Any],
    placements: tuple[tuple[str, str], tuple[str, str]],
    chunk: int,
    block: int,
) -> list[dict[str, Any]]:
    """The checks of the served tokens: against the eager reference, a second placement,
    and that the schedule did what an engine does."""
    (tier, history), (other_tier, other_history) = placements
    kinds = [s["kind"] for s in result.steps]
    return [
        _check(
            "runtime_matches_eager_reference",
            result.tokens == [r.tokens for r in references],
            f"greedy tokens of both requests served through EngramRuntime (tier {tier}, history "
            f"{history}) vs the eager reference of the same fp8 model's greedy choice at every "
            f"position (one full forward of prompt and continuation, row ids from "
            f"hash_sequence, rows from the checkpoint's bytes, no runtime, no KV cache)",
        ),
        _check(
            "second_placement_matches",
            again.tokens == result.tokens,
            f"the same requests served again with tier {other_tier} behind a hot-row cache and "
            f"history {other_history}: identical tokens",
        ),
        _check(
            "engine_schedule_exercised",
            kinds.count("prefill") > 1
            and result.prefix_hit_tokens[1] > 0
            and result.rejected_drafts > 0,
            f"the schedule did what an engine does: {kinds.count('prefill')} prefill chunks "
            f"of up to {chunk} tokens, a prefix-cache hit of "
            f"{result.prefix_hit_tokens[1]} tokens ({block}-token blocks) for "
            f"request B, {result.rejected_drafts} draft tokens rejected and rolled back, "
            f"{kinds.count('decode')} decode steps",
        ),
    ]


def _loss_checks(
    recorded: dict[str, Any],
    recorded_sample: dict[str, Any],
    here: dict[str, float],
    *,
    count: int,
    full_eval: bool,
) -> list[dict[str, Any]]:
    """The held-out losses reproduced (``full_eval``) and the fp8 tables' recorded cost."""
    checks: list[dict[str, Any]] = []
    if full_eval:
        for name, got in here.items():
            want = float(recorded_sample[name])
            checks.append(
                _check(
                    f"heldout_loss_{name}_reproduced",
                    abs(got - want) <= LOSS_TOLERANCE * want,
                    f"{name} loss on the shipped held-out sample ({count} sequences) here, "
                    f"{got:.4f}, vs the training machine's record, {want:.4f} (within "
                    f"{LOSS_TOLERANCE:.0%}: bf16 there, fp32 here)",
                )
            )
    fp8_rel = float(recorded["fp8_vs_float_relative"])
    checks.append(
        _check(
            "fp8_tables_within_half_percent",
            abs(fp8_rel) <= FP8_TARGET,
            f"recorded where the model was trained: held-out loss with the fp8 tables vs the "
            f"float tables, {fp8_rel:+.4%} (target within {FP8_TARGET:.1%}; "
            f"{recorded['predictions']:,} predictions)",
        )
    )
    return checks


def _report(
    model: Any,
    *,
    directory: Path,
    placement: tuple[str, str, str],
    prompts: tuple[str, list[int], list[int]],
    result: Any,
    checks: list[dict[str, Any]],
    heldout: tuple[dict[str, float], int, int, bool],
    gates: tuple[list[int], list[str], Any],
) -> dict[str, Any]:
    """The demo's JSON object (see :func:`run_model_demo`), less ``plot`` and ``seconds``."""
    import numpy as np

    from engramrt_lab.models.seeds import heldout_figures

    tier, history, device = placement
    prompt_text, prompt_a, prompt_b = prompts
    here, count, predictions, full_eval = heldout
    layer_ids, pieces, gate_values = gates
    record = model.record
    recorded = record["heldout"]
    recorded_sample = recorded.get("sample_losses", {})
    corpus = record["corpus"]
    figures = heldout_figures(record)
    losses = figures["loss"]
    trained = [name for name in recorded["losses"] if isinstance(record.get(name), dict)]
    return {
        "model": str(directory),
        "data": {
            "real": "tokenizer (DeepSeek-V4), token map, hashing, the trained weights and fp8 "
            "tables, the prompt, the held-out sample (CPython "
            f"{corpus['python_version']} stdlib files never trained on)",
            "synthetic": "nothing",
        },
        "tier": tier,
        "history": history,
        "device": device,
        "prompt": prompt_text,
        "generated_text": model.decode(result.tokens[0]),
        "requests": [
            {
                "prompt_tokens": len(p),
                "generated_text": model.decode(toks),
                "prefix_hit_tokens": hit,
            }
            for p, toks, hit in zip(
                (prompt_a, prompt_b), result.tokens, result.prefix_hit_tokens, strict=True
            )
        ],
        "checks": checks,
        "heldout_loss": losses,
        "heldout_spread": figures["spread"],
        "seeds": figures["seeds"],
        "heldout_lowest": {
            name: min(models, key=models.__getitem__) for name, models in losses.items()
        },
        "heldout_sets": _heldout_sets(record),
        "heldout_loss_here": {k: round(float(v), 6) for k, v in here.items()},
        "heldout_here": {
            "set": "stdlib",
            "sequences": count,
            "sample_sequences": model.sample.num_sequences,
            "predictions": predictions,
            "checked_against_record": full_eval,
        },
        "heldout_sample_recorded": {k: float(v) for k, v in recorded_sample.items()},
        "heldout_seen": heldout_seen(record),
        "gates": {
            "layers": layer_ids,
            "tokens": pieces,
            "values": np.round(gate_values, 4).tolist(),
        },
        "training": {
            "command": record.get("command"),
            "corpus": corpus,
            "device": record.get("device"),
            "steps": {name: record[name]["steps"] for name in trained},
            "kept_steps": {name: record[name].get("kept_step") for name in trained},
            "tokens_seen": {name: record[name].get("tokens_seen") for name in trained},
            "seconds": {name: record[name].get("seconds") for name in trained},
        },
    }


def heldout_seen(record: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{set: {"4-gram seen" | "4-gram unseen": {predictions, share, model: loss,
    "engram gate (block B)": gate}}}``: each held-out set's predictions split by whether
    training saw the 4-gram ending at the predicted token, from the record's where-it-wins
    split of that set (this model's seed; :func:`~engramrt_lab.models.seeds.seen_view`);
    a set whose split the record lacks is left out."""
    from engramrt_lab.models.seeds import HELDOUT_SET_NAMES, seen_view
    from engramrt_lab.models.train import WHERE_IT_WINS

    split = {}
    for key, name in HELDOUT_SET_NAMES.items():
        wins = record.get(WHERE_IT_WINS[key])
        longest = wins.get("longest_seen") if isinstance(wins, dict) else None
        view = seen_view(longest) if isinstance(longest, dict) else None
        if view is not None:
            split[name] = view
    return split


def _heldout_sets(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What each held-out set of the record is: ``{set: {what, sequences, predictions}}``."""
    from engramrt_lab.models.seeds import HELDOUT_SET_NAMES

    corpus = record["corpus"]
    what = {
        "heldout": f"{corpus.get('heldout_files', '?')} files of CPython "
        f"{corpus.get('python_version', '?')}'s standard library never trained on "
        f"(held out by {str(corpus.get('heldout_rule', 'a hash of the path')).split(': ')[-1]})",
        "package_heldout": "the top-level packages "
        f"{', '.join((record.get('package_heldout') or {}).get('packages', []))} of "
        f"site-packages, never trained on ({corpus.get('package_heldout_files', '?')} files)",
    }
    return {
        name: {
            "what": what[split],
            "sequences": record[split]["sequences"],
            "predictions": record[split]["predictions"],
        }
        for split, name in HELDOUT_SET_NAMES.items()
        if isinstance(record.get(split), dict)
    }


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch on one thread for the demo's work, then as it was.

    The model is small (256 wide; a decode step is one token), so extra
    threads buy little, and on a machine whose cores are busy torch's worker
    threads wait for them: the demo then runs several times slower on two
    threads than on one (measurements in BENCHMARKS.md, "The demo on a shared CPU").
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _schedule(prompt_tokens: int) -> tuple[int, int]:
    """Chunk and block sizes that give any prompt of two tokens or more (the document-start
    token and one of text) at least two prefill chunks and request B a prefix-cache hit of
    one whole block or more: ``(chunk_size, block_size)``, 16 and 8 tokens, smaller for
    short prompts."""
    half = max(1, prompt_tokens // 2)
    block = next(b for b in (8, 4, 2, 1) if b <= half)
    return min(16, -(-prompt_tokens // 2)), block


def _print_tables(out: dict[str, Any], gates: Any, pieces: list[str], prompt_len: int) -> None:
    import numpy as np
    from rich.table import Table
    from rich.text import Text

    from engramrt.cli._console import console

    training = out["training"]
    console.print(
        f"[bold]the model[/]: the tiny Engram LM shipped with engramrt-lab (trained on "
        f"{training['device']} on CPython {training['corpus']['python_version']}'s standard "
        f"library and site-packages sources; fp8 tables), served with tier {out['tier']}, "
        f"history {out['history']}, device {out['device']}"
    )
    console.print(f"real: {out['data']['real']}; synthetic: {out['data']['synthetic']}")
    console.print("[bold]prompt[/] (request A):")
    console.print(Text(out["prompt"], style="dim"))
    console.print("[bold]continuation[/] (greedy, through EngramRuntime):")
    console.print(Text(out["generated_text"], style="green"))

    where = Table(
        title="where the gate opens: the tokens with the highest gate (mean of both layers; "
        "g = 0 keeps the memory out, 1 lets it in fully)",
        title_justify="left",
    )
    for name in ("pos", "token", "context", *[f"gate L{i}" for i in out["gates"]["layers"]]):
        where.add_column(name)
    mean = gates.mean(axis=1)
    for p in np.argsort(-mean, kind="stable")[:10]:
        context = "".join(pieces[max(0, p - 4) : p + 1])
        where.add_row(
            str(int(p)) + ("" if p < prompt_len else "*"),
            repr(pieces[p]),
            repr(context),
            *[f"{gates[p, i]:.2f}" for i in range(gates.shape[1])],
        )
    console.print(where)
    console.print(
        f"gate over all {gates.shape[0]} positions: mean "
        + ", ".join(
            f"L{lid} {gates[:, i].mean():.2f}" for i, lid in enumerate(out["gates"]["layers"])
        )
        + " (* = a generated token)"
    )

    print_losses(out)
    steps = ", ".join(f"{name} {count}" for name, count in training["steps"].items())
    kept = ", ".join(f"{name} {step}" for name, step in training["kept_steps"].items())
    console.print(
        f"trained steps per model: {steps}; each keeps its step of lowest validation loss "
        f"({kept}); trained by: {training['command']}",
        highlight=False,
    )

    checks = Table(title="checks: what each compared", title_justify="left")
    checks.add_column("check")
    checks.add_column("passed")
    checks.add_column("compared")
    for c in out["checks"]:
        checks.add_row(c["name"], "yes" if c["passed"] else "[red]NO[/]", c["compared"])
    console.print(checks)
    if "plot" in out:
        console.print(f"chart: {out['plot']}", highlight=False, soft_wrap=True, markup=False)
    console.print(f"{out['seconds']} s")


def print_losses(out: dict[str, Any]) -> None:
    """The held-out losses: every model on both held-out sets as recorded (with the spread
    over the seeds when there are several), the lowest of each set in words, and the
    losses measured here."""
    from rich.table import Table

    from engramrt.cli._console import console

    recorded, spreads, seeds = out["heldout_loss"], out["heldout_spread"], out["seeds"]
    sets = out["heldout_sets"]
    sample = out["heldout_sample_recorded"]
    here = out["heldout_loss_here"]
    counted = out["heldout_here"]
    over = (
        f"mean ± sample std over {seeds} seeds"
        if seeds > 1
        else "one seed: no spread to show; python -m engramrt_lab.models.seeds gives it"
    )
    table = Table(
        title=f"held-out loss (nats / token; lower is better; {over})", title_justify="left"
    )
    table.add_column("model")
    for name in recorded:
        table.add_column(f"{name} ({sets[name]['predictions']:,} predictions)", justify="right")
    table.add_column(
        f"stdlib sample, recorded ({counted['sample_sequences']} sequences)", justify="right"
    )
    table.add_column(
        f"here, {counted['sequences']} of {counted['sample_sequences']} sample sequences",
        justify="right",
    )
    models = dict.fromkeys([*(m for s in recorded.values() for m in s), *sample, *here])
    for model in models:
        table.add_row(
            model,
            *(_mean_and_spread(recorded[s].get(model), spreads[s].get(model)) for s in recorded),
            f"{sample[model]:.4f}" if model in sample else "—",
            f"{here[model]:.4f}" if model in here else NOT_SERVED.get(model, "—"),
        )
    console.print(table)
    for name, what in sets.items():
        console.print(f"{name}: {what['what']}", highlight=False)
    for name, losses in recorded.items():
        lowest = out["heldout_lowest"][name]
        others = ", ".join(
            f"{model} {value:.4f} ({value / losses[lowest] - 1:+.1%})"
            for model, value in sorted(losses.items(), key=lambda item: item[1])
            if model != lowest
        )
        console.print(
            f"[bold]lowest on {name}: {lowest}[/] "
            f"({_mean_and_spread(losses[lowest], spreads[name][lowest])}"
            f"{f', {seeds} seeds' if seeds > 1 else ''}); then {others}"
        )
    print_seen(out["heldout_seen"], seeds)
    if here:
        best_here = min(here, key=here.__getitem__)
        console.print(
            f"lowest here, on {counted['sequences']} stdlib sample sequences: {best_here} "
            f"({here[best_here]:.4f})"
        )
    if not counted["checked_against_record"]:
        console.print(
            "the losses here are not checked against the record: they cover part of the "
            "sample; --full-eval evaluates all of it and checks each model within "
            f"{LOSS_TOLERANCE:.0%}"
        )


def print_seen(split: dict[str, dict[str, dict[str, Any]]], seeds: int) -> None:
    """The held-out losses split by whether training saw the predicted token's 4-gram,
    with the Engram model's gates (mean of its streams) at each Engram block; the gates of
    other Engram models a record may hold (a memory sweep's) are left out."""
    from rich.table import Table

    from engramrt.cli._console import console
    from engramrt_lab.models.wins import gate_column_parts

    if not split:
        return
    rows = [row for view in split.values() for row in view.values()]
    columns = dict.fromkeys(c for row in rows for c in row if c not in ("predictions", "share"))
    parts = {c: gate_column_parts(c) for c in columns}
    models = [c for c, gate in parts.items() if gate is None]
    gates = {c: str(gate[1]) for c, gate in parts.items() if gate and gate[0] == "engram"}
    table = Table(
        title="held-out loss where training saw the 4-gram ending at the predicted token, "
        f"and where it did not{' (seed of this model)' if seeds > 1 else ''}",
        title_justify="left",
    )
    for name in ("set", "4-gram", "share", *models):
        table.add_column(name, justify="left" if name in ("set", "4-gram") else "right")
    if gates:
        table.add_column(f"gate, block {' / '.join(gates.values())}", justify="right")
    for name, view in split.items():
        total = sum(row["predictions"] for row in view.values())
        for category, row in view.items():
            lowest = min((m for m in models if m in row), key=row.__getitem__, default=None)
            table.add_row(
                name,
                category.removeprefix("4-gram "),
                f"{row['predictions'] / total:.1%}",
                *(
                    "—"
                    if m not in row
                    else f"[bold]{row[m]:.4f}[/]"
                    if m == lowest
                    else f"{row[m]:.4f}"
                    for m in models
                ),
                *(
                    [" / ".join(f"{row[g]:.2f}" if g in row else "—" for g in gates)]
                    if gates
                    else []
                ),
            )
    console.print(table)


def _mean_and_spread(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "—"
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def _write_gate_chart(
    path: Path, pieces: list[str], gates: Any, layer_ids: list[int], prompt_len: int
) -> None:
    """The gate of each Engram layer per token (prompt, then the continuation)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import warnings

    import matplotlib.pyplot as plt
    import numpy as np

    from engramrt.cli._checks import write_output

    count = gates.shape[0]
    fig, ax = plt.subplots(figsize=(max(8, count * 0.2), 3.2))
    image = ax.imshow(gates.T, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.axvline(prompt_len - 0.5, color="white", linewidth=1.5)
    ax.set_yticks(np.arange(len(layer_ids)))
    ax.set_yticklabels([f"layer {i}" for i in layer_ids])
    ax.set_xticks(np.arange(count))
    ax.set_xticklabels([repr(p)[1:-1] for p in pieces], rotation=90, fontsize=6)
    ax.set_title("tiny Engram LM: gate per token (mean over streams); right of the line: generated")
    fig.colorbar(image, ax=ax, fraction=0.02)
    buf = io.BytesIO()
    with warnings.catch_warnings():  # the document-start token's full-width bars: no glyph
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_output("--plot", path, buf.getvalue())
