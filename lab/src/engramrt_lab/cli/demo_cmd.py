"""``engramrt demo``: the shipped tiny Engram LM (default) or the V4.1 layout on synthetic rows.

The default (:mod:`engramrt_lab.cli.demo_model`) serves a real trained model
through the runtime and checks it; ``--synthetic``
(:mod:`engramrt_lab.cli.demo_synthetic`) streams a text through the real
V4.1-Flash layout with synthetic rows and random weights.

Options one demo does not use are refused, not ignored: the defaults below
are None so that an option given on the command line can be told apart from
one left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

MODEL_ONLY = ("--history", "--max-new-tokens", "--model", "--json", "--full-eval")
"""Options of the model demo that ``--synthetic`` refuses."""
SYNTHETIC_ONLY = ("--config", "--checkpoint")
"""Options of ``--synthetic`` that the model demo refuses."""


def _resolve_text(text: str | None, file: Path | None) -> str | None:
    """The text from ``--text`` or ``--file`` (None: the demo's own); empty is an error."""
    from engramrt.cli._checks import read_text
    from engramrt.errors import EngramError

    if text is not None and file is not None:
        raise EngramError("give --text or --file, not both")
    if file is not None:
        text = read_text("--file", file)
        if not text.strip():
            raise EngramError(f"--file={str(file)!r} holds no text; expected the text to stream")
    elif text is not None and not text.strip():
        raise EngramError(f"--text={text!r} is empty; give a text or leave --text out")
    return text


def _refuse(given: dict[str, bool], names: tuple[str, ...], why: str) -> None:
    from engramrt.errors import EngramError

    used = [name for name in names if given[name]]
    if used:
        raise EngramError(f"{', '.join(used)} {'is' if len(used) == 1 else 'are'} {why}")


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        synthetic: Annotated[
            bool,
            typer.Option(
                "--synthetic",
                help="The V4.1-Flash layout on synthetic rows and random weights instead of "
                "the shipped model.",
            ),
        ] = False,
        text: Annotated[
            str | None,
            typer.Option(help="The prompt (model) or text to stream (--synthetic)."),
        ] = None,
        file: Annotated[Path | None, typer.Option(help="Read the text from a file.")] = None,
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
        tier: Annotated[
            str | None,
            typer.Option(
                help="Where the tables live: auto, device, host, uva, disk (default auto; "
                "--synthetic: only with --checkpoint, not disk)."
            ),
        ] = None,
        history: Annotated[
            str | None,
            typer.Option(
                help="Hash history of the served requests: slot (default), request, lookback."
            ),
        ] = None,
        max_new_tokens: Annotated[
            str | None,
            typer.Option("--max-new-tokens", help="Tokens generated per request (default 32)."),
        ] = None,
        model: Annotated[
            Path | None,
            typer.Option(help="A model directory from python -m engramrt_lab.models.train."),
        ] = None,
        full_eval: Annotated[
            bool,
            typer.Option(
                "--full-eval",
                help="Evaluate the whole shipped held-out sample and check it against the "
                "training machine's record (default: its first sequences, quicker).",
            ),
        ] = False,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print one JSON object instead of tables.")
        ] = False,
        plot: Annotated[
            Path | None, typer.Option(help="Also write a PNG chart of the gates here.")
        ] = None,
        config: Annotated[
            str | None,
            typer.Option(
                "--config", "-c", help="--synthetic: preset or config.json (default dsv41-flash)."
            ),
        ] = None,
        checkpoint: Annotated[
            Path | None,
            typer.Option(help="--synthetic: serve rows from this checkpoint instead."),
        ] = None,
        cache_mib: Annotated[
            str | None,
            typer.Option(
                "--cache-mib",
                help="A hot-row cache of this many MiB per layer (0: none; default 0, "
                "--synthetic 16).",
            ),
        ] = None,
    ) -> None:
        """Serve the shipped tiny Engram LM through the runtime and check it (default), or
        stream a text through the V4.1-Flash layout on synthetic rows (--synthetic).

        The model demo generates from a prompt as an engine would (chunked
        prefill, a prefix-cache hit, rejected drafts), checks the tokens
        against an eager reference and a second placement, compares the
        held-out loss of each model and shows where the gate opens.
        """
        from engramrt.cli._checks import parse_float, parse_optional_int

        new_tokens = parse_optional_int("--max-new-tokens", max_new_tokens)
        cache = None if cache_mib is None else parse_float("--cache-mib", cache_mib)
        given = {
            "--history": history is not None,
            "--max-new-tokens": max_new_tokens is not None,
            "--model": model is not None,
            "--json": as_json,
            "--full-eval": full_eval,
            "--config": config is not None,
            "--checkpoint": checkpoint is not None,
        }
        if synthetic:
            from engramrt_lab.cli.demo_synthetic import run_synthetic

            _refuse(given, MODEL_ONLY, "for the model demo; leave it out with --synthetic")
            if tier is not None and checkpoint is None:
                from engramrt.errors import EngramError

                raise EngramError(
                    f"--tier={tier!r} places a checkpoint's tables; --synthetic computes its "
                    f"rows from their ids, so give --checkpoint too or leave --tier out"
                )
            resolved = _resolve_text(text, file)
            run_synthetic(
                config="dsv41-flash" if config is None else config,
                text=resolved,
                device=device,
                plot=plot,
                checkpoint=checkpoint,
                tier="auto" if tier is None else tier,
                cache_mib=16.0 if cache is None else cache,
            )
            return
        _refuse(given, SYNTHETIC_ONLY, "for --synthetic; the model demo takes --model")
        from engramrt_lab.cli.demo_model import run_model_demo

        resolved = _resolve_text(text, file)
        result = run_model_demo(
            text=resolved,
            device=device,
            tier="auto" if tier is None else tier,
            history="slot" if history is None else history,
            max_new_tokens=32 if new_tokens is None else new_tokens,
            cache_mib=0.0 if cache is None else cache,
            plot=plot,
            model_dir=model,
            as_json=as_json,
            full_eval=full_eval,
        )
        if not all(check["passed"] for check in result["checks"]):
            raise SystemExit(1)
