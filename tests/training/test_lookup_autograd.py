"""The trainable table: forward as the inference lookup, sparse gradient as dense autograd's."""

from __future__ import annotations

import pytest
import torch

from engramrt.errors import ValidationError
from engramrt.lookup.reference import lookup_rows_reference
from engramrt.quant.reference import dequantize_rows_reference, quantize_rows_reference
from engramrt_lab.training import EngramTable, lookup_master_rows
from engramrt_lab.training import lookup as lookup_module


def _row_ids(num_tokens, num_cols, low, high, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (num_tokens, num_cols), generator=generator)


class _DensifyGrad(torch.autograd.Function):
    """Identity whose backward turns the sparse table gradient dense: gradcheck
    requires a gradient in the input's layout."""

    @staticmethod
    def forward(ctx, table):
        return table.view_as(table)

    @staticmethod
    def backward(ctx, grad):
        assert grad.is_sparse  # the lookup's own backward stayed sparse
        return grad.to_dense()


def _gradcheck(row_ids, table, *cols, raise_exception=True):
    return torch.autograd.gradcheck(
        lambda w: lookup_master_rows(row_ids, _DensifyGrad.apply(w), *cols),
        (table,),
        raise_exception=raise_exception,
    )


def _dense_lookup(row_ids, table, col_begin, col_end, row_begin):
    """Per-element transcription of the lookup contract, through plain indexing."""
    num_tokens, num_cols = row_ids.shape
    pieces = []
    for t in range(num_tokens):
        per_col = []
        for c in range(num_cols):
            local = int(row_ids[t, c]) - row_begin
            if col_begin <= c < col_end and 0 <= local < table.shape[0]:
                per_col.append(table[local])
            else:
                per_col.append(torch.zeros(table.shape[1], dtype=table.dtype))
        pieces.append(torch.stack(per_col))
    return torch.stack(pieces)


def _dense_gather(row_ids, table, col_begin, col_end, row_begin):
    """The lookup as a dense-gradient gather (``index_select``, as ``nn.Embedding``
    without ``sparse=True``): its autograd builds a full ``[num_rows, E]`` gradient."""
    local = row_ids - row_begin
    keep = (local >= 0) & (local < table.shape[0])
    cols = torch.arange(row_ids.shape[1])
    keep &= (cols >= col_begin) & (cols < col_end)
    rows = table.index_select(0, torch.where(keep, local, 0).reshape(-1))
    rows = rows.reshape(*row_ids.shape, table.shape[1])
    return torch.where(keep.unsqueeze(-1), rows, 0.0)


def test_forward_matches_the_lookup_contract():
    table = torch.randn(11, 6)
    row_ids = _row_ids(5, 4, 95, 115, seed=1)  # some ids below and past rows [100, 111)
    out = lookup_master_rows(row_ids, table, col_begin=1, col_end=3, row_begin=100)
    assert torch.equal(out, _dense_lookup(row_ids, table, 1, 3, 100))
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))


@pytest.mark.parametrize(("col_begin", "col_end", "row_begin"), [(0, 4, 0), (1, 3, 20)])
def test_sparse_gradient_equals_dense_autograd(col_begin, col_end, row_begin):
    num_rows, dim = 9, 5
    # 6 tokens x 4 columns over 9 rows: duplicates are certain; some ids fall outside.
    row_ids = _row_ids(6, 4, row_begin - 2, row_begin + num_rows + 2, seed=row_begin + 4)
    assert row_ids.unique().numel() < row_ids.numel()
    table = torch.randn(num_rows, dim, requires_grad=True)
    grad_out = torch.randn(6, 4, dim)
    lookup_master_rows(row_ids, table, col_begin, col_end, row_begin).backward(grad_out)
    sparse = table.grad
    assert sparse is not None and sparse.is_sparse

    dense_table = table.detach().clone().requires_grad_()
    _dense_gather(row_ids, dense_table, col_begin, col_end, row_begin).backward(grad_out)
    dense = dense_table.grad
    # index_add in occurrence order on both sides: bit for bit.
    torch.testing.assert_close(sparse.to_dense(), dense, rtol=0, atol=0)

    owned = row_ids[:, col_begin:col_end].reshape(-1) - row_begin
    touched = owned[(owned >= 0) & (owned < num_rows)].unique()
    # Only the touched rows are stored, each once.
    assert torch.equal(sparse._indices()[0], touched)


def test_gradcheck_float64():
    table = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    row_ids = _row_ids(4, 3, -1, 9, seed=2)
    assert _gradcheck(row_ids, table, 0, 2, 0)


def test_wrong_backward_is_caught(monkeypatch):
    """Negative control: a 1% error in the summed row gradients fails both checks."""
    right = lookup_module.sum_rows_by_id

    def scaled(ids, grads):
        unique_ids, summed = right(ids, grads)
        return unique_ids, summed * 1.01

    monkeypatch.setattr(lookup_module, "sum_rows_by_id", scaled)
    table = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    row_ids = _row_ids(4, 3, 0, 7, seed=2)
    assert not _gradcheck(row_ids, table, raise_exception=False)
    grad_out = torch.randn(4, 3, 3, dtype=torch.float64)
    lookup_master_rows(row_ids, table).backward(grad_out)
    dense_table = table.detach().clone().requires_grad_()
    _dense_gather(row_ids, dense_table, 0, 3, 0).backward(grad_out)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(table.grad.to_dense(), dense_table.grad, rtol=0, atol=0)


def test_engram_table_module():
    module = EngramTable(13, 4, row_begin=50, col_begin=1, col_end=3)
    assert module.weight.dtype == torch.float32 and module.weight.shape == (13, 4)
    row_ids = _row_ids(3, 4, 50, 63, seed=8)
    out = module(row_ids)
    assert torch.equal(out, _dense_lookup(row_ids, module.weight.detach(), 1, 3, 50))
    out.square().sum().backward()
    assert module.weight.grad is not None and module.weight.grad.is_sparse


def test_no_owned_ids_give_an_empty_sparse_gradient():
    table = torch.randn(5, 2, requires_grad=True)
    row_ids = torch.tensor([[0, 1], [2, 3]])
    lookup_master_rows(row_ids, table, col_begin=1, col_end=1).sum().backward()
    assert table.grad is not None and table.grad._nnz() == 0


def test_bad_inputs_are_refused():
    table = torch.randn(5, 2)
    with pytest.raises(ValidationError, match="row_ids must be a \\[T, C\\] int32/int64"):
        lookup_master_rows(torch.zeros(3, 2), table)
    with pytest.raises(ValidationError, match="col_end <= C = 2, got 0, 3"):
        lookup_master_rows(torch.zeros(3, 2, dtype=torch.int64), table, 0, 3)
    with pytest.raises(ValidationError, match="E must be > 0, got 0"):
        EngramTable(4, 0)
    with pytest.raises(ValidationError, match=r"init_std must be a finite number >= 0, got -0\.1"):
        EngramTable(4, 8, init_std=-0.1)
    assert torch.count_nonzero(EngramTable(4, 8, init_std=0.0).weight) == 0


def test_packed_rows_serve_through_the_inference_lookup():
    module = EngramTable(10, 64, row_begin=30, col_begin=1, col_end=4, init_std=0.5)
    packed = module.packed_rows(backend="reference")
    assert packed.dtype == torch.uint8 and packed.shape == (10, 64 + 2)
    row_ids = _row_ids(6, 4, 28, 42, seed=12)
    served = lookup_rows_reference(row_ids, packed, 64, col_begin=1, col_end=4, row_begin=30)
    values, scales = quantize_rows_reference(module.weight.detach())
    dequantized = dequantize_rows_reference(values, scales)  # [10, 64] bf16
    assert torch.equal(served, _dense_lookup(row_ids, dequantized, 1, 4, 30))
    # And close to the fp32 rows: e4m3 keeps 3 mantissa bits (relative error
    # <= 2^-4), its subnormals are spaced 2^-9 * scale, bf16 adds 2^-9 relative.
    trained = module(row_ids).detach()
    block_scale = torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1)  # [10, 64]
    scale = _dense_lookup(row_ids, block_scale, 1, 4, 30)
    bound = trained.double().abs() * (2**-4 + 2**-8) + scale * 2**-9
    assert bool(((served.double() - trained.double()).abs() <= bound).all())
