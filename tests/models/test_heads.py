"""``python -m engramrt_lab.models.heads``: how far the hash heads of one order agree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import TablePlacement
from engramrt_lab.models.heads import agreement, contributions, main


def test_agreement_of_known_directions() -> None:
    """Alike: cosine 1, coherence 1; opposite: -1, 0; orthogonal of one norm: 0, 1/sqrt(2);
    all zero: coherence 0."""
    x, y = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 2.0])
    contrib = torch.stack(
        [
            torch.stack([x, 2 * x]),  # order 0: alike
            torch.stack([x, -x]),  # order 1: opposite
            torch.stack([x, y * 1.5]),  # order 2: orthogonal, one norm
            torch.zeros(2, 2),  # order 3: nothing
        ]
    )[None]  # [T=1, orders=4, K=2, D=2]
    cosine, coherence = agreement(contrib)
    torch.testing.assert_close(cosine[0, :3], torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(coherence[0], torch.tensor([1.0, 0.0, 1 / math.sqrt(2), 0.0]))


def test_contributions_are_each_columns_row_times_its_value_block(trained_dir: Path) -> None:
    from engramrt_lab.models.serve import load_model

    model = load_model(
        trained_dir, TablePlacement("device", device="cpu"), load_baseline=False,
        head_backend="reference",
    )  # fmt: skip
    row_ids = model.segment_row_ids(model.sample)[:7, 1].cpu()  # layer index 1, 7 positions
    found = contributions(model, 1, row_ids)  # [7, 3, 4, D]
    E, D, hc = model.config.head_dim, model.lm_config.dim, model.lm_config.hc_mult
    wkv = model.lm.engram_head(model.lm_config.engram_layer_ids[1]).wkv.weight.detach()
    rows = lookup_rows_reference(row_ids, model.packed_tables[1], E).float()
    for col in range(row_ids.shape[1]):
        block = wkv[hc * D :, col * E : (col + 1) * E].float()  # [D, E]
        expected = rows[:, col] @ block.T
        torch.testing.assert_close(found[:, col // 4, col % 4], expected, rtol=1e-5, atol=1e-6)


def test_the_command_on_a_model_directory(trained_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "heads.json"
    assert main([str(trained_dir), "--random-sequences", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["orders"] == [2, 3, 4] and result["heads_per_order"] == 4
    assert result["random"]["positions"] == 3 * 64  # the sample's sequence length
    for part in ("sample", "random"):
        for block in ("1", "2"):
            values = result[part][block]
            assert all(-1 <= v <= 1 for v in values["cosine"])
            assert all(0 <= v <= 1 for v in values["coherence"])
            assert f"| {block} ({part}) |" in printed


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--random-sequences", "0"], "--random-sequences=0 must be at least 1"),
        (["/nonexistent/model"], "model '/nonexistent/model' cannot be loaded"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(capsys, args, needle) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
