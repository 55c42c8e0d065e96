"""``engramrt demo``: the shipped tiny Engram LM, served through the runtime and checked.

What is real here: the DeepSeek-V4 tokenizer, its token map and the exact
hashing; the model (:mod:`engramrt.models.packaged`), trained on an H200 on
CPython's standard library sources, with its Engram tables converted to fp8
by ``engramrt convert``'s code; the prompt. Nothing is synthetic.

The demo:

1. generates greedily from the prompt through :class:`~engramrt.runtime.EngramRuntime`
   as an engine would (:meth:`TinyEngramModel.generate
   <engramrt.models.serve.TinyEngramModel.generate>`): request A prefilled in
   chunks, decode steps, one speculative step whose drafts are rejected and
   rolled back; request B shares A's first KV blocks (a prefix-cache hit);
2. checks both requests' tokens against the eager reference of the same
   fp8 model (its greedy choice at every position from one full forward of
   prompt and continuation, no runtime, no KV cache, rows read from the
   checkpoint's bytes), and against a second placement (another tier with a
   hot-row cache in front, another history mode);
3. evaluates the held-out sample on this machine (fp8 model and baseline)
   and compares with the values the H200 recorded for the same sequences;
4. shows where the gate opens: per generated or prompt token, the gate of
   each Engram layer (mean over the hyper-connection streams).

``--json`` prints one JSON object instead of the tables (see :func:`run_model_demo`).
"""

from __future__ import annotations

import json
import tempfile
import time
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
) -> dict[str, Any]:
    """Run the demo; returns (and prints) its result.

    The JSON object (``--json``) holds ``checks`` (``{name, passed,
    compared}``), ``prompt``, ``generated_text`` (request A's continuation),
    ``requests``, ``heldout_loss`` (``{engram, baseline, engram_fp8}``: the
    H200's record on the full held-out set), ``heldout_loss_here`` (this
    machine, the shipped sample), ``gates``, ``tier``, ``history``,
    ``device``, ``data`` (what is real) and ``training`` (the record).
    """
    import numpy as np

    from engramrt.cli._checks import check_output_path, parse_device
    from engramrt.errors import EngramError
    from engramrt.lookup.tiers import TIERS
    from engramrt.models.packaged import packaged_model_dir
    from engramrt.models.serve import HISTORY_MODES, load_model

    began = time.perf_counter()
    tiers = ["auto", *(name for name in TIERS if name != "synthetic")]  # real rows only
    if tier not in tiers:
        raise EngramError(f"--tier={tier!r}; expected one of {', '.join(tiers)}")
    if history not in HISTORY_MODES:
        raise EngramError(f"--history={history!r}; expected one of {', '.join(HISTORY_MODES)}")
    if not 4 <= max_new_tokens <= 512:
        raise EngramError(
            f"--max-new-tokens={max_new_tokens}; expected 4 to 512 (a speculative step with "
            f"two drafts runs among the decode steps)"
        )
    if not 0 <= cache_mib < 2**40:
        raise EngramError(f"--cache-mib={cache_mib}; expected a finite size in MiB >= 0")
    if plot is not None:
        check_output_path("--plot", plot)
    dev = parse_device("--device", device, allow_auto=True)
    directory = model_dir if model_dir is not None else packaged_model_dir()
    prompt_text = DEFAULT_PROMPT if text is None else text

    with tempfile.TemporaryDirectory(prefix="engramrt-demo-") as scratch:
        model = load_model(
            directory,
            tier=tier,
            device=dev,
            cache_mib=cache_mib,
            disk_dir=Path(scratch) / "a" if tier == "disk" else None,
        )
        served = getattr(model.stores[0], "backing", model.stores[0])  # the tier behind a cache
        tier = str(getattr(served, "tier", tier))  # "auto" resolved
        block = 8
        prompt_a = model.encode(prompt_text)
        if len(prompt_a) < 2 * block:
            raise EngramError(
                f"the prompt has {len(prompt_a)} tokens; the demo needs at least {2 * block} "
                f"(its second request shares whole {block}-token blocks of it)"
            )
        cut = (len(prompt_a) // 2) // block * block
        prompt_b = prompt_a[:cut] + model.encode(SECOND_REQUEST_SUFFIX)[1:]
        result = model.generate(
            [prompt_a, prompt_b], max_new_tokens, history=history, block_size=block
        )
        references = [
            model.reference_check(p, tokens)
            for p, tokens in zip((prompt_a, prompt_b), result.tokens, strict=True)
        ]

        other_tier, other_history = _second_placement(tier, history)
        other = load_model(
            directory,
            tier=other_tier,
            device=dev,
            cache_mib=max(cache_mib, 1.0),
            load_baseline=False,
            token_map=model.token_map,
            disk_dir=Path(scratch) / "b" if other_tier == "disk" else None,
        )
        again = other.generate(
            [prompt_a, prompt_b], max_new_tokens, history=other_history, block_size=block
        )

        here = {
            "engram_fp8": model.evaluate(model="engram"),
            "baseline": model.evaluate(model="baseline"),
        }
    record = model.record
    recorded = record["heldout"]
    recorded_sample = recorded["sample_losses"]

    kinds = [s["kind"] for s in result.steps]
    checks = [
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
            f"the schedule did what an engine does: {kinds.count('prefill')} prefill chunks, "
            f"a prefix-cache hit of {result.prefix_hit_tokens[1]} tokens for request B, "
            f"{result.rejected_drafts} draft tokens rejected and rolled back, "
            f"{kinds.count('decode')} decode steps",
        ),
    ]
    for name in ("engram_fp8", "baseline"):
        want = float(recorded_sample[name])
        got = float(here[name])
        checks.append(
            _check(
                f"heldout_loss_{name}_reproduced",
                abs(got - want) <= LOSS_TOLERANCE * want,
                f"{name} loss on the shipped held-out sample ({model.sample.num_sequences} "
                f"sequences) here, {got:.4f}, vs the H200's record, {want:.4f} "
                f"(within {LOSS_TOLERANCE:.0%}: bf16 there, fp32 here)",
            )
        )
    fp8_rel = float(recorded["fp8_vs_float_relative"])
    checks.append(
        _check(
            "fp8_tables_within_half_percent",
            abs(fp8_rel) <= FP8_TARGET,
            f"recorded on the H200: held-out loss with the fp8 tables vs the float tables, "
            f"{fp8_rel:+.4%} (target within {FP8_TARGET:.1%}; {recorded['predictions']:,} "
            f"predictions)",
        )
    )

    sequence = prompt_a + result.tokens[0]
    gates = np.asarray(result.gates[0])  # [positions, L]
    layer_ids = list(model.lm_config.engram_layer_ids)
    pieces = [model.decode([t]) for t in sequence[: gates.shape[0]]]
    generated_text = model.decode(result.tokens[0])
    corpus = record["corpus"]
    out: dict[str, Any] = {
        "model": str(directory),
        "data": {
            "real": "tokenizer (DeepSeek-V4), token map, hashing, the trained weights and fp8 "
            "tables, the prompt, the held-out sample (CPython "
            f"{corpus['python_version']} stdlib files never trained on)",
            "synthetic": "nothing",
        },
        "tier": tier,
        "history": history,
        "device": str(dev),
        "prompt": prompt_text,
        "generated_text": generated_text,
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
        "heldout_loss": {
            k: float(recorded["losses"][k]) for k in ("engram", "baseline", "engram_fp8")
        },
        "heldout_loss_here": {k: round(float(v), 6) for k, v in here.items()},
        "heldout_sample_recorded": {k: float(v) for k, v in recorded_sample.items()},
        "gates": {
            "layers": layer_ids,
            "tokens": pieces,
            "values": np.round(gates, 4).tolist(),
        },
        "training": {
            "corpus": corpus,
            "device": record.get("device"),
            "steps": record["engram"]["steps"],
            "kept_steps": {
                "engram": record["engram"].get("kept_step"),
                "baseline": record["baseline"].get("kept_step"),
            },
            "tokens_seen": record["engram"]["tokens_seen"],
            "seconds": {
                "engram": record["engram"]["seconds"],
                "baseline": record["baseline"]["seconds"],
            },
            "heldout_predictions": recorded["predictions"],
        },
    }
    if plot is not None:
        _write_gate_chart(plot, pieces, gates, layer_ids, len(prompt_a))
        out["plot"] = str(plot)
    out["seconds"] = round(time.perf_counter() - began, 1)
    if as_json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        _print_tables(out, gates, pieces, len(prompt_a))
    return out


def _print_tables(out: dict[str, Any], gates: Any, pieces: list[str], prompt_len: int) -> None:
    import numpy as np
    from rich.table import Table
    from rich.text import Text

    from engramrt.cli import console

    training = out["training"]
    console.print(
        f"[bold]engramrt demo[/]: the tiny Engram LM shipped with engramrt (trained on an H200 "
        f"on CPython {training['corpus']['python_version']} stdlib sources; fp8 tables), "
        f"tier {out['tier']}, history {out['history']}, device {out['device']}"
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

    losses = Table(title="held-out loss (nats / token)", title_justify="left")
    for name in ("model", "H200 record, full held-out", "sample, H200", "sample, here"):
        losses.add_column(name, justify="right")
    recorded = out["heldout_loss"]
    here = out["heldout_loss_here"]
    for name in ("engram", "engram_fp8", "baseline"):
        losses.add_row(
            name,
            f"{recorded[name]:.4f}",
            f"{out['heldout_sample_recorded'][name]:.4f}",
            f"{here[name]:.4f}" if name in here else "—",
        )
    console.print(losses)
    console.print(
        f"trained {training['steps']} steps per model ({training['tokens_seen']:,} tokens); each "
        f"keeps its step of lowest validation loss (engram {training['kept_steps']['engram']}, "
        f"baseline {training['kept_steps']['baseline']}); held-out: "
        f"{training['heldout_predictions']:,} predictions"
    )

    checks = Table(title="checks: what each compared", title_justify="left")
    checks.add_column("check")
    checks.add_column("passed")
    checks.add_column("compared")
    for c in out["checks"]:
        checks.add_row(c["name"], "yes" if c["passed"] else "[red]NO[/]", c["compared"])
    console.print(checks)
    if "plot" in out:
        console.print(f"chart: {out['plot']}")
    console.print(f"{out['seconds']} s")


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
