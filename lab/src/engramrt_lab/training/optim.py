"""Lazy Adam for sparse row gradients: only the rows a step touched move.

An Engram table has hundreds of millions of rows and a step touches a few
thousand, so a dense Adam step (reading and writing every row and both of
its moments) costs the whole table per step. :class:`SparseRowAdam` is
"lazy Adam", the algorithm of :class:`torch.optim.SparseAdam`: with the
parameter's step count ``t`` (one per ``step()`` call that had a gradient),
for every touched row ``i`` with summed gradient ``g_i``::

    m_i = beta1 * m_i + (1 - beta1) * g_i
    v_i = beta2 * v_i + (1 - beta2) * g_i^2
    w_i = w_i - lr / (1 - beta1^t) * m_i / (sqrt(v_i) / sqrt(1 - beta2^t) + eps)

How it differs from dense Adam on a row that a step did not touch: dense Adam
sees a zero gradient there, decays ``m_i`` and ``v_i`` and still moves ``w_i``
by its stale momentum; lazy Adam leaves ``w_i``, ``m_i`` and ``v_i`` untouched
(bit for bit), so a row's moments decay only on steps that touch it, while
the bias correction uses the global ``t``. On rows touched at every step the
two are the same algorithm. No weight decay (it would have to touch every row).

Gradients must be sparse COO tensors of the parameter's shape whose indices
are rows (as :class:`engramrt_lab.training.EngramTable` produces); a dense
gradient is refused rather than silently updating every row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from engramrt.errors import ValidationError, expect

__all__ = ["SparseRowAdam"]


class SparseRowAdam(torch.optim.Optimizer):
    """Lazy Adam over sparse row gradients (see the module docstring).

    Args:
        params: parameters (2-D, float) whose gradients are sparse row gradients.
        lr: step size (> 0).
        betas: moment decay rates, each in ``[0, 1)``.
        eps: added to the bias-corrected ``sqrt(v)`` (> 0).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        expect(lr > 0, ValidationError, f"lr must be > 0, got {lr}")
        for name, beta in zip(("betas[0]", "betas[1]"), betas, strict=True):
            expect(0.0 <= beta < 1.0, ValidationError, f"{name} must be in [0, 1), got {beta}")
        expect(eps > 0, ValidationError, f"eps must be > 0, got {eps}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                expect(
                    grad.is_sparse and grad.sparse_dim() == 1,
                    ValidationError,
                    f"SparseRowAdam needs a sparse row gradient (sparse COO, sparse_dim 1) for "
                    f"a parameter of shape {tuple(param.shape)}, got layout {grad.layout} "
                    f"with shape {tuple(grad.shape)}",
                )
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                state["step"] += 1
                grad = grad.coalesce()
                rows = grad.indices()[0]  # [U] int64, unique
                values = grad.values().to(param.dtype)  # [U, E]
                if rows.numel() == 0:
                    continue
                exp_avg = state["exp_avg"]
                exp_avg_sq = state["exp_avg_sq"]
                m = exp_avg.index_select(0, rows) * beta1 + (1 - beta1) * values
                v = exp_avg_sq.index_select(0, rows) * beta2 + (1 - beta2) * values.square()
                exp_avg.index_copy_(0, rows, m)
                exp_avg_sq.index_copy_(0, rows, v)
                step = state["step"]
                step_size = group["lr"] / (1 - beta1**step)
                denom = v.sqrt() / math.sqrt(1 - beta2**step) + group["eps"]
                param.index_copy_(0, rows, param.index_select(0, rows) - step_size * (m / denom))
        return loss
