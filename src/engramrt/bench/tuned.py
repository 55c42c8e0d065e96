"""Write the tuned-config files from a bench report: each tuning case's fastest config.

``engramrt bench --write-config DIR`` (and ``bench/tune_gate.py --write-config
DIR``) end here. A case with a :class:`~engramrt.bench.registry.Tuning` ranks
the implementations that launch one of its configs by its metric; the fastest
becomes the entry for the case's ``match`` in ``DIR/<kernel>.<device>.json``
(:func:`engramrt.tuning.write_tuned_config`: written atomically, entries this
run did not measure kept).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engramrt.errors import ValidationError

__all__ = ["best_configs", "write_configs"]


def best_configs(report: Mapping[str, Any]) -> dict[str, list[tuple[dict[str, Any], Any, str]]]:
    """Kernel -> ``(match, config, impl name)`` of each checked tuning case's fastest config."""
    from engramrt.tuning import config_type

    best: dict[str, list[tuple[dict[str, Any], Any, str]]] = {}
    for record in report.get("cases", []):
        tuning = record.get("tuning")
        if tuning is None or record.get("status") != "ok":
            continue  # a failed check is never a winner
        results, metric = record["results"], tuning["metric"]
        times = {
            name: float(results[name].get(metric, results[name]["median_us"]))
            for name in tuning["configs"]
            if name in results
        }
        if not times:
            continue
        winner = min(times, key=times.__getitem__)
        config = config_type(tuning["kernel"])(**tuning["configs"][winner])
        best.setdefault(tuning["kernel"], []).append((tuning["match"], config, winner))
    return best


def write_configs(report: Mapping[str, Any], directory: str | Path) -> list[Path]:
    """Write every tuning case's winner of ``report`` into ``directory``; returns the files.

    Raises:
        ValidationError: the report was not run on a GPU (no device name to file it under).
    """
    from engramrt.tuning import write_tuned_config

    device = report.get("environment", {}).get("gpu")
    if not device:
        raise ValidationError(
            "--write-config: the report names no GPU (environment.gpu); tuned configs are "
            "written for the GPU the cases ran on"
        )
    paths = []
    for kernel, entries in best_configs(report).items():
        record = next(
            r["tuning"] for r in report["cases"] if r.get("tuning", {}).get("kernel") == kernel
        )
        paths.append(
            write_tuned_config(
                kernel,
                device,
                tuple(record["key"]),
                [(match, config) for match, config, _ in entries],
                Path(directory),
                measured=record["measured"],
            )
        )
    return paths
