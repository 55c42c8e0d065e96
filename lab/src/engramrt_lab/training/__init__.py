"""Training ops for Engram: a trainable table with sparse row gradients, a
lazy Adam for those rows, and the gate as an autograd function.

Plain PyTorch (CPU or GPU): the table's forward is a gather, its backward the
touched rows only; the gate's backward is written out in torch ops.
"""

from __future__ import annotations

from engramrt_lab.training.gate import engram_gate_train, rms_norm_backward
from engramrt_lab.training.lookup import EngramTable, lookup_master_rows, sum_rows_by_id
from engramrt_lab.training.optim import SparseRowAdam

__all__ = [
    "EngramTable",
    "SparseRowAdam",
    "engram_gate_train",
    "lookup_master_rows",
    "rms_norm_backward",
    "sum_rows_by_id",
]
