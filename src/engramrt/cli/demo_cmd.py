"""``engramrt demo``: the shipped tiny Engram LM (default) or the V4.1 layout on synthetic rows.

The default (:mod:`engramrt.cli.demo_model`) serves a real trained model
through the runtime and checks it; ``--synthetic``
(:mod:`engramrt.cli.demo_synthetic`) streams a text through the real
V4.1-Flash layout with synthetic rows and random weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


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
            str,
            typer.Option(
                help="Where the tables live: auto, device, host, uva, disk (--synthetic: "
                "for --checkpoint tables, not disk)."
            ),
        ] = "auto",
        history: Annotated[
            str, typer.Option(help="Hash history of the served requests: slot, request, lookback.")
        ] = "slot",
        max_new_tokens: Annotated[
            int, typer.Option("--max-new-tokens", help="Tokens generated per request.")
        ] = 32,
        model: Annotated[
            Path | None,
            typer.Option(help="A model directory from python -m engramrt.models.train."),
        ] = None,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print one JSON object instead of tables.")
        ] = False,
        plot: Annotated[Path, typer.Option(help="Where to write the PNG chart.")] = Path(
            "engramrt-demo.png"
        ),
        config: Annotated[
            str, typer.Option("--config", "-c", help="--synthetic: preset or config.json.")
        ] = "dsv41-flash",
        checkpoint: Annotated[
            Path | None,
            typer.Option(help="--synthetic: serve rows from this checkpoint instead."),
        ] = None,
        cache_mib: Annotated[
            float | None,
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
        against an eager reference and a second placement, reproduces the
        held-out loss and shows where the gate opens.
        """
        from engramrt.errors import EngramError

        resolved = _resolve_text(text, file)
        if synthetic:
            from engramrt.cli.demo_synthetic import run_synthetic

            if as_json:
                raise EngramError("--json is for the model demo; leave it out with --synthetic")
            run_synthetic(
                config=config,
                text=resolved,
                device=device,
                plot=plot,
                checkpoint=checkpoint,
                tier=tier,
                cache_mib=16.0 if cache_mib is None else cache_mib,
            )
            return
        if checkpoint is not None or config != "dsv41-flash":
            raise EngramError(
                "--checkpoint and --config are for --synthetic; the model demo takes --model"
            )
        from engramrt.cli.demo_model import run_model_demo

        result = run_model_demo(
            text=resolved,
            device=device,
            tier=tier,
            history=history,
            max_new_tokens=max_new_tokens,
            cache_mib=0.0 if cache_mib is None else cache_mib,
            plot=plot,
            model_dir=model,
            as_json=as_json,
        )
        if not all(check["passed"] for check in result["checks"]):
            raise SystemExit(1)
