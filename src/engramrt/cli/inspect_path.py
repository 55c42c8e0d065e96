"""``engramrt inspect PATH``: what a checkpoint holds, read from the safetensors headers only.

PATH is a safetensors file, a sharded Hugging Face checkpoint directory
(``model.safetensors.index.json`` naming its shards) or a directory written
by ``engramrt convert`` (its ``*.safetensors`` beside a ``config.json``). No
tensor is read: names, dtypes, shapes and metadata come from each file's
header. Reported: every tensor whose name holds ``engram``, by Engram layer
(the number after ``layers.``), with its shape, dtype and bytes; the token
map fingerprint each file records and whether it matches the tokenizer in
use (checked against a config: ``--config``, else the ``config.json`` beside
the files); and which tiers the Engram tensors fit on this machine. A
checkpoint with no Engram tensor is refused: there is nothing to report.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from engramrt.errors import CheckpointError, EngramError

_LAYER = re.compile(r"layers\.(\d+)\.")
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
"""Bytes per element of each safetensors dtype."""


def checkpoint_files(path: Path) -> tuple[str, list[Path]]:
    """The kind of checkpoint at ``path`` and its safetensors files."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise EngramError(
                f"PATH={str(path)!r} is not a .safetensors file; expected a safetensors file, a "
                f"sharded checkpoint directory or a converted engramrt directory"
            )
        return "safetensors file", [path]
    if not path.is_dir():
        raise EngramError(f"PATH={str(path)!r} does not exist")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted({str(name) for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{str(index)!r} is not a checkpoint index: {exc}") from None
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise CheckpointError(f"{str(index)!r} names shards that are missing: {missing[:3]}")
        return "sharded checkpoint", [path / name for name in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngramError(
            f"PATH={str(path)!r} holds no .safetensors file and no model.safetensors.index.json"
        )
    kind = "converted engramrt directory" if (path / "config.json").is_file() else "directory"
    return kind, files


def _header(file: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors (name -> {dtype, shape, data_offsets}) and metadata of one file's header."""
    try:
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= 100 * 2**20:
                raise ValueError(f"header size {size}")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{str(file)!r} is not a safetensors file: {exc}") from None
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata


def inspect_path(path: Path, config: str | None) -> dict[str, Any]:
    """Everything ``inspect PATH`` prints, as one JSON-able object."""
    from engramrt import memory
    from engramrt.checkpoint.metadata import read_token_map_fingerprint

    kind, files = checkpoint_files(path)
    tensors: list[dict[str, Any]] = []
    fingerprints: dict[str, Any] = {}
    for file in files:
        header, metadata = _header(file)
        recorded = read_token_map_fingerprint(metadata, file)
        fingerprints[file.name] = None if recorded is None else recorded
        for name, info in sorted(header.items()):
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            layer = _LAYER.search(name)
            family = _family_of_tensor(name) if layer else None
            tensors.append(
                {
                    "name": name,
                    "file": file.name,
                    "engram_layer": int(layer.group(1)) if layer and family else None,
                    "family": family,
                    "dtype": info["dtype"],
                    "shape": [int(d) for d in info["shape"]],
                    "bytes": count * DTYPE_BYTES.get(info["dtype"], 0),
                }
            )
    engram = [t for t in tensors if t["engram_layer"] is not None]
    if not engram:
        raise CheckpointError(
            f"PATH={str(path)!r} ({kind}, {len(files)} file(s), {len(tensors)} tensor(s)) holds "
            f"no memory tensor: nothing to inspect; expected a name with 'engram' and a "
            f"'layers.<i>.' part, as DeepSeek-V4.1 checkpoints and engramrt convert write "
            f"(layers.<i>.engram.embed.weight), or a Qwen4-Exp PLE tensor (layers.<i>.ple.)"
        )
    engram_bytes = sum(t["bytes"] for t in engram)
    report: dict[str, Any] = {
        "path": str(path.resolve()),
        "kind": kind,
        "files": [f.name for f in files],
        "tensors": len(tensors),
        "bytes": sum(t["bytes"] for t in tensors),
        "families": sorted({t["family"] for t in engram}),
        "engram_layers": sorted({t["engram_layer"] for t in engram}),
        "engram_tensors": engram,
        "engram_bytes": engram_bytes,
        "token_map": _token_map_check(path, files, fingerprints, config),
    }
    import torch

    from engramrt._device import default_compute_device

    room = {
        "host": memory.host_available_bytes(),
        "disk": memory.disk_free_bytes(files[0].parent),
    }
    if torch.cuda.is_available():
        room["device"] = memory.device_free_bytes(default_compute_device())
    report["tiers_that_fit"] = {
        tier: {"free_bytes": free, "fits": engram_bytes <= free} for tier, free in room.items()
    }
    return report


def _family_of_tensor(name: str) -> str | None:
    """The memory family a checkpoint tensor of a decoder layer belongs to, by its name:
    DeepSeek Engram's (``...engram...``), Qwen4-Exp PLE's (``.ple.``), or None."""
    if "engram" in name.lower():
        return "deepseek-engram"
    if ".ple." in name:
        return "qwen4-ple"
    return None


def _token_map_check(
    path: Path, files: list[Path], fingerprints: dict[str, Any], config: str | None
) -> dict[str, Any]:
    """Per file: whether it records a fingerprint and whether it matches the tokenizer in use."""
    from engramrt.config import load_config
    from engramrt.hashing.fingerprint import check_fingerprint
    from engramrt.tokenmap import default_token_map

    directory = path if path.is_dir() else path.parent
    source = (
        config
        if config is not None
        else (str(directory / "config.json") if (directory / "config.json").is_file() else None)
    )
    result: dict[str, Any] = {"config": source, "files": {}}
    cfg = load_config(source) if source is not None and any(fingerprints.values()) else None
    for file in files:
        recorded = fingerprints[file.name]
        if recorded is None:
            result["files"][file.name] = "no fingerprint recorded"
        elif cfg is None:
            result["files"][file.name] = "fingerprint recorded; not checked: no config (--config)"
        else:
            try:
                check_fingerprint(default_token_map(), recorded, cfg, where=file.name)
                result["files"][file.name] = "matches the tokenizer in use"
            except EngramError as exc:
                result["files"][file.name] = f"does not match: {exc}"
    return result


def print_path_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    from engramrt.cli._console import console
    from engramrt.memory import format_bytes

    console.print(
        f"[bold]{report['path']}[/]: {report['kind']}, {len(report['files'])} file(s), "
        f"{report['tensors']:,} tensors, {format_bytes(report['bytes'])}",
        soft_wrap=True,
    )
    table = Table(
        title=f"memory tensors ({', '.join(report['families'])}): decoder layers "
        f"{report['engram_layers']}, "
        f"{format_bytes(report['engram_bytes'])}",
        title_justify="left",
    )
    for name in ("layer", "tensor", "dtype", "shape", "bytes", "file"):
        table.add_column(
            name, justify="right" if name in ("layer", "bytes") else "left", overflow="fold"
        )
    for t in report["engram_tensors"]:
        table.add_row(
            str(t["engram_layer"]), t["name"], t["dtype"], str(t["shape"]),
            f"{t['bytes']:,}", t["file"],
        )  # fmt: skip
    console.print(table)
    for file, verdict in report["token_map"]["files"].items():
        console.print(f"token map, {file}: {verdict}", soft_wrap=True, highlight=False)
    fits = ", ".join(
        f"{tier} {'fits' if v['fits'] else 'does not fit'} ({format_bytes(v['free_bytes'])} free)"
        for tier, v in report["tiers_that_fit"].items()
    )
    console.print(f"the memory tensors on this machine: {fits}", soft_wrap=True)
