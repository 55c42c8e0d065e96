"""Exchanges: row sources that rebuild a layer's rows from every rank's column shard.

Under tensor parallelism each rank's table holds only its hash columns
(SPEC §7: :func:`engramrt.layout.owned_columns`), so the rows a layer needs
are spread over the ranks of a process group. An exchange wraps this rank's
shard store and is itself a :class:`~engramrt.source.RowSource`: a layer,
or the runtime, uses it exactly like a store.

==============================  =================================  ==========================
exchange                        each rank receives                 batches
==============================  =================================  ==========================
:class:`AllGatherExchange`      all ``T`` tokens ``[T, C, E]``     the same on every rank (TP)
:class:`SequenceParallelExchange`  its ``ceil(T/tp)`` tokens        the same on every rank (TP + SP)
:class:`AllToAllExchange`       its own batch ``[T_r, C, E]``      one per rank (TP x DP)
==============================  =================================  ==========================

Every exchange is :attr:`~engramrt.source.RowSource.collective`: all ranks
of the group call ``fetch`` for the same layers in the same order. Rows
travel as int32 words of bf16 bit patterns, so every exchange returns the
single-process lookup's bits exactly. The same code runs over gloo (CPU
tensors) and NCCL (CUDA tensors).
"""

from __future__ import annotations

from engramrt.exchange.all_gather import ALL_GATHER_COLLECTIVES, AllGatherExchange
from engramrt.exchange.all_to_all import AllToAllExchange, all_to_all_lookup_reference
from engramrt.exchange.base import RowExchange
from engramrt.exchange.sequence_parallel import (
    SEQUENCE_PARALLEL_COLLECTIVES,
    SequenceParallelExchange,
    shard_tokens,
    token_range,
    tokens_per_rank,
)

__all__ = [
    "ALL_GATHER_COLLECTIVES",
    "SEQUENCE_PARALLEL_COLLECTIVES",
    "AllGatherExchange",
    "AllToAllExchange",
    "RowExchange",
    "SequenceParallelExchange",
    "all_to_all_lookup_reference",
    "shard_tokens",
    "token_range",
    "tokens_per_rank",
]
