"""``engramrt bench``: check, then time every registered case beside its baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _groups() -> list[str]:
    """The benchmark groups: one per ``engramrt.bench.cases_<group>`` module."""
    import pkgutil

    import engramrt.bench as pkg

    return sorted(
        info.name.removeprefix("cases_")
        for info in pkgutil.iter_modules(pkg.__path__)
        if info.name.startswith("cases_")
    )


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        group: Annotated[
            list[str] | None,
            typer.Option("--group", "-g", help="Only these groups (hash, lookup, gate, ...)."),
        ] = None,
        case: Annotated[
            list[str] | None,
            typer.Option(
                "--case", "-k", help="Only cases matching these patterns ('lookup/host/*')."
            ),
        ] = None,
        quick: Annotated[bool, typer.Option(help="Small shapes, a short run.")] = False,
        out: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
        markdown: Annotated[Path | None, typer.Option(help="Write a markdown table here.")] = None,
        device: Annotated[str, typer.Option(help="cuda or cpu.")] = "cuda",
        write_config: Annotated[
            Path | None,
            typer.Option(
                "--write-config",
                help="Write each tuning case's fastest kernel settings to "
                "DIR/<kernel>.<gpu>.json (src/engramrt/tuned to update the shipped files).",
            ),
        ] = None,
    ) -> None:
        """Run the benchmark suite; a case whose check fails is reported as failed.

        Every case times a CUDA kernel: without a CUDA device the command
        runs nothing and says so (exit code 2), instead of skipping every case.
        """
        import torch

        from engramrt.bench.runner import markdown_table, run_cases, select_cases
        from engramrt.cli._checks import check_output_path, parse_device, write_output
        from engramrt.errors import ValidationError

        if group:  # before any device check: a typo is named as such on every machine
            known = _groups()
            unknown = [g for g in group if g not in known]
            if unknown:
                raise ValidationError(
                    f"--group {', '.join(map(repr, unknown))}: no such benchmark group; expected "
                    f"one of {', '.join(known)}"
                )
        for option, path in (("--out", out), ("--markdown", markdown)):
            if path is not None:
                check_output_path(option, path)
        # Before any device check too: a pattern that selects nothing is named on every machine.
        selected = select_cases(group, quick=quick, names=case)
        if write_config is not None and not any(c.tuning is not None for c in selected):
            tuned = sorted({c.group for c in select_cases(quick=quick) if c.tuning is not None})
            raise ValidationError(
                f"--write-config={str(write_config)!r}: none of the {len(selected)} selected "
                f"benchmark cases tunes a kernel, so no file would be written; expected cases "
                f"of the groups {', '.join(tuned)}"
            )
        if device == "cpu" or (device.startswith("cuda") and not torch.cuda.is_available()):
            runnable = [c for c in selected if not c.requires_cuda]
            if not runnable:
                raise ValidationError(
                    f"--device={device!r}: all {len(selected)} selected benchmark cases time "
                    f"CUDA kernels and "
                    + ("no CUDA device is visible" if device != "cpu" else "--device is cpu")
                    + "; nothing was run (on a CPU, scripts/test checks the same kernels "
                    "through Triton's interpreter)"
                )
        dev = parse_device("--device", device)
        report = run_cases(group, quick=quick, device=str(dev), out=out, names=case)
        table = markdown_table(report)
        if markdown is not None:
            write_output("--markdown", markdown, (table + "\n").encode())
        print(table)
        if write_config is not None:
            from engramrt.bench.tuned import write_configs

            for path in write_configs(report, write_config):
                print(f"wrote {path}")
        failed = [c["name"] for c in report["cases"] if c.get("status") == "failed"]
        if failed:
            raise typer.Exit(code=1)
