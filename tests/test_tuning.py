"""Tuned kernel settings as data: the reader, the writer, and the H200 choices pinned.

The pin compares the data-driven choice with the selection code it replaced,
copied below as it read before the settings moved to ``engramrt/tuned/``
(``_before_*``): on an H200, on the default file and on an unknown GPU, the
same block sizes, warps and grids come out for every shape tried.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest.mock import patch

import pytest

from engramrt import tuning
from engramrt.errors import ValidationError
from engramrt.gate.config import GateKernelConfig, default_gate_config
from engramrt.hashing.config import HashKernelConfig, kernel_config_for
from engramrt.lookup.settings import LookupKernelConfig, tuned_lookup_config
from engramrt.tuning import (
    TUNED_DIR,
    TunedConfigError,
    TunedConfigWarning,
    load_tuned_file,
    normalize_device_name,
    tuned_config,
    tuned_file,
    write_tuned_config,
)

H200 = "NVIDIA H200"
DEVICES = (H200, None, "Some Other GPU")
KERNELS = ("ngram_hash", "lookup_rows", "engram_gate")
REPO = Path(__file__).resolve().parents[1]


# The selection code before the move (hashing/ops.py, gate/config.py, lookup/tiers).
def _before_hash(num_tokens: int) -> HashKernelConfig:
    table = (
        (1024, HashKernelConfig(block_t=16, num_warps=4)),
        (16384, HashKernelConfig(block_t=16, num_warps=1)),
        (2**62, HashKernelConfig(block_t=64, num_warps=4)),
    )
    for bound, config in table:
        if num_tokens <= bound:
            return config
    return table[-1][1]


def _before_gate(hc: int, dim: int, element_bytes: int) -> GateKernelConfig:
    # DECODE_MAX_TOKENS was 0: the decode table never applied.
    shape_configs = {(4, 5120): GateKernelConfig(1024, 4, None, 1, streams_per_program=1)}
    if element_bytes == 2 and (hc, dim) in shape_configs:
        return shape_configs[(hc, dim)]
    hc_pad = 1 << max(0, hc - 1).bit_length()
    block_d = max(8, min(1 << max(0, dim - 1).bit_length(), 8192 // element_bytes // hc_pad))
    num_warps = max(1, min(4, hc_pad * block_d * element_bytes // 2048))
    return GateKernelConfig(block_d=block_d, num_warps=num_warps, programs_per_sm=None)


def _before_lookup(tier: str) -> LookupKernelConfig:
    return {
        "uva": LookupKernelConfig(rows_per_program=8, num_warps=2, max_programs=132),
        "host": LookupKernelConfig(rows_per_program=32, max_programs=16),
    }.get(tier, LookupKernelConfig())


@pytest.mark.parametrize("device", DEVICES)
def test_hash_choice_is_unchanged(device: str | None) -> None:
    for num_tokens in (0, 1, 7, 255, 256, 1023, 1024, 1025, 8192, 16384, 16385, 65536, 2**31):
        assert kernel_config_for(num_tokens, device) == _before_hash(num_tokens), num_tokens


@pytest.mark.parametrize("device", DEVICES)
def test_gate_choice_is_unchanged(device: str | None) -> None:
    from engramrt.gate.kernel import _default_config

    shapes = [(4, 5120), (4, 4096), (4, 7168), (2, 5120), (8, 5120), (3, 100), (1, 64), (4, 5121)]
    for hc, dim in shapes:
        for element_bytes in (1, 2, 4):
            want = _before_gate(hc, dim, element_bytes)
            for num_tokens in (None, 1, 256, 8192):
                got = default_gate_config(hc, dim, element_bytes, num_tokens, device)
                assert got == want, (hc, dim, element_bytes, num_tokens)
            # the launcher's path: one resolution per shape, token count and device
            assert _default_config(hc, dim, element_bytes, 256, device) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_choice_is_unchanged(device: str | None) -> None:
    for tier in ("device", "uva", "host", "disk", "synthetic"):
        assert tuned_lookup_config(tier, device) == _before_lookup(tier), tier


def test_the_h200_has_its_own_files_equal_to_the_default_ones() -> None:
    assert normalize_device_name(H200) == "NVIDIA_H200"
    for kernel in KERNELS:
        own = tuned_file(kernel, H200)
        assert own.name == f"{kernel}.NVIDIA_H200.json" and own.is_file()
        assert tuned_file(kernel, "Some Other GPU").name == f"{kernel}.default.json"
        h200 = json.loads(own.read_text())
        default = json.loads((TUNED_DIR / f"{kernel}.default.json").read_text())
        assert h200["entries"] == default["entries"]


def test_package_data_ships_the_files() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    package_data = pyproject.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    assert '"tuned/*.json"' in package_data
    assert sorted(p.name for p in TUNED_DIR.glob("*.default.json")) == sorted(
        f"{k}.default.json" for k in KERNELS
    )


def test_a_cpu_device_reads_the_default_file() -> None:
    import torch

    assert tuning.device_name(torch.device("cpu")) == tuning.DEFAULT_DEVICE
    assert kernel_config_for(256, torch.device("cpu")) is kernel_config_for(256)


def _write(directory: Path, kernel: str, data: object) -> None:
    (directory / f"{kernel}.default.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([], r"\(top level\)"),
        ({"kernel": "engram_gate", "key": [], "entries": []}, "kernel"),
        ({"kernel": "ngram_hash", "key": "num_tokens", "entries": []}, "key"),
        ({"kernel": "ngram_hash", "key": ["num_tokens"], "entries": {}}, "entries"),
        (
            {"kernel": "ngram_hash", "key": ["num_tokens"], "entries": [{"config": {}}]},
            r"entries\[0\]",
        ),
        (
            {
                "kernel": "ngram_hash",
                "key": ["num_tokens"],
                "entries": [{"match": {"tokens": 3}, "config": {}}],
            },
            r"entries\[0\]\.match\.tokens: not a key field",
        ),
        (
            {
                "kernel": "ngram_hash",
                "key": ["num_tokens"],
                "entries": [{"match": {"num_tokens": {"min": 3}}, "config": {}}],
            },
            r"entries\[0\]\.match\.num_tokens",
        ),
        (
            {
                "kernel": "ngram_hash",
                "key": ["num_tokens"],
                "entries": [{"match": {}, "config": {"block_tt": 16}}],
            },
            r"entries\[0\]\.config\.block_tt: not a field of HashKernelConfig",
        ),
        (
            {
                "kernel": "ngram_hash",
                "key": ["num_tokens"],
                "entries": [{"match": {}, "config": {"block_t": 24}}],
            },
            r"entries\[0\]\.config: block_t=24 must be a power of two",
        ),
    ],
)
def test_a_malformed_file_names_the_file_and_the_field(
    tmp_path: Path, data: object, field: str
) -> None:
    _write(tmp_path, "ngram_hash", data)
    with pytest.raises(TunedConfigError, match=rf"ngram_hash\.default\.json: {field}"):
        load_tuned_file("ngram_hash", tmp_path / "ngram_hash.default.json")
    with patch.object(tuning, "TUNED_DIR", tmp_path):
        tuning.clear_cache()
        with pytest.warns(TunedConfigWarning, match=rf"ngram_hash\.default\.json: {field}"):
            assert tuned_config("ngram_hash", None, {"num_tokens": 1}) is None
    tuning.clear_cache()


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "ngram_hash.default.json").write_text("{not json")
    with patch.object(tuning, "TUNED_DIR", tmp_path):
        tuning.clear_cache()
        with pytest.warns(TunedConfigWarning, match=r"ngram_hash\.default\.json: not readable"):
            assert tuned_config("ngram_hash", None, {"num_tokens": 1}) is None
        with pytest.warns(TunedConfigWarning, match=r"lookup_rows\.default\.json: no such file"):
            assert tuned_config("lookup_rows", None, {"tier": "uva"}) is None
        with pytest.raises(TunedConfigError, match=r"ngram_hash\.default\.json: not readable"):
            load_tuned_file("ngram_hash", tmp_path / "ngram_hash.default.json")
    tuning.clear_cache()


def _shipped(kernel: str, device: str = "default") -> dict:
    return json.loads((TUNED_DIR / f"{kernel}.{normalize_device_name(device)}.json").read_text())


# The gate's rule when no file serves (as it read before the settings moved), written out.
_GATE_RULE_4_5120 = GateKernelConfig(block_d=1024, num_warps=4, programs_per_sm=None)


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("block_d", 0, "block_d = 0; expected a power of two >= 8"),
        ("block_d", -64, "block_d = -64; expected a power of two >= 8"),
        ("block_d", 100, "block_d = 100; expected a power of two >= 8"),
        ("block_d", "256", "block_d = '256'; expected a power of two >= 8"),
        ("block_d", True, "block_d = True; expected a power of two >= 8"),
        ("num_warps", 0, "num_warps = 0; expected one of 1, 2, 4, 8, 16, 32"),
        ("num_warps", 3, "num_warps = 3; expected one of 1, 2, 4, 8, 16, 32"),
        ("num_stages", 0, "num_stages = 0; expected an int >= 1"),
        ("programs_per_sm", 0, "programs_per_sm = 0; expected None or an int >= 1"),
    ],
)
def test_a_damaged_gate_file_falls_back_to_the_rule_with_a_warning(
    tmp_path: Path, field: str, bad: object, message: str
) -> None:
    data = _shipped("engram_gate")
    data["entries"][0]["config"][field] = bad
    _write(tmp_path, "engram_gate", data)
    with patch.object(tuning, "TUNED_DIR", tmp_path):
        tuning.clear_cache()
        with pytest.warns(TunedConfigWarning) as caught:
            chosen = default_gate_config(4, 5120, 2)
        text = str(caught[0].message)
        assert str(tmp_path / "engram_gate.default.json") in text
        assert rf"entries[0].config: {message}" in text
        assert "the built-in choice (GateKernelConfig) serves instead" in text
        assert chosen == _GATE_RULE_4_5120
    tuning.clear_cache()
    with pytest.raises(ValidationError, match=re.escape(message)):
        GateKernelConfig(**{**data["entries"][0]["config"]})


@pytest.mark.parametrize("flag", ["ring_commit", "fast_mod", "speculate_decode"])
@pytest.mark.parametrize("bad", ["false", 0, None, 1])
def test_hash_flags_must_be_bools(tmp_path: Path, flag: str, bad: object) -> None:
    data = _shipped("ngram_hash")
    data["entries"][1]["config"][flag] = bad
    _write(tmp_path, "ngram_hash", data)
    with patch.object(tuning, "TUNED_DIR", tmp_path):
        tuning.clear_cache()
        with pytest.warns(TunedConfigWarning, match=rf"entries\[1\]\.config: {flag}="):
            chosen = kernel_config_for(256)
        # every field the type's default: block_t 64, 4 warps, scan tile 8192, flags on
        assert (chosen.block_t, chosen.num_warps, chosen.scan_tile) == (64, 4, 8192)
        assert (chosen.ring_commit, chosen.fast_mod, chosen.speculate_decode) == (True,) * 3
    tuning.clear_cache()


def test_a_device_field_naming_another_gpu_is_set_aside(tmp_path: Path) -> None:
    """A device's own file whose ``device`` field names another GPU falls back to the
    default file (its entry, not the rule)."""
    for kernel in KERNELS:
        _write(tmp_path, kernel, _shipped(kernel))
    own = _shipped("engram_gate", H200)
    own["device"] = "NVIDIA A100-SXM4-80GB"
    own["entries"][0]["config"]["block_d"] = 2048  # would differ from the default file's
    (tmp_path / "engram_gate.NVIDIA_H200.json").write_text(json.dumps(own))
    with patch.object(tuning, "TUNED_DIR", tmp_path):
        tuning.clear_cache()
        with pytest.warns(TunedConfigWarning) as caught:
            chosen = default_gate_config(4, 5120, 2, device=H200)
        text = str(caught[0].message)
        assert "engram_gate.NVIDIA_H200.json: device: 'NVIDIA A100-SXM4-80GB'" in text
        assert "expected the device the file is named for ('NVIDIA_H200'" in text
        assert f"the default file {tmp_path / 'engram_gate.default.json'} serves instead" in text
        default_entry = _shipped("engram_gate")["entries"][0]["config"]
        assert chosen == GateKernelConfig(**default_entry)
        assert chosen.block_d == 1024
        # a device field missing altogether is set aside the same way
        del own["device"]
        (tmp_path / "engram_gate.NVIDIA_H200.json").write_text(json.dumps(own))
        tuning.clear_cache()
        with pytest.warns(TunedConfigWarning, match=r"NVIDIA_H200\.json: device: None"):
            assert default_gate_config(4, 5120, 2, device=H200).block_d == 1024
    tuning.clear_cache()
    with pytest.raises(Exception, match=r"kernel = 'nope'; expected one of"):
        tuned_config("nope", None, {})


def test_written_entries_replace_their_match_and_keep_the_others(tmp_path: Path) -> None:
    name = "Test GPU"
    new = HashKernelConfig(block_t=8, num_warps=1)
    path = write_tuned_config(
        "ngram_hash", name, ("num_tokens",), [({"num_tokens": {"max": 1024}}, new)], tmp_path
    )
    assert path == tmp_path / "ngram_hash.Test_GPU.json"
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left behind
    with patch.object(tuning, "TUNED_DIR", tmp_path):
        tuning.clear_cache()
        assert kernel_config_for(1024, name) == new
        assert kernel_config_for(1025, name) == _before_hash(1025)  # kept
        assert kernel_config_for(2**40, name) == _before_hash(2**40)  # kept
        # a new, narrower bucket goes before the wider ones
        narrow = HashKernelConfig(block_t=32, num_warps=2)
        write_tuned_config(
            "ngram_hash", name, ("num_tokens",), [({"num_tokens": {"max": 64}}, narrow)], tmp_path
        )
        assert kernel_config_for(64, name) == narrow
        assert kernel_config_for(65, name) == new
        first = json.loads(path.read_text())["entries"][0]["config"]
        assert HashKernelConfig(**first) == narrow
    tuning.clear_cache()
    with pytest.raises(Exception, match="expected a HashKernelConfig"):
        write_tuned_config("ngram_hash", name, ("num_tokens",), [({}, new.block_t)], tmp_path)


def test_rewriting_todays_choices_gives_the_shipped_entries(tmp_path: Path) -> None:
    """The writer's format is the reader's: writing the shipped choices back yields the
    shipped file's entries unchanged."""
    for kernel in KERNELS:
        shipped = json.loads((TUNED_DIR / f"{kernel}.NVIDIA_H200.json").read_text())
        entries = [
            (
                entry["match"],
                tuning.config_type(kernel)(**entry["config"]),
            )
            for entry in shipped["entries"]
        ]
        path = write_tuned_config(kernel, H200, shipped["key"], entries, tmp_path)
        written = json.loads(path.read_text())
        assert written["entries"] == shipped["entries"], kernel
        assert written["key"] == shipped["key"]
