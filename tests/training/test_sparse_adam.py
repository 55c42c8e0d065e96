"""SparseRowAdam against a dense transcription of lazy Adam and against torch's optimizers."""

from __future__ import annotations

import math

import pytest
import torch

from engramrt.errors import ValidationError
from engramrt.gate import GateInputs
from engramrt_lab.training import EngramTable, SparseRowAdam, engram_gate_train

LR, BETAS, EPS = 1e-2, (0.9, 0.99), 1e-8
NUM_ROWS, DIM, STEPS = 12, 5, 4


def _sparse_grads(seed, num_rows=NUM_ROWS, dim=DIM, steps=STEPS):
    """Per step: a sparse row gradient touching a random subset of rows (rows 0 and 1
    every step, row ``num_rows - 1`` never)."""
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        touched = torch.randperm(num_rows - 3, generator=generator)[:4] + 2
        rows = torch.cat([torch.tensor([0, 1]), touched]).sort().values
        values = torch.randn(rows.numel(), dim, generator=generator)
        grads.append(
            torch.sparse_coo_tensor(
                rows.unsqueeze(0), values, (num_rows, dim), check_invariants=True
            )
        )
    return grads


def _lazy_adam_dense(weight, grads, lr=LR, betas=BETAS, eps=EPS):
    """Lazy Adam on the whole table at once: every row computes the update, rows
    not in the step's gradient keep their old weight and moments."""
    beta1, beta2 = betas
    weight = weight.clone()
    exp_avg = torch.zeros_like(weight)
    exp_avg_sq = torch.zeros_like(weight)
    for step, sparse in enumerate(grads, start=1):
        grad = sparse.to_dense()
        touched = torch.zeros(weight.shape[0], dtype=torch.bool)
        touched[sparse.coalesce().indices()[0]] = True
        touched = touched.unsqueeze(-1)
        m = exp_avg * beta1 + (1 - beta1) * grad
        v = exp_avg_sq * beta2 + (1 - beta2) * grad.square()
        denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
        updated = weight - lr / (1 - beta1**step) * (m / denom)
        weight = torch.where(touched, updated, weight)
        exp_avg = torch.where(touched, m, exp_avg)
        exp_avg_sq = torch.where(touched, v, exp_avg_sq)
    return weight, exp_avg, exp_avg_sq


def _run(weight, grads, optimizer_class=SparseRowAdam, **options):
    param = torch.nn.Parameter(weight.clone())
    optimizer = optimizer_class([param], **{"lr": LR, "betas": BETAS, "eps": EPS, **options})
    for grad in grads:
        param.grad = grad
        optimizer.step()
    return param.detach(), optimizer.state[param]


def _check(weight, grads, actual, state):
    """Touched rows equal the dense transcription bit for bit; never-touched rows
    (and their moments) are bit-identical to before."""
    expected, exp_avg, exp_avg_sq = _lazy_adam_dense(weight, grads)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(state["exp_avg"], exp_avg, rtol=0, atol=0)
    torch.testing.assert_close(state["exp_avg_sq"], exp_avg_sq, rtol=0, atol=0)
    assert torch.equal(actual[-1], weight[-1])
    assert torch.equal(state["exp_avg"][-1], torch.zeros(DIM))


def test_matches_dense_lazy_adam_and_leaves_untouched_rows():
    weight = torch.randn(NUM_ROWS, DIM)
    grads = _sparse_grads(seed=1)
    actual, state = _run(weight, grads)
    _check(weight, grads, actual, state)
    assert state["step"] == STEPS


def test_uncoalesced_duplicate_rows_are_summed():
    weight = torch.randn(NUM_ROWS, DIM)
    values = torch.randn(3, DIM)
    duplicated = torch.sparse_coo_tensor(
        torch.tensor([[4, 2, 4]]), values, (NUM_ROWS, DIM), check_invariants=True
    )
    actual, state = _run(weight, [duplicated])
    _check(weight, [duplicated.coalesce()], actual, state)


def test_matches_torch_sparse_adam():
    """torch.optim.SparseAdam is the same algorithm with eps added before the
    bias correction of sqrt(v): equal up to eps-sized relative differences."""
    weight = torch.randn(NUM_ROWS, DIM)
    grads = _sparse_grads(seed=2)
    ours, _ = _run(weight, grads)
    theirs, _ = _run(weight, grads, torch.optim.SparseAdam)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_rows_touched_every_step_match_dense_adam():
    weight = torch.randn(NUM_ROWS, DIM)
    grads = _sparse_grads(seed=3)
    ours, _ = _run(weight, grads)
    dense_grads = [g.to_dense() for g in grads]
    param = torch.nn.Parameter(weight.clone())
    dense = torch.optim.Adam([param], lr=LR, betas=BETAS, eps=EPS)
    for grad in dense_grads:
        param.grad = grad
        dense.step()
    # Rows 0 and 1 see a gradient at every step: dense Adam runs the same
    # formula there (fp32, a few roundings per step on O(lr) updates).
    torch.testing.assert_close(ours[:2], param.detach()[:2], rtol=1e-6, atol=1e-7)
    # Rows touched at some steps only: dense Adam also moves them on the steps
    # without a gradient (stale momentum), so the two differ there.
    assert not torch.equal(ours[2:-1], param.detach()[2:-1])


def test_wrong_updates_are_caught():
    """Negative controls: a wrong step size fails the touched-row check; a step
    that nudges every row fails the untouched-row check."""
    weight = torch.randn(NUM_ROWS, DIM)
    grads = _sparse_grads(seed=4)
    actual, state = _run(weight, grads, lr=LR * 1.001)
    with pytest.raises(AssertionError):
        _check(weight, grads, actual, state)

    class NudgesEveryRow(SparseRowAdam):
        @torch.no_grad()
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for param in group["params"]:
                    param.add_(1e-7)

    actual, state = _run(weight, grads, NudgesEveryRow)
    with pytest.raises(AssertionError):
        _check(weight, grads, actual, state)


def test_dense_gradient_and_bad_options_are_refused():
    param = torch.nn.Parameter(torch.randn(3, 2))
    param.grad = torch.ones(3, 2)
    with pytest.raises(ValidationError, match=r"needs a sparse row gradient .* torch\.strided"):
        SparseRowAdam([param]).step()
    with pytest.raises(ValidationError, match=r"betas\[1\] must be in \[0, 1\), got 1.0"):
        SparseRowAdam([param], betas=(0.9, 1.0))
    with pytest.raises(ValidationError, match="lr must be > 0, got 0"):
        SparseRowAdam([param], lr=0)


def test_table_and_gate_train_together():
    """A few steps of table + gate on a fixed batch lower a regression loss."""
    torch.manual_seed(0)
    num_tokens, num_cols, dim, hc = 8, 3, 4, 2
    table = EngramTable(40, 8)
    wkv = torch.nn.Linear(num_cols * 8, (hc + 1) * dim, bias=False)
    q_weight = torch.nn.Parameter(torch.ones(hc, dim))
    k_weight = torch.nn.Parameter(torch.ones(hc, dim))
    row_ids = torch.randint(0, 40, (num_tokens, num_cols))
    hidden = torch.randn(num_tokens, hc, dim)
    target = torch.randn(num_tokens, hc, dim)
    sparse_opt = SparseRowAdam(table.parameters(), lr=5e-2)
    dense_opt = torch.optim.Adam([*wkv.parameters(), q_weight, k_weight], lr=5e-2)

    def loss_fn():
        kv = wkv(table(row_ids).reshape(num_tokens, -1))
        out = engram_gate_train(GateInputs(hidden, kv, q_weight, k_weight, 1e-6))
        return (out - target).square().mean()

    first = loss_fn().item()
    for _ in range(20):
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
    assert loss_fn().item() < 0.9 * first
