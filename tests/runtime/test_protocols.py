"""The runtime composes any row-id maker, row source and head that keep the protocols.

A token-keyed id family (row id = token id mod the rows of a column, per
column) and a head written against :class:`~engramrt.protocols.LayerHead`
alone run through ``plan`` / ``run``, the layer and the custom operators;
the output is checked against the same formula computed straight from the
token ids, and a shifted id maker shows the check can fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engramrt import custom_ops
from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch, HashConstants, NgramHasher
from engramrt.layer import EngramLayer
from engramrt.layout import EngramLayout
from engramrt.protocols import LayerHead, RowIdMaker
from engramrt.runtime import EngramRuntime
from engramrt.source import RowSource

N_LAYERS, N_COLS, ROWS, E, HC, D = 2, 3, 11, 8, 2, 4


class TokenKeyedIds:
    """Row id of column ``c`` = ``c * ROWS + (token + shift) mod ROWS``: no hashing."""

    n_layers = N_LAYERS
    num_cols = N_COLS
    device = torch.device("cpu")
    out_dtype = torch.int64
    history_window = 0  # a token's ids depend on the token alone

    def __init__(self, shift: int = 0) -> None:
        self.shift = shift

    def __call__(
        self, batch: HashBatch, history: Any = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        keys = (batch.input_ids.long() + self.shift) % ROWS  # [T]
        cols = torch.arange(N_COLS) * ROWS  # [C]
        ids = (keys[:, None, None] + cols[None, None, :]).expand(-1, N_LAYERS, -1)
        if out is None:
            return ids.clone()
        return out.copy_(ids)


class TableSource(RowSource):
    """Rows of a bf16 table ``[C * ROWS, E]`` by global row id."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.E = table.shape[1]
        self.device = table.device

    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.table[row_ids.long()]  # [T, C, E]
        if out is None:
            return rows
        return out.copy_(rows)


class MeanHead:
    """``out = hidden + scale[h] * mean(rows of the token)``, masked tokens unchanged."""

    hidden_size, hc_mult, head_dim, num_cols = D, HC, E, N_COLS
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.scale = torch.ones(HC)
        self.out = torch.empty(0, HC, D, dtype=torch.bfloat16)

    def reserve(self, max_tokens: int) -> None:
        self.out = torch.full((max_tokens, HC, D), float("nan"), dtype=torch.bfloat16)

    def output_buffer(self, num_tokens: int) -> torch.Tensor:
        return self.out[:num_tokens]

    def load_weights(self, **weights: Any) -> None:
        self.scale = weights["scale"].float()

    def compute(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        step: Any = None,
        out: torch.Tensor | None = None,
        kv_out: torch.Tensor | None = None,
        return_kv: bool = False,
    ) -> Any:
        mean = rows.float().mean(dim=(1, 2))  # [T]
        result = hidden.float() + self.scale[None, :, None] * mean[:, None, None]
        if token_mask is not None:
            result = torch.where(token_mask[:, None, None], result, hidden.float())
        if out is None:
            out = torch.empty(hidden.shape, dtype=torch.bfloat16)
        out.copy_(result)
        return (out, kv_out) if return_kv else out


def _tables(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(N_COLS * ROWS, E, generator=gen).bfloat16() for _ in range(N_LAYERS)]


def _expected(tokens: torch.Tensor, hidden: torch.Tensor, table: torch.Tensor, scale) -> Any:
    """The head's formula straight from the token ids: column c of token t reads row
    ``c * ROWS + t mod ROWS``."""
    want = torch.empty(hidden.shape, dtype=torch.float32)
    for t, token in enumerate(tokens.tolist()):
        picked = [table[c * ROWS + token % ROWS].float() for c in range(N_COLS)]
        mean = torch.stack(picked).mean()
        want[t] = hidden[t].float() + scale[:, None] * mean
    return want.bfloat16()


def _step(num_tokens: int, seed: int) -> tuple[HashBatch, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (num_tokens,), generator=gen)
    hidden = torch.randn(num_tokens, HC, D, generator=gen).bfloat16()
    return HashBatch.single(tokens.tolist()), hidden


def _runtime(ids: RowIdMaker, tables: list[torch.Tensor], heads: list[LayerHead]) -> Any:
    sources = [TableSource(table) for table in tables]
    return EngramRuntime(ids, sources, heads=heads, max_tokens=16, max_requests=2)


def _run_steps(ids: RowIdMaker) -> list[bool]:
    """Per layer and step, whether ``run`` matched the formula from the token ids."""
    tables = _tables(0)
    heads: list[LayerHead] = [MeanHead() for _ in range(N_LAYERS)]
    heads[1].load_weights(scale=torch.tensor([0.5, -2.0]))
    runtime = _runtime(ids, tables, heads)
    matches = []
    for num_tokens, seed in ((7, 1), (1, 2), (13, 3)):
        batch, hidden = _step(num_tokens, seed)
        runtime.plan(batch)
        for index in range(N_LAYERS):
            got = runtime.run(index, hidden)
            want = _expected(batch.input_ids, hidden, tables[index], heads[index].scale)
            matches.append(torch.equal(got, want))
    runtime.close()
    return matches


def test_protocol_parts_run_through_the_runtime() -> None:
    assert isinstance(TokenKeyedIds(), RowIdMaker)
    assert isinstance(MeanHead(), LayerHead)
    assert all(_run_steps(TokenKeyedIds()))


def test_wrong_ids_fail_the_check() -> None:
    """Negative control: rows of the neighbouring key give other outputs."""
    assert not any(_run_steps(TokenKeyedIds(shift=1)))


def test_rows_without_heads_and_token_mask() -> None:
    tables = _tables(4)
    runtime = EngramRuntime(
        TokenKeyedIds(), [TableSource(t) for t in tables], max_tokens=16, max_requests=2
    )
    batch, _ = _step(9, 5)
    plan = runtime.plan(batch)
    keys = batch.input_ids % ROWS
    for index, table in enumerate(tables):
        want = torch.stack([table[c * ROWS + keys] for c in range(N_COLS)], dim=1)
        assert torch.equal(plan.rows(index), want)
    runtime.close()

    head = MeanHead()
    layer = EngramLayer(head, TableSource(tables[0]), max_tokens=16)
    batch, hidden = _step(6, 6)
    mask = torch.tensor([True, False, True, True, False, True])
    got = layer(hidden, TokenKeyedIds()(batch)[:, 0], mask)
    want = _expected(batch.input_ids, hidden, tables[0], head.scale)
    assert torch.equal(got[mask], want[mask])
    assert torch.equal(got[~mask], hidden[~mask])


def test_custom_ops_use_the_protocols() -> None:
    tables = _tables(7)
    heads: list[LayerHead] = [MeanHead() for _ in range(N_LAYERS)]
    runtime = _runtime(TokenKeyedIds(), tables, heads)
    batch, hidden = _step(5, 8)
    row_ids = custom_ops.plan(runtime, batch)
    assert row_ids.shape == (5, N_LAYERS, N_COLS) and row_ids.dtype == torch.int64
    for index in range(N_LAYERS):
        got = custom_ops.run_layer(runtime, index, hidden, row_ids)
        assert torch.equal(
            got, _expected(batch.input_ids, hidden, tables[index], heads[index].scale)
        )
    runtime.close()


def test_entry_points_refuse_what_breaks_the_protocols() -> None:
    tables = _tables(9)
    with pytest.raises(ValidationError, match="row-id maker"):
        EngramRuntime(object(), [TableSource(t) for t in tables], max_tokens=4, max_requests=1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="expected a head"):
        EngramLayer(object(), TableSource(tables[0]), max_tokens=4)  # type: ignore[arg-type]


def test_ngram_hasher_keeps_the_protocol(token_map) -> None:
    from engramrt.config import PRESETS

    consts = HashConstants.from_layout(
        EngramLayout(PRESETS["tiny"]), token_map.pad_id(PRESETS["tiny"])
    )
    hasher = NgramHasher(consts, token_map, "cpu")
    assert isinstance(hasher, RowIdMaker)
    assert (hasher.n_layers, hasher.num_cols) == (consts.n_layers, consts.n_cols)
