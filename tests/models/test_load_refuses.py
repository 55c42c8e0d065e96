"""``load_model`` refuses every damaged model directory with a CheckpointError naming
the file and the field (and never reads outside the directory)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engramrt.errors import CheckpointError
from engramrt.lookup.tiers import TablePlacement
from engramrt_lab.models import artifacts

ON_CPU = TablePlacement("device", device="cpu")


def _json(directory: Path) -> dict:
    return json.loads((directory / artifacts.MODEL_JSON).read_text())


def _write_json(directory: Path, data: dict, *, seal: bool = True) -> None:
    """Write ``data`` as model.json; ``seal``: with its own checksum recomputed, so that
    only the check of the field edited can refuse it."""
    if seal:
        data = artifacts.seal_model_json(data)
    (directory / artifacts.MODEL_JSON).write_text(json.dumps(data))


def _resum(directory: Path, name: str) -> None:
    """Record the file's current SHA-256 (so only the content check can catch it)."""
    data = _json(directory)
    data["checksums"][name] = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    _write_json(directory, data)


def _truncate(name: str, keep: float = 0.5) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[: int(len(data) * keep)])

    return apply


def _edit(change: Callable[[dict], None], *, seal: bool = True) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        data = _json(directory)
        change(data)
        _write_json(directory, data, seal=seal)

    return apply


def _swap_vocab(data: dict) -> None:
    ids = data["vocab"]["token_ids"]
    ids[3], ids[4] = ids[4], ids[3]


def _nan_weight(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / artifacts.ENGRAM_WEIGHTS
    tensors = load_file(str(path))
    name = next(k for k in tensors if k.endswith("wkv.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    _resum(directory, artifacts.ENGRAM_WEIGHTS)


def _flip(name: str, offset: int = -100) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        data = bytearray((directory / name).read_bytes())
        data[offset] ^= 0xFF
        (directory / name).write_bytes(bytes(data))

    return apply


def _symlink_weights(directory: Path) -> None:
    target = directory / "elsewhere.safetensors"
    shutil.move(directory / artifacts.ENGRAM_WEIGHTS, target)
    (directory / artifacts.ENGRAM_WEIGHTS).symlink_to(target)


def _truncated_vocab(data: dict) -> None:
    data["vocab"]["token_ids"] = data["vocab"]["token_ids"][:-5]


CASES = [
    ("truncated model.json", _truncate(artifacts.MODEL_JSON), "not valid JSON"),
    (
        "non-UTF-8 model.json",
        lambda d: (d / artifacts.MODEL_JSON).write_bytes(b'{"format": "\xff\xfe"}'),
        "not UTF-8",
    ),
    ("a list", lambda d: (d / artifacts.MODEL_JSON).write_text("[1, 2]"), "JSON list"),
    ("missing lm", _edit(lambda data: data.pop("lm")), "field 'lm' is missing"),
    ("lm not an object", _edit(lambda data: data.update(lm=3)), "field 'lm' is a int"),
    (
        "missing files key",
        _edit(lambda data: data["files"].pop("heldout_sample")),
        "files.heldout_sample",
    ),
    ("bad lm field", _edit(lambda data: data["lm"].update(dim="x")), "field 'lm' is not valid"),
    (
        "bad engram field",
        _edit(lambda data: data["engram"].pop("engram_layer_ids")),
        "field 'engram'",
    ),
    (
        "path outside",
        _edit(lambda data: data["files"].update(engram_weights="../../../../etc/hostname")),
        "files.engram_weights='../../../../etc/hostname'",
    ),
    (
        "absolute path",
        _edit(lambda data: data["files"].update(engram_tables="/etc/hostname")),
        "files.engram_tables='/etc/hostname'",
    ),
    (
        "symlinked file",
        _symlink_weights,
        "files.engram_weights='engram_model.safetensors' is not a regular",
    ),
    ("truncated weights", _truncate(artifacts.ENGRAM_WEIGHTS), "engram_model.safetensors"),
    ("truncated sample", _truncate(artifacts.HELDOUT_SAMPLE), "heldout_sample.safetensors"),
    ("one NaN weight", _nan_weight, "non-finite"),
    ("truncated vocab", _edit(_truncated_vocab), "field vocab.token_ids"),
    ("flipped table bytes", _flip(artifacts.ENGRAM_TABLES), "checksums.engram.safetensors"),
    ("flipped sample byte", _flip(artifacts.HELDOUT_SAMPLE, -3), "checksums.heldout_sample"),
    (
        "missing checksum",
        _edit(lambda data: data["checksums"].pop(artifacts.ENGRAM_WEIGHTS)),
        "checksums.engram_model.safetensors is missing",
    ),
    (
        "two vocab ids swapped",
        _edit(_swap_vocab, seal=False),
        "field 'model_json_sha256' records",
    ),
    (
        "a recorded loss edited",
        _edit(lambda data: data["training"]["heldout"]["losses"].update(engram=0.5), seal=False),
        "model.json changed after training",
    ),
    (
        "checksums deleted",
        _edit(lambda data: data.pop("checksums"), seal=False),
        "model.json changed after training",
    ),
    (
        "checksums deleted and model.json resealed",
        _edit(lambda data: data.pop("checksums")),
        "field 'checksums' is missing",
    ),
    (
        "model.json's own checksum deleted",
        _edit(lambda data: data.pop(artifacts.MODEL_JSON_SHA256), seal=False),
        "field 'model_json_sha256' is missing",
    ),
    (
        "a NaN recorded loss",
        _edit(lambda data: data["training"]["heldout"]["losses"].update(engram=float("nan"))),
        "training.heldout.losses.engram=nan",
    ),
]


@pytest.mark.parametrize(("label", "damage", "needle"), CASES, ids=[c[0] for c in CASES])
def test_damaged_directory_is_refused(
    trained_dir: Path, tmp_path: Path, label, damage, needle
) -> None:
    from engramrt_lab.models.serve import load_model

    directory = tmp_path / "model"
    shutil.copytree(trained_dir, directory)
    damage(directory)
    with pytest.raises(CheckpointError) as info:
        load_model(directory, ON_CPU, load_baseline=True, head_backend="reference")
    assert needle in str(info.value), str(info.value)
    assert str(directory) in str(info.value)  # the file is named


def test_the_undamaged_copy_loads(trained_dir: Path, tmp_path: Path) -> None:
    """Control: the same copy, undamaged, loads (so each case above fails for its damage)."""
    from engramrt_lab.models.serve import load_model

    directory = tmp_path / "model"
    shutil.copytree(trained_dir, directory)
    model = load_model(directory, ON_CPU, head_backend="reference")
    assert torch.isfinite(next(model.lm.parameters())).all()


def test_the_disk_tier_under_a_regular_file_is_one_clean_error(
    trained_dir: Path, tmp_path: Path
) -> None:
    """load_model with tier disk whose disk_dir is a file: one ValidationError naming the
    packed-row file (was: a raw NotADirectoryError / FileExistsError)."""
    from engramrt.errors import ValidationError
    from engramrt_lab.models.serve import load_model

    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"x")
    placement = TablePlacement("disk", device="cpu", disk_dir=blocker / "rows")
    with pytest.raises(ValidationError) as info:
        load_model(trained_dir, placement, head_backend="reference")
    message = str(info.value)
    assert message.startswith("tier='disk' (") and str(blocker / "rows") in message
    assert "cannot be created: Not a directory" in message
    assert blocker.read_bytes() == b"x"


def test_reformatting_model_json_keeps_it_valid(trained_dir: Path, tmp_path: Path) -> None:
    """The checksum covers the values, not the layout: the same object written with
    other indentation and key order loads."""
    from engramrt_lab.models.serve import load_model

    directory = tmp_path / "model"
    shutil.copytree(trained_dir, directory)
    data = _json(directory)
    (directory / artifacts.MODEL_JSON).write_text(
        json.dumps(dict(reversed(data.items())), indent=3)
    )
    load_model(directory, ON_CPU, load_baseline=False, head_backend="reference")


def test_unchecked_directories_load_only_when_the_caller_opts_out(
    trained_dir: Path, tmp_path: Path
) -> None:
    from engramrt_lab.models.serve import load_model

    directory = tmp_path / "model"
    shutil.copytree(trained_dir, directory)
    data = _json(directory)
    data.pop("checksums")
    data.pop(artifacts.MODEL_JSON_SHA256)
    _write_json(directory, data, seal=False)
    with pytest.raises(CheckpointError, match="require_checksums=False"):
        load_model(directory, ON_CPU, load_baseline=False, head_backend="reference")
    with pytest.warns(UserWarning, match="unchecked"):
        load_model(
            directory,
            ON_CPU,
            load_baseline=False,
            head_backend="reference",
            require_checksums=False,
        )
    # Opting out does not switch off a checksum that is recorded.
    sealed = tmp_path / "sealed"
    shutil.copytree(trained_dir, sealed)
    _edit(_swap_vocab, seal=False)(sealed)
    with pytest.raises(CheckpointError, match=r"model\.json changed after training"):
        load_model(sealed, ON_CPU, load_baseline=False, require_checksums=False)


REFUSE_SCRIPT = """
import gc, sys, warnings
from engramrt.errors import CheckpointError
from engramrt.lookup.tiers import TablePlacement
from engramrt_lab.models.serve import load_model
warnings.simplefilter("error", ResourceWarning)
try:
    load_model(sys.argv[1], TablePlacement("device", device="cpu"), head_backend="reference")
except CheckpointError as exc:
    print("refused:", exc)
gc.collect()
"""


@pytest.mark.parametrize(
    "damage",
    [_edit(_swap_vocab, seal=False), _truncate(artifacts.MODEL_JSON), _edit(lambda d: d.pop("lm"))],
    ids=["edited", "truncated", "field missing"],
)
def test_a_refused_model_json_leaves_no_file_open(
    trained_dir: Path, tmp_path: Path, damage
) -> None:
    """In a real process with ResourceWarning as an error (``-X dev`` reports every
    unclosed file, also those only the garbage collector finds)."""
    import os
    import subprocess
    import sys

    directory = tmp_path / "model"
    shutil.copytree(trained_dir, directory)
    damage(directory)
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "dev",
            "-W",
            "error::ResourceWarning",
            "-c",
            REFUSE_SCRIPT,
            str(directory),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "refused:" in done.stdout, done.stderr[-2000:]
    assert "ResourceWarning" not in done.stderr and "unclosed" not in done.stderr, done.stderr
