"""Sequence parallelism of the Engram layer over a tensor-parallel group.

Under sequence parallelism each of ``tp`` ranks holds ``part = ceil(T/tp)``
tokens of the hidden streams (rank r: tokens ``[r*part, min((r+1)*part, T))``,
the last rank(s) padded), while the row ids cover all ``T`` tokens and each
rank's table shard holds only its hash columns (SPEC §7: it returns zeros
for the other columns). One step:

1. every rank looks up all ``T`` tokens for its columns into
   ``rows_all [tp*part, C, E]`` (bf16, zeros in the other columns and in
   the padding tokens ``[T, tp*part)``);
2. one collective rebuilds, on each rank, the full rows of its own tokens
   ``[part, C, E]``;
3. each rank runs ``wkv`` and the gate on its tokens.

The collective (``collective=``):

``"reduce_scatter"`` (default): ``reduce_scatter_tensor`` over tokens. Each
    token's row is nonzero on exactly one rank per column, so the sum is
    the row. The sum runs on the bf16 *bit patterns* viewed as int32 (two
    values per word; a rank's columns are whole rows of E >= 32 values, so a
    word never mixes ranks): ``x + 0 = x`` on integers is exact for every
    pattern, where a bf16 sum would turn -0.0 into +0.0. Rows arrive bit
    for bit. int32 because NCCL has no int16 type.
``"all_to_all"``: ``all_to_all_single``: each rank sends to rank j only its
    own columns of j's tokens, ``[part, ceil(C/tp), E]``, and places what it
    receives column block by column block.

Bytes on the wire per rank, with ``B = T*C*E*2`` (ring algorithms):

==============================================  ======================  =====================
collective                                      sent / received         rows held after
==============================================  ======================  =====================
all-reduce of ``[T, C, E]``                     ``2 (tp-1)/tp B``       all T tokens
all-gather of each rank's ``[T, C, E]``         ``(tp-1) B``            all T tokens x tp
all-gather of owned column blocks               ``(tp-1)/tp B``         all T tokens
reduce-scatter over tokens                      ``(tp-1)/tp B``         own tokens only
all-to-all of owned blocks of others' tokens    ``(tp-1)/tp^2 B``       own tokens only
==============================================  ======================  =====================

So reduce-scatter moves half of an all-reduce and ``1/tp`` of an all-gather
of the lookup outputs (SPEC §7's recipe), and, unlike an all-gather of the
owned column blocks (same bytes), it lands only the rows a rank uses: no
``[T, C, E]`` buffer per rank to slice afterwards. All-to-all moves ``tp``
times less again, at the price of packing the send buffer and ``tp`` small
copies out of the receive buffer; at decode sizes both are latency-bound
(``B`` = 3 MB at T = 256), at prefill sizes (``B`` = 100 MB at T = 8192,
C = 24, E = 256) the difference is real. Which is faster on NVLink is a
measurement to make on the GPUs; both give the same bits.

The same code runs over gloo (CPU tensors) and NCCL (CUDA tensors). Every
buffer is preallocated for ``max_tokens``, so a step allocates nothing and
(over NCCL) can be captured in a CUDA graph once the communicator exists
(run one step eagerly first).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from engramrt.errors import ShardingError, ValidationError
from engramrt.lookup.tiers.base import RowStore

__all__ = [
    "COLLECTIVES",
    "SequenceParallelRows",
    "rank_columns",
    "shard_tokens",
    "token_range",
    "tokens_per_rank",
]

COLLECTIVES: tuple[str, ...] = ("reduce_scatter", "all_to_all")


def tokens_per_rank(num_tokens: int, tp: int) -> int:
    """``ceil(T / tp)``: the tokens (with padding) each rank holds."""
    return -(-num_tokens // tp)


def token_range(num_tokens: int, tp: int, rank: int) -> tuple[int, int]:
    """Tokens ``[begin, end)`` of all ``T`` that ``rank`` holds (possibly empty)."""
    part = tokens_per_rank(num_tokens, tp)
    begin = min(rank * part, num_tokens)
    return begin, min(begin + part, num_tokens)


def shard_tokens(x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """``rank``'s ``[ceil(T/tp), ...]`` share of ``x [T, ...]``, zero padded at the end."""
    part = tokens_per_rank(x.shape[0], tp)
    begin, end = token_range(x.shape[0], tp, rank)
    share = x.new_zeros((part, *x.shape[1:]))
    share[: end - begin] = x[begin:end]
    return share


def rank_columns(num_cols: int, tp: int, rank: int) -> tuple[int, int, int]:
    """``(ceil(C/tp), col_begin, col_end)``: the hash columns ``rank`` owns (SPEC §7,
    as :meth:`engramrt.layout.EngramLayout.column_shard`); refuses a tp that leaves
    some rank without a column."""
    part = math.ceil(num_cols / tp)
    if (tp - 1) * part >= num_cols:
        raise ShardingError(
            f"tp={tp} leaves some rank without a hash column: C={num_cols} columns in parts of "
            f"ceil({num_cols}/{tp})={part}; choose tp so that (tp-1)*ceil(C/tp) < C"
        )
    return part, rank * part, min((rank + 1) * part, num_cols)


class SequenceParallelRows:
    """Rebuilds this rank's token share of the rows from every rank's column shard.

    Args:
        group: the tensor-parallel process group (gloo for CPU tensors,
            NCCL for CUDA tensors); ``None`` is the default group.
        num_cols: ``C``.
        E: values per row.
        max_tokens: the most tokens (all ranks together, ``T``) of one step.
        device: where the rows live (the store's device).
        collective: ``"reduce_scatter"`` or ``"all_to_all"`` (see the module doc).

    Attributes:
        tp, rank: the group's size and this process's rank in it.
        col_begin, col_end: the hash columns this rank's store must serve.
        max_part: ``ceil(max_tokens / tp)``, the longest token share.
    """

    def __init__(
        self,
        group: Any,
        *,
        num_cols: int,
        E: int,
        max_tokens: int,
        device: torch.device,
        collective: str = "reduce_scatter",
    ) -> None:
        if collective not in COLLECTIVES:
            raise ValidationError(
                f"collective={collective!r}; expected one of {', '.join(COLLECTIVES)}"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise ShardingError(
                "a sequence-parallel group was given but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first"
            )
        self.group = group
        self.tp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ShardingError("this process is not a member of the sequence-parallel group")
        self.num_cols = num_cols
        self.E = E
        self.collective = collective
        self.cols_per_rank, self.col_begin, self.col_end = rank_columns(
            num_cols, self.tp, self.rank
        )
        self.max_part = tokens_per_rank(max_tokens, self.tp)
        self.device = device
        # [tp * max_part, C, E]: this rank's lookup of every token (zeros elsewhere).
        self.rows_all = torch.zeros(
            (self.tp * self.max_part, num_cols, E), dtype=torch.bfloat16, device=device
        )
        if collective == "all_to_all":
            # Flat, so that [tp, part, cols_per_rank, E] views of any part are contiguous.
            # Padding columns of the last rank's block stay zero forever.
            block = self.tp * self.max_part * self.cols_per_rank * E
            self.send = torch.zeros(block, dtype=torch.bfloat16, device=device)
            self.recv = torch.zeros(block, dtype=torch.bfloat16, device=device)

    def check_store(self, store: RowStore) -> None:
        """Refuse a store that does not serve exactly this rank's columns (SPEC §7)."""
        store_end = store.col_end if store.col_end is not None else self.num_cols
        if store.col_begin != self.col_begin or store_end != self.col_end:
            raise ShardingError(
                f"store serves hash columns [{store.col_begin}, {store.col_end}) but rank "
                f"{self.rank} of tp={self.tp} owns [{self.col_begin}, {self.col_end}) of "
                f"C={self.num_cols} (SPEC §7: part = ceil(C/tp)); build the store with "
                f"col_begin={self.col_begin}, col_end={self.col_end}"
            )

    def __call__(self, store: RowStore, row_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Look up all ``T`` tokens of ``row_ids [T, C]`` for this rank's columns and
        write this rank's share ``[ceil(T/tp), C, E]`` of the full rows into ``out``.

        ``out`` is contiguous bf16 ``[ceil(T/tp), C, E]`` on the store's device.
        Every rank of the group must call this with the same ``T``.
        """
        num_tokens = row_ids.shape[0]
        part = tokens_per_rank(num_tokens, self.tp)
        if part == 0:
            return out  # T = 0 on every rank: nothing to exchange
        rows_all = self.rows_all[: self.tp * part]  # [tp*part, C, E], contiguous
        store.lookup(row_ids, out=rows_all[:num_tokens])
        rows_all[num_tokens:].zero_()  # padding tokens: at most tp - 1
        if self.collective == "reduce_scatter":
            _reduce_scatter(out.view(torch.int32), rows_all.view(torch.int32), self.group)
            return out
        # all_to_all: block j of the send buffer = my columns of rank j's tokens.
        own = self.col_end - self.col_begin
        shape = (self.tp, part, self.cols_per_rank, self.E)
        count = self.tp * part * self.cols_per_rank * self.E
        send = self.send[:count].view(shape)
        recv = self.recv[:count].view(shape)
        send[:, :, :own].copy_(
            rows_all.view(self.tp, part, self.num_cols, self.E)[:, :, self.col_begin : self.col_end]
        )
        dist.all_to_all_single(recv.view(torch.int32), send.view(torch.int32), group=self.group)
        for source in range(self.tp):  # block `source` = its columns of my tokens
            begin = source * self.cols_per_rank
            end = min(begin + self.cols_per_rank, self.num_cols)
            out[:, begin:end].copy_(recv[source, :, : end - begin])
        return out


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the
    # old name warns); the H200 image has torch 2.11, which has only the old one.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group)
