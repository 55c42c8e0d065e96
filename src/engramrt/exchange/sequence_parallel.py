"""Sequence parallelism: each rank gets the full rows of its own share of the tokens.

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

Every buffer is preallocated for ``max_tokens``, so a step allocates nothing
and (over NCCL) can be captured in a CUDA graph once the communicator
exists (run one step eagerly first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engramrt.errors import ValidationError
from engramrt.exchange._collectives import reduce_scatter_into
from engramrt.exchange.base import RowExchange
from engramrt.lookup.tiers.base import RowStore

__all__ = [
    "SEQUENCE_PARALLEL_COLLECTIVES",
    "SequenceParallelExchange",
    "shard_tokens",
    "token_range",
    "tokens_per_rank",
]

SEQUENCE_PARALLEL_COLLECTIVES: tuple[str, ...] = ("reduce_scatter", "all_to_all")


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


class SequenceParallelExchange(RowExchange):
    """This rank's token share ``[ceil(T/tp), C, E]`` of the full rows, from every rank's shard.

    Args:
        store, num_cols, group: see :class:`~engramrt.exchange.RowExchange`.
        max_tokens: the most tokens (all ranks together, ``T``) of one step;
            sizes the exchange buffers.
        collective: ``"reduce_scatter"`` (default) or ``"all_to_all"`` (see the module doc).

    Attributes:
        max_part: ``ceil(max_tokens / tp)``, the longest token share.
    """

    collectives = SEQUENCE_PARALLEL_COLLECTIVES

    def __init__(
        self,
        store: RowStore,
        *,
        num_cols: int,
        max_tokens: int,
        group: Any = None,
        collective: str | None = None,
    ) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValidationError(f"max_tokens={max_tokens!r}; expected a positive integer")
        super().__init__(store, num_cols=num_cols, group=group, collective=collective)
        self.max_tokens = max_tokens
        self.max_part = tokens_per_rank(max_tokens, self.world)
        E, device = self.E, self.device
        # [tp * max_part, C, E]: this rank's lookup of every token (zeros elsewhere).
        self.rows_all = torch.zeros(
            (self.world * self.max_part, num_cols, E), dtype=torch.bfloat16, device=device
        )
        if self.collective_op == "all_to_all":
            # Flat, so that [tp, part, cols_per_rank, E] views of any part are contiguous.
            # Padding columns of the last rank's block stay zero forever.
            block = self.world * self.max_part * self.cols_per_rank * E
            self.send = torch.zeros(block, dtype=torch.bfloat16, device=device)
            self.recv = torch.zeros(block, dtype=torch.bfloat16, device=device)

    def local_tokens(self, num_tokens: int) -> int:
        return tokens_per_rank(num_tokens, self.world)

    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Look up all ``T`` tokens of ``row_ids [T, C]`` for this rank's columns and
        return this rank's share ``[ceil(T/tp), C, E]`` of the full rows.

        Every rank of the group must call this with the same ``T``.
        """
        num_tokens = self._check_row_ids(row_ids)
        if num_tokens > self.max_tokens:
            raise ValidationError(
                f"row_ids has T = {num_tokens} tokens, more than max_tokens = {self.max_tokens} "
                f"(the size this exchange's buffers were built for)"
            )
        part = tokens_per_rank(num_tokens, self.world)
        if out is None:
            out = torch.empty(
                (part, self.num_cols, self.E), dtype=torch.bfloat16, device=self.device
            )
        if part == 0:
            return out  # T = 0 on every rank: nothing to exchange
        rows_all = self.rows_all[: self.world * part]  # [tp*part, C, E], contiguous
        self.store.lookup(row_ids, out=rows_all[:num_tokens])
        rows_all[num_tokens:].zero_()  # padding tokens: at most tp - 1
        if self.collective_op == "reduce_scatter":
            reduce_scatter_into(out.view(torch.int32), rows_all.view(torch.int32), self.group)
            return out
        # all_to_all: block j of the send buffer = my columns of rank j's tokens.
        own = self.col_end - self.col_begin
        shape = (self.world, part, self.cols_per_rank, self.E)
        count = self.world * part * self.cols_per_rank * self.E
        send = self.send[:count].view(shape)
        recv = self.recv[:count].view(shape)
        send[:, :, :own].copy_(
            rows_all.view(self.world, part, self.num_cols, self.E)[
                :, :, self.col_begin : self.col_end
            ]
        )
        dist.all_to_all_single(recv.view(torch.int32), send.view(torch.int32), group=self.group)
        for source in range(self.world):  # block `source` = its columns of my tokens
            begin = source * self.cols_per_rank
            end = min(begin + self.cols_per_rank, self.num_cols)
            out[:, begin:end].copy_(recv[source, :, : end - begin])
        return out
