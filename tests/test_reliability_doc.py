"""docs/reliability.md quotes what the code prints: each case here runs as the doc's row
describes it and the message it gives must appear in the doc word for word (so a message
changed in the code, or a row left behind, fails here)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engramrt.cli import main
from engramrt.errors import EngramError

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def _doc() -> str:
    return " ".join(DOC.read_text().split())


def _cli_error(capsys: pytest.CaptureFixture[str], *args: object) -> str:
    """The one-line ``error: ...`` of ``engramrt ARGS`` (exit code 2)."""
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    _, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return " ".join(err.split())


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the tiny config's tables, named ``engram.safetensors``."""
    from engramrt.checkpoint import save_tables
    from engramrt.config import PRESETS
    from engramrt.lookup.synthetic import random_packed_rows

    cfg = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(0)
    tables = [random_packed_rows(n, cfg.head_dim, "cpu", gen) for n in cfg.num_embeddings]
    return save_tables(tmp_path_factory.mktemp("ck") / "engram.safetensors", tables, cfg)


CLI_CASES = {
    "device tpu": ["hash", "-c", "tiny", "--ids", "1,2", "--device", "tpu"],
    "device meta": ["hash", "-c", "tiny", "--ids", "1,2", "--device", "meta"],
    "synthetic tier disk": ["demo", "--synthetic", "--tier", "disk"],
    "synthetic tier disk with a checkpoint": [
        "demo", "--synthetic", "--device", "cpu", "--tier", "disk", "--checkpoint", "{ck}",
    ],
    "synthetic tier bogus with a checkpoint": [
        "demo", "--synthetic", "-c", "tiny", "--device", "cpu", "--tier", "bogus",
        "--checkpoint", "{ck}",
    ],
    "another config's checkpoint": [
        "demo", "--synthetic", "-c", "dsv41-flash", "--device", "cpu", "--checkpoint", "{ck}",
    ],
}  # fmt: skip


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_each_quoted_cli_message_is_the_codes(capsys, tiny_checkpoint, case) -> None:
    args = [str(tiny_checkpoint) if a == "{ck}" else a for a in CLI_CASES[case]]
    message = _cli_error(capsys, *args)
    assert message.startswith("error: ")
    assert f"`{message}`" in _doc(), f"docs/reliability.md does not quote: {message}"


def _placement(*args: object, **kwargs: object) -> Callable[[], object]:
    from engramrt.lookup.tiers import TablePlacement

    return lambda: TablePlacement(*args, **kwargs)  # type: ignore[arg-type]


def _cache(**kwargs: object) -> Callable[[], object]:
    def make() -> object:
        from engramrt.cache import CachedRowStore
        from engramrt.lookup.synthetic import random_packed_rows
        from engramrt.lookup.tiers import TablePlacement, make_store

        rows = random_packed_rows(10, 32, "cpu", torch.Generator().manual_seed(0))
        backing = make_store(TablePlacement("device", device="cpu"), packed=rows)
        return CachedRowStore(backing, **{"capacity_bytes": 2**16, **kwargs})  # type: ignore[arg-type]

    return make


def _rollback(slot: int) -> Callable[[], object]:
    def run() -> object:
        from engramrt.hashing import RequestHistory

        history = RequestHistory(4, 4)
        history.rollback_many(torch.tensor([slot]), torch.tensor([1]))
        return history

    return run


# (the call, how much of its message the doc quotes: None for all of it, else the text
# before this marker, where the doc continues with a machine-dependent amount)
API_CASES: dict[str, tuple[Callable[[], object], str | None]] = {
    "placement tpu": (_placement("host", "tpu"), None),
    "placement int": (_placement("host", 5), None),
    "placement meta": (_placement("host", "meta"), None),
    "placement disk_dir": (_placement("disk", "cpu", disk_dir=5), None),
    "cache capacity": (_cache(capacity_bytes=2**62), " but host memory"),
    "cache sketch width": (_cache(sketch_width=2**40), " but host memory"),
    "cache sketch depth": (_cache(sketch_depth=2.5), None),
    "rollback slot 9": (_rollback(9), None),
}
if not torch.cuda.is_available():
    API_CASES["placement cuda"] = (_placement("host", "cuda"), None)


@pytest.mark.parametrize("case", list(API_CASES))
def test_each_quoted_api_message_is_the_codes(case) -> None:
    call, cut = API_CASES[case]
    with pytest.raises(EngramError) as info:
        call()
    message = " ".join(str(info.value).split())
    quoted = f"{type(info.value).__name__}: {message if cut is None else message.split(cut)[0]}"
    assert quoted in _doc(), f"docs/reliability.md does not quote: {quoted}"


def test_the_quoted_tuned_file_warning_is_the_codes(tmp_path, monkeypatch) -> None:
    import json

    from engramrt import tuning
    from engramrt.gate.config import default_gate_config

    data = json.loads((tuning.TUNED_DIR / "engram_gate.default.json").read_text())
    data["entries"][0]["config"]["block_d"] = 100
    (tmp_path / "engram_gate.default.json").write_text(json.dumps(data))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    tuning.clear_cache()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            default_gate_config(4, 5120, 2)
    finally:
        tuning.clear_cache()
    (warning,) = caught
    text = str(warning.message)
    prefix = f"{tmp_path}/"
    assert text.startswith(prefix)
    assert f".../{text[len(prefix) :]}`" in _doc()
