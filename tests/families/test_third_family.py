"""A third family plugs in without an edit to engramrt (docs/architecture.md, "A memory
family"): the toy family of ``tests/families/toy`` is registered by ``register_family``
(as its distribution's ``engramrt.families`` entry point would), and ``engramrt plan``,
``hash`` and ``inspect`` take its config through the registry and its command-line hooks.
Controls: without its hooks the commands refuse its config, naming what is missing; an
entry point that fails names itself.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import engramrt.family as registry
from engramrt.cli import main
from engramrt.errors import ValidationError

CONFIG = {"model_type": "toy_keyed", "toy_layer_ids": [2, 5], "toy_primes": [7, 11, 13],
          "toy_width": 4}  # fmt: skip


def run(capsys, *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    registry.register_family(
        "toy-keyed",
        "tests.families.toy.family:ToyFamily",
        model_types=("toy_keyed",),
        command_line="tests.families.toy.command_line",
    )
    yield path
    registry.unregister_family("toy-keyed")


def test_commands_take_a_registered_family(capsys, toy) -> None:
    code, out, err = run(capsys, "plan", "-c", toy, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["family"] == "toy-keyed"
    assert [t["rows"] for t in plan["tables"]] == [31, 31]  # 7 + 11 + 13 rows per layer
    assert plan["total_bytes"] == 2 * 31 * 4 * 2  # bf16 rows of 4 values
    code, out, err = run(capsys, "hash", "-c", toy, "--ids", "3,10,4,1", "--chunks", "2,1")
    assert code == 0, err
    hashed = json.loads(out)
    # Row id of head c = offset_c + (token * (2 * layer + 1)) mod prime_c, here by hand.
    assert hashed["row_ids"][1][1] == [(10 * 11) % 7, 7 + (10 * 11) % 11, 18 + (10 * 11) % 13]
    code, out, err = run(capsys, "inspect", "-c", toy)
    assert code == 0, err
    assert out.strip() == "toy-keyed: primes [7, 11, 13]"


def test_without_hooks_the_commands_say_what_is_missing(capsys, toy) -> None:
    registry.register_family(
        "toy-keyed", "tests.families.toy.family:ToyFamily", model_types=("toy_keyed",)
    )
    code, _, err = run(capsys, "hash", "-c", toy, "--ids", "3")
    assert code != 0
    assert "'toy-keyed' config, and that family gives engramrt hash no hash_run()" in err


def test_entry_points_register_and_a_failing_one_names_itself(monkeypatch) -> None:
    calls = []

    def good() -> None:
        calls.append("good")
        registry.register_family("toy-ep", "tests.families.toy.family:ToyFamily")

    def bad() -> None:
        raise RuntimeError("broken install")

    def points(group: str):
        assert group == registry.ENTRY_POINT_GROUP
        return [SimpleNamespace(name=n, value=f"pkg:{n}", load=lambda f=f: f)
                for n, f in (("good", good), ("bad", bad))]  # fmt: skip

    monkeypatch.setattr("importlib.metadata.entry_points", points)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        with pytest.raises(ValidationError, match=r"entry point 'bad' \(pkg:bad\) failed"):
            registry.family_names()
        assert calls == ["good"] and "toy-ep" in registry.family_names()
    finally:
        registry.unregister_family("toy-ep")
