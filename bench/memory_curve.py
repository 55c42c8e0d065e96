"""The memory curve of a training run: held-out loss against Engram table bytes.

::

    python bench/memory_curve.py bench/results/tiny-lm-train-20261201T2045Z.json \\
        docs/img/tiny-lm-memory-curve.png

Reads the ``memory_sweep`` and ``models`` of a ``--results`` JSON of
``python -m engramrt_lab.models.train`` (every point trained for the same steps on
the same windows) and plots each point's loss on both held-out sets against
its fp8 table bytes, with the two baselines (no table) as horizontal lines.
Prints the points as a Markdown table.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python bench/memory_curve.py RESULTS.json OUT.png\n")
        return 2
    results = json.loads(Path(args[0]).read_text())
    points = sorted(results["memory_sweep"], key=lambda p: p["table_bytes_fp8"])
    models = results["models"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, key, title in (
        (axes[0], "heldout", "stdlib held-out files"),
        (axes[1], "package_heldout", "held-out packages (click, rich, typer)"),
    ):
        xs = [p["table_bytes_fp8"] / 1e6 for p in points]
        ys = [p["losses"][key] for p in points]
        ax.plot(xs, ys, "o-", color="C0", label="Engram (blocks 1, 2)")
        for x, y, p in zip(xs, ys, points, strict=True):
            ax.annotate(
                f"x{p['multiple_of_tiny_buckets']:g}",
                (x, y),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
        for name, color in (("baseline", "C3"), ("baseline_wide", "C2")):
            if name in models:
                ax.axhline(models[name]["losses"][key], color=color, linestyle="--", label=name)
        ax.set_xlabel("fp8 table bytes, both layers (MB)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out loss (nats / token)")
    axes[0].legend(fontsize=8)
    steps = results.get("steps", {}).get("steps")
    fig.suptitle(f"tiny Engram LM: loss against memory, {steps} steps each, same windows")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    from engramrt._io import atomic_write_bytes

    atomic_write_bytes(Path(args[1]), buf.getvalue())
    print(
        "| tables | buckets per head (2/3/4-grams) | fp8 table bytes | stdlib held-out | "
        "package held-out |"
    )
    print("| --- | --- | ---: | ---: | ---: |")
    for p in points:
        buckets = " / ".join(f"{b:,}" for b in p["buckets_per_head"])
        print(
            f"| x{p['multiple_of_tiny_buckets']:g} | {buckets} | {p['table_bytes_fp8']:,} | "
            f"{p['losses']['heldout']:.4f} | {p['losses']['package_heldout']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
