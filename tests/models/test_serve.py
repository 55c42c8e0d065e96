"""Serving the trained model: identical greedy tokens across tiers, history modes and
schedules, identical to the eager reference, and controls that show the checks can fail.

The model: the directory the ``trained_dir`` fixture trains for 4 steps on the CPU
(real corpus, real conversion to fp8, real loader), with the backbone then
re-initialised at a larger scale (``std=0.3``, the same seed for every load, the
Engram value weights random too rather than the training's zero start): four
training steps leave a model that repeats one token, which would make "identical
tokens" hold trivially. Rows, hashing and the Engram heads' shapes are the trained
ones; the heads' weights follow the re-initialised backbone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engramrt.errors import EngramError
from engramrt.lookup.tiers import TablePlacement
from engramrt_lab.models.serve import TinyEngramModel, load_model

MAX_NEW = 5
HOST = TablePlacement("host", device="cpu")
ON_CPU = TablePlacement("device", device="cpu")
BLOCK = 4
GATE_TOLERANCE = 1e-3
"""Gates of the same token from a chunk and from a whole-sequence forward: the same
fp32 ops on hidden states that differ by float reassociation in attention (~1e-6
relative), through a sigmoid (slope <= 1/4) of a square root of a normalised dot
product. How far that difference travels depends on the fixture's model, which is
trained on the running Python's stdlib files: the worst gate seen is ~3e-5 on some
Pythons and 1.0e-4 (mean 5e-6) on CPython 3.11.7. 1e-3 is ten times that; a wrong
row moves the gate by ~4e-2 (``test_a_perturbed_fp8_row_is_caught``), and the
tokens are compared exactly."""


def _load(
    trained_dir: Path,
    tier: str,
    tmp_path: Path,
    device: torch.device | str = "cpu",
    **options: object,
) -> TinyEngramModel:
    model = load_model(
        trained_dir,
        TablePlacement(tier, device=device, disk_dir=tmp_path / "rows"),
        load_baseline=False,
        **{"head_backend": "reference", **options},  # type: ignore[arg-type]
    )
    torch.manual_seed(3)
    model.lm.reset_parameters(std=0.3, engram_identity=False)  # the memory must matter
    model.load_heads()
    return model


def _prompts(model: TinyEngramModel) -> list[list[int]]:
    """Request A: 11 held-out tokens; request B: A's first 9 tokens (two blocks of 4 are
    a prefix-cache hit) then 4 other tokens."""
    first = [int(t) for t in model.sample.tokens[0][:11]]
    other = [int(t) for t in model.sample.tokens[1][3:7]]
    return [first, first[:9] + other]


@pytest.fixture(scope="module")
def reference(trained_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Tokens and gates served from the host tier with slot history, and the eager
    reference's verdict on them."""
    model = _load(trained_dir, "host", tmp_path_factory.mktemp("ref"))
    prompts = _prompts(model)
    served = model.generate(prompts, MAX_NEW, history="slot", chunk_size=5, block_size=BLOCK)
    checks = [model.reference_check(p, t) for p, t in zip(prompts, served.tokens, strict=True)]
    return {"model": model, "prompts": prompts, "served": served, "checks": checks}


def test_generation_matches_the_eager_reference(reference: dict) -> None:
    served = reference["served"]
    assert served.prefix_hit_tokens == [0, 2 * BLOCK]
    assert served.rejected_drafts == 2 and served.accepted_drafts == 0
    kinds = [s["kind"] for s in served.steps]
    assert (
        kinds.count("verify") == 1 and kinds.count("prefill") == 3 + 1
    )  # A: 5 + 5 + 1; B: 5 after the hit
    for tokens, check in zip(served.tokens, reference["checks"], strict=True):
        assert len(tokens) == MAX_NEW
        assert tokens == check.tokens
    # Not a model that repeats itself: the test would hold trivially.
    assert len(set(served.tokens[0])) > 2
    for gates, check in zip(served.gates, reference["checks"], strict=True):
        assert gates.shape == check.gates.shape
        assert not np.isnan(gates).any()
        worst = np.abs(gates - check.gates).max()
        assert worst <= GATE_TOLERANCE, worst


def test_reference_generate_agrees_with_its_check(reference: dict) -> None:
    """reference_generate (a full forward per token) gives what reference_check verified."""
    model, prompts = reference["model"], reference["prompts"]
    assert model.reference_generate(prompts[1], 2).tokens == reference["served"].tokens[1][:2]


TIERS = {
    "device": {},  # the device store, on the CPU (its kernels through the interpreter)
    "host": {},
    "disk": {},
    "host+cache": {"cache_mib": 0.05},  # a hot-row cache in front of the host tier
}


@pytest.mark.parametrize("history", ["slot", "request", "lookback"])
@pytest.mark.parametrize("tier", list(TIERS))
def test_tiers_and_history_modes_serve_the_same_tokens(
    trained_dir: Path, tmp_path: Path, reference: dict, tier: str, history: str
) -> None:
    model = _load(trained_dir, tier.split("+")[0], tmp_path, **TIERS[tier])
    chunk = {"slot": 5, "request": 3, "lookback": 4}[history]  # other chunkings, too
    served = model.generate(
        reference["prompts"], MAX_NEW, history=history, chunk_size=chunk, block_size=BLOCK
    )
    assert served.tokens == reference["served"].tokens
    assert served.rejected_drafts == 2 and served.prefix_hit_tokens == [0, 2 * BLOCK]
    if TIERS[tier]:
        stats = served.cache_stats
        assert len(stats) == 2 and all(s is not None for s in stats)


def test_the_fused_gate_kernel_serves_the_same_tokens(
    trained_dir: Path, tmp_path: Path, reference: dict, device: torch.device
) -> None:
    """The heads' Triton gate (through the interpreter on a CPU) instead of the reference.

    On a CPU the tokens must equal the reference fixture's (same device, same
    fp32 arithmetic around the gate); on a GPU the comparison is the eager
    reference's verdict on the same device, since bf16 kernels and fp32 CPU
    code may round a near tie differently."""
    from engramrt._backend import interpreter_enabled

    if device.type != "cuda" and not interpreter_enabled():
        pytest.skip("the Triton gate needs a GPU or TRITON_INTERPRET=1")
    model = _load(trained_dir, "device", tmp_path, head_backend="triton", device=device)
    served = model.generate(
        reference["prompts"], MAX_NEW, history="slot", chunk_size=5, block_size=BLOCK
    )
    if device.type == "cpu":
        assert served.tokens == reference["served"].tokens
    checks = [
        model.reference_check(p, t).tokens
        for p, t in zip(reference["prompts"], served.tokens, strict=True)
    ]
    assert served.tokens == checks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the UVA tier needs CUDA")
def test_uva_tier_serves_the_same_tokens(trained_dir: Path, tmp_path: Path) -> None:
    """UVA rows against the host tier's on the same GPU (the same kernels around them, so
    the tokens must match exactly), and against the eager reference there."""
    cuda = torch.device("cuda")
    host = _load(trained_dir, "host", tmp_path, device=cuda, head_backend="auto")
    prompts = _prompts(host)
    want = host.generate(prompts, MAX_NEW, block_size=BLOCK).tokens
    model = _load(trained_dir, "uva", tmp_path, device=cuda, head_backend="auto")
    served = model.generate(prompts, MAX_NEW, block_size=BLOCK)
    checks = [
        model.reference_check(p, t).tokens for p, t in zip(prompts, served.tokens, strict=True)
    ]
    assert served.tokens == checks
    assert served.tokens == want


def test_a_perturbed_fp8_row_is_caught(trained_dir: Path, tmp_path: Path, reference: dict) -> None:
    """Negative control: overwrite, in the serving store only, the fp8 rows that the last
    prompt token of request A reads in the first Engram layer; the served gates at that
    position leave the reference's tolerance and the tokens change."""
    model = _load(trained_dir, "host", tmp_path)
    prompt = reference["prompts"][0]
    from engramrt.hashing import hash_sequence

    row_ids = hash_sequence(model.token_map.compress(prompt), model.consts)[-1, 0]  # [C]
    store = model.stores[0]
    width = model.config.row_bytes  # E fp8 values, then E/32 scale bytes
    rng = np.random.default_rng(0)
    for row in np.unique(row_ids):
        values = rng.integers(0x30, 0x70, size=model.config.head_dim, dtype=np.uint8)  # big fp8
        scales = np.full(width - model.config.head_dim, 127, dtype=np.uint8)
        packed = torch.from_numpy(np.concatenate([values, scales]))[None, :]
        store.write_rows(int(row) - store.row_begin, packed)
    served = model.generate([prompt], MAX_NEW, history="slot", chunk_size=5, block_size=BLOCK)
    check = reference["checks"][0]
    position = len(prompt) - 1
    assert abs(served.gates[0][position, 0] - check.gates[position, 0]) > GATE_TOLERANCE
    assert served.tokens[0] != reference["served"].tokens[0]


def test_a_wrong_history_changes_the_row_ids(reference: dict) -> None:
    """Negative control for the schedule: request B's chunk hashed without its prefix's
    history (as if the prefix-cache hit carried no hash history) gets other row ids
    than its one-shot hashing, so the identity above depends on the history path."""
    from engramrt.hashing import HashBatch, hash_sequence

    model = reference["model"]
    prompt = reference["prompts"][1]
    hit = 2 * BLOCK
    want = hash_sequence(model.token_map.compress(prompt), model.consts)[hit:]
    batch = HashBatch.single(prompt[hit:], start=hit)
    got = model.hasher(batch).to(torch.int64).numpy()
    assert not np.array_equal(got, want)
    batch.lookback_token_ids = torch.tensor([[prompt[hit - 1], prompt[hit - 2], prompt[hit - 3]]])
    assert np.array_equal(model.hasher(batch).to(torch.int64).numpy(), want)


def test_evaluate_the_sample(trained_dir: Path) -> None:
    """The served fp8 model's sample loss is the training record's (the same rows and
    weights; the served path rounds the Engram layers' output to bf16: a small relative
    difference)."""
    model = load_model(trained_dir, HOST, head_backend="reference")
    recorded = model.record["heldout"]["sample_losses"]
    engram = model.evaluate()
    assert abs(engram - recorded["engram_fp8"]) / recorded["engram_fp8"] < 2e-3
    baseline = model.evaluate(model="baseline")
    assert abs(baseline - recorded["baseline"]) / recorded["baseline"] < 2e-3
    with pytest.raises(ValueError, match="model="):
        model.evaluate(model="other")


def test_the_shipped_model_loads_by_name(tmp_path, monkeypatch) -> None:
    """load_model("tiny-lm") is the package data's model (its training record, read here
    from the file); a directory of that name in the working directory still wins."""
    import json

    from engramrt_lab.models.packaged import PACKAGED_MODEL, packaged_model_dir

    monkeypatch.chdir(tmp_path)
    model = load_model(PACKAGED_MODEL, ON_CPU, load_baseline=False)
    on_disk = json.loads((packaged_model_dir() / "model.json").read_text(encoding="utf-8"))
    assert model.record == on_disk["training"]
    (tmp_path / PACKAGED_MODEL).mkdir()
    with pytest.raises(EngramError, match=r"model\.json"):
        load_model(PACKAGED_MODEL, ON_CPU, load_baseline=False)
