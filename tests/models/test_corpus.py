"""The corpus builder (dedup, split, manifest) and the one-pass sampler."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engramrt.errors import ValidationError
from engramrt_lab.models.corpus import (
    LONG_LINE_CHARS,
    build_corpus,
    deduplicate,
    manifest_differences,
    split_of,
)
from engramrt_lab.models.train import OnePassWindows


def _lines(prefix: str, count: int) -> list[str]:
    return [
        f"{prefix}_{i} = compute_something_long({i}, {i + 1}, {i + 2})  # x" for i in range(count)
    ]


def test_deduplicate_drops_exact_and_near_copies() -> None:
    base = _lines("a", 10)
    assert all(len(line) >= LONG_LINE_CHARS for line in base)
    texts = [
        "\n".join(base),
        "\n".join("   " + line + "  " for line in base) + "\n\n",  # exact after normalising
        "\n".join(base[:6] + _lines("b", 4)),  # 6 of 10 long lines seen: near copy
        "\n".join(base[:5] + _lines("c", 5)),  # 5 of 10: kept
        "\n".join(base[:3]),  # too few long lines to judge: kept
        "\n".join(base),  # an exact copy, but forced (a held-out file)
    ]
    keep, stats = deduplicate(texts, range(len(texts)), [False] * 5 + [True])
    assert keep == [True, False, False, True, True, True]
    assert stats == {"dropped_exact_duplicates": 1, "dropped_near_duplicates": 1}
    # The order decides which copy stays.
    keep, _ = deduplicate(texts[:2], [1, 0])
    assert keep == [False, True]


def test_split_rule_for_packages() -> None:
    assert split_of("pkg:click/core.py") == "package_heldout"
    assert split_of("pkg:rich/console.py") == "package_heldout"
    assert split_of("pkg:typer.py") == "package_heldout"
    assert split_of("pkg:clicker/core.py") == "train"
    assert split_of("pkg:numpy/core/x.py") == "train"
    # stdlib names keep the old rule (a path's sha256 residue decides).
    import hashlib

    for name in ("os.py", "json/decoder.py", "asyncio/tasks.py"):
        residue = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 20
        want = {0: "heldout", 1: "validation"}.get(residue, "train")
        assert split_of(name) == want


def test_corpus_split_dedup_and_manifest(tiny_sources, tmp_path: Path) -> None:
    from engramrt.tokenmap import load_tokenizer

    tokenizer = load_tokenizer()
    stdlib, site = tiny_sources
    first = build_corpus(tokenizer, root=stdlib, sites=[site])
    again = build_corpus(tokenizer, root=stdlib, sites=[site])
    assert manifest_differences(first.record(), again.record()) == []
    names = set(first.train.files)
    assert "pkg:toolkit/copy.py" not in names and "pkg:toolkit/near.py" not in names
    assert {"pkg:toolkit/mod0.py", "pkg:toolkit/mod1.py", "pkg:toolkit/mod2.py"} <= names
    assert all(split_of(n) == "train" for n in names)
    assert all(split_of(n) == "heldout" for n in first.heldout.files)
    assert all(n.startswith("pkg:click/") for n in first.package_heldout.files)
    assert len(first.heldout.files) == 2 and len(first.validation.files) == 2
    record = first.record()
    assert record["dropped_exact_duplicates"] == 2 and record["files_found"] == 25
    assert record["train_files"] == 14 + 3 and record["package_heldout_found"] == ["click"]
    # The character budget keeps every stdlib training file, then package files.
    small = build_corpus(tokenizer, root=stdlib, sites=[site], max_train_chars=1)
    assert all(not n.startswith("pkg:") for n in small.train.files)
    assert len(small.train.files) == 14
    # A changed file changes the digest and the comparison says so.
    changed_site = tmp_path / "site"
    shutil.copytree(site, changed_site)
    target = changed_site / "toolkit" / "mod0.py"
    target.write_text(target.read_text() + "\nextra_line = 1\n")
    changed = build_corpus(tokenizer, root=stdlib, sites=[changed_site])
    diffs = manifest_differences(first.record(), changed.record())
    assert any(d.startswith("kept_sha256") for d in diffs)
    assert any(d.startswith("train_tokens") for d in diffs)


def test_one_pass_windows_see_each_token_at_most_once() -> None:
    windows = OnePassWindows(1001, seq_len=10, batch_size=4, seed=3, device=torch.device("cpu"))
    assert windows.num_windows == 100 and windows.steps == 25
    targets = torch.cat([windows.batch(s)[:, 1:].reshape(-1) for s in range(windows.steps)])
    # Every target position once: an independent count over all batches.
    assert torch.equal(
        torch.bincount(targets, minlength=1001)[1:], torch.ones(1000, dtype=torch.long)
    )
    inputs = torch.cat([windows.batch(s)[:, :-1].reshape(-1) for s in range(windows.steps)])
    assert int(torch.bincount(inputs).max()) == 1
    same = OnePassWindows(1001, 10, 4, 3, torch.device("cpu"))
    other = OnePassWindows(1001, 10, 4, 4, torch.device("cpu"))
    assert torch.equal(same.batch(0), windows.batch(0))
    assert not torch.equal(other.order, windows.order)
    with pytest.raises(ValidationError, match="one pass has steps"):
        windows.batch(25)
    with pytest.raises(ValidationError, match="fewer than --batch-size"):
        OnePassWindows(30, 10, 4, 0, torch.device("cpu"))


def test_training_stops_at_one_pass(tmp_path: Path) -> None:
    from engramrt_lab.models.lm import LMConfig, TinyLM
    from engramrt_lab.models.train import TrainSettings, train_model

    settings = TrainSettings(out=tmp_path, batch_size=2, seq_len=8)
    config = LMConfig(vocab_size=50, dim=32, n_blocks=1, n_heads=2, head_dim=16, mlp_dim=32)
    tokens = torch.randint(0, 50, (81,))  # 10 windows: 5 steps
    run = train_model(
        "baseline", TinyLM(config), [], tokens, None, settings, steps=50, budget_s=None
    )
    assert run.steps == run.schedule_steps == 5 and run.tokens_seen == 5 * 2 * 8
    assert any("one pass holds 5" in line for line in settings.log)
