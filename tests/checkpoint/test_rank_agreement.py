"""Ranks loading one checkpoint with ``group=`` hold the same conversion, or refuse.

Two processes (tests/checkpoint/agree_worker.py; gloo, and NCCL where two GPUs
are visible) load a tp=2 conversion while conversions commit into its
directory between the ranks' opens; the rows each rank served are compared
here with the reference quantisation of the source it should hold.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from tests.checkpoint import agree_worker
from tests.spawn import spawn_world

from engramrt.checkpoint import SafetensorsCheckpoint, convert_checkpoint
from engramrt.checkpoint.conversion_set import read_manifest

from .test_conversion_set import _rank_rows, _source

WORLD = 2
DEADLINE_S = 120.0  # start-up included (about 20 s on 2 cores)


@pytest.fixture(
    scope="module",
    params=[
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices"
            ),
        ),
    ],
)
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    from .conftest import synthetic_config

    config = synthetic_config()
    work = tmp_path_factory.mktemp("agree")
    (work / "config.json").write_text(json.dumps(config.to_hf_dict()))
    _, packed_a = _source(work / "a.safetensors", config, 1)
    _, packed_b = _source(work / "b.safetensors", config, 2)
    convert_checkpoint(work / "a.safetensors", work / "dst", config, tp=WORLD)
    id_a = read_manifest(work / "dst").conversion_id  # type: ignore[union-attr]
    out = tmp_path_factory.mktemp("agree-out")
    backend = request.param
    spawn_world(
        agree_worker.run, WORLD, out, str(work), backend, deadline_s=DEADLINE_S, label=backend
    )
    results = {rank: torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)}
    return {
        "config": config,
        "results": results,
        "want": {
            label: [_rank_rows(config, packed, WORLD, rank) for rank in range(WORLD)]
            for label, packed in (("A", packed_a), ("B", packed_b))
        },
        "id_a": id_a,
        "id_final": read_manifest(work / "dst").conversion_id,  # type: ignore[union-attr]
    }


def _rows_are(world: dict[str, Any], key: str, label: str) -> None:
    for rank in range(WORLD):
        got = world["results"][rank][key]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        want = world["want"][label][rank]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (rank, key)


def test_ranks_of_one_conversion_load_it_and_expose_its_id(world) -> None:
    _rows_are(world, "same", "A")
    assert [world["results"][r]["same_id"] for r in range(WORLD)] == [world["id_a"]] * WORLD


def test_open_checkpoints_of_different_conversions_are_refused_naming_both(world) -> None:
    ids = [world["results"][r]["passed_open_id"] for r in range(WORLD)]
    assert ids[0] == world["id_a"] and ids[1] != ids[0]  # the race really happened
    for rank in range(WORLD):
        message = world["results"][rank]["passed-open"]
        assert isinstance(message, str), f"rank {rank} served rows of a mixed world"
        assert f"rank 0: conversion {ids[0]}" in message, message
        assert f"rank 1: conversion {ids[1]}" in message, message
        assert "passed open" in message, message


def test_paths_are_opened_again_until_the_ranks_agree(world) -> None:
    opens = [world["results"][r]["reopened_opens"] for r in range(WORLD)]
    # First attempt: rank 0 held B, rank 1 (opening after A committed) held A.
    assert opens[0][0] != opens[1][0], opens
    assert len(opens[0]) == len(opens[1]) == 2 and opens[0][1] == opens[1][1], opens
    assert opens[0][1] == world["id_final"]
    _rows_are(world, "reopened", "A")


def test_a_rank_that_cannot_open_stops_every_rank(world) -> None:
    own = world["results"][1]["missing"]
    assert isinstance(own, str) and "does not exist" in own, own
    other = world["results"][0]["missing"]
    assert isinstance(other, str) and "rank(s) [1] could not open the checkpoint" in other, other


def test_the_id_of_a_checkpoint_engramrt_did_not_write_is_a_header_digest(tmp_path) -> None:
    from .conftest import float_tables, reference_packed, synthetic_config
    from .conftest import write_deepseek_checkpoint as write

    config = synthetic_config()
    packed = reference_packed(float_tables(config, seed=5))
    (tmp_path / "a").mkdir()
    first = write(tmp_path / "a" / "model.safetensors", config, packed)
    copy = tmp_path / "b" / "model.safetensors"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    with SafetensorsCheckpoint(first.parent) as a, SafetensorsCheckpoint(copy.parent) as b:
        assert a.conversion_id.startswith("headers:") and a.conversion_id == b.conversion_id
    bigger = [torch.cat([t, t[:1]]) for t in packed]  # another file: another id
    write(copy, config.replace(num_embeddings=tuple(t.shape[0] for t in bigger)), bigger)
    with SafetensorsCheckpoint(first.parent) as a, SafetensorsCheckpoint(copy.parent) as b:
        assert a.conversion_id != b.conversion_id
