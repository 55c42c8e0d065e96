"""Train the tiny Engram LM and its two baselines on Python sources; write the model directory.

One command (the shipped model's; how long it takes: BENCHMARKS.md, "The shipped
model: ×2 tables, one full pass"; ``--memory-sweep`` and ``--compare-layers`` add
one Engram model's training per model)::

    python -m engramrt_lab.models.train --out DIR --steps 1321 --device cuda \
        --eval-sequences 4096 --val-sequences 256 --engram-layers 1,3 \
        --buckets 12288,8192,4096 --results DIR.json

A small end-to-end run on a CPU (what the tests do, on a tiny source tree)::

    python -m engramrt_lab.models.train --out DIR --device cpu --max-files 20 --steps 5 \
        --batch-size 2 --seq-len 64 --eval-sequences 8 --site-dirs ""

What it does, in order (every stage prints a line, flushed):

1. corpus (:mod:`engramrt_lab.models.corpus`): the stdlib and the site
   directories' ``*.py`` files, near-duplicates removed before the split,
   the stdlib held-out and validation files by ``sha256(path) % 20``, whole
   held-out packages, DeepSeek-V4 tokenizer batch encoding, one document
   per file; the manifest is compared with the packaged model's;
2. trimmed vocabulary (:mod:`engramrt_lab.models.vocab`) from the training split;
3. per Engram configuration, the row ids of every position, once, with the
   exact hasher (the Triton kernel on CUDA, checked against the torch hashing);
4. the Engram model (E = 32, 49,152 / 32,768 / 16,384 buckets per head for
   2/3/4-grams, Engram at blocks 1 and 2, the value part of ``wkv`` zero at
   start; backbone D = 256, 4 blocks, hc = 4): AdamW for the dense weights,
   :class:`~engramrt_lab.training.SparseRowAdam` for the fp32 tables, linear
   warmup then cosine to 10%, bf16 autocast on CUDA; one pass at most over
   shuffled non-overlapping windows (:class:`OnePassWindows`), for
   ``--minutes`` of wall clock (the step count is fixed after 20 timed
   steps) or ``--steps``;
5. ``baseline`` (the same backbone without Engram) and ``baseline_wide``
   (the MLP widened to the Engram model's dense parameters and FLOPs per
   token) for exactly as many steps on the same windows with the same
   schedule; every model is evaluated on the validation files every
   ``--eval-every`` steps and keeps the weights of its lowest validation
   loss (a guard; the last step's held-out loss is recorded too);
6. held-out losses of all three on both held-out sets; then the float
   tables are written as a source checkpoint with the V4.1 tensor names,
   converted to fp8 by the conversion the ``engramrt convert`` command runs
   (:func:`~engramrt.checkpoint.plan_conversion` +
   :func:`~engramrt.checkpoint.run_conversion`), loaded back with
   :func:`~engramrt.checkpoint.load_tables`, and the Engram model evaluated
   again on those fp8 rows (the relative change is reported);
7. the model directory (:mod:`engramrt_lab.models.artifacts`), with a SHA-256 of
   every file in ``model.json``; its training record holds no path of this
   machine (:func:`training_command`, :func:`settings_record`; the corpus
   roots by name);
8. ``--memory-sweep`` and ``--compare-layers``: more Engram models, the same
   steps and windows, their results in ``--results`` (tables not kept).

With ``--models`` naming fewer than all three models (e.g. ``--models engram
--steps 1321 --results FILE``) a run trains only those (stages 1-5), then the
where-it-wins split of them and, with the Engram model among them, stage 8; it
writes no model directory (stages 6-7 need all three), so ``--out`` is left out
and ``--results`` is its output. ``--steps`` is required there: runs of different
models compare only on one schedule (:mod:`engramrt_lab.models.seeds` merges
their records per seed). ``--models sweep`` trains stage 8 alone: the memory
curve's other points beside a run of ``--models engram`` (whose model is the
curve's point at its own ``--buckets``).

Every flag is checked before any work (a bad one: one line, exit status 2);
a non-finite training loss stops the run (exit status 1) and no model is
written. The model directory is written into a hidden staging directory
beside DIR (``.DIR.staging-*``) and swapped in for DIR in one rename only
when it is complete (stage 7): a run that fails or is killed before leaves
DIR as it was, an earlier model in it intact (a killed run's staging
directory is removed by the next run). DIR may hold only a model's files
(and the ``--results`` file); anything else is refused up front, since the
swap replaces the directory whole. Nothing is cached outside DIR (the
token map is built in memory).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import math
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engramrt._device import resolve_device
from engramrt._io import staged_directory
from engramrt.config import PRESETS, EngramConfig
from engramrt.errors import ValidationError
from engramrt.gate.reference import MIN_ABS_DOT
from engramrt.hashing import HashConstants
from engramrt.hashing.vectorized import hash_batch_torch
from engramrt_lab.models import artifacts
from engramrt_lab.models.cli_parser import OneLineParser
from engramrt_lab.models.corpus import (
    Corpus,
    EvalSegments,
    build_corpus,
    corpus_row_ids,
    eval_segments,
    root_name,
)
from engramrt_lab.models.lm import LMConfig, TinyLM, next_token_loss_sum, next_token_losses
from engramrt_lab.models.vocab import Vocab
from engramrt_lab.training import EngramTable, SparseRowAdam

__all__ = [
    "TrainSettings",
    "autocast_for",
    "main",
    "make_optimizers",
    "segment_row_ids",
    "settings_record",
    "token_losses",
    "token_losses_and_gates",
    "train",
    "train_step",
    "training_command",
]

SIZE_BUDGET_BYTES = 50_000_000
FILE_LIMIT_BYTES = 40 * 2**20
TODAY_BUCKETS = 4096
"""Buckets per head and order of the ``tiny`` preset: the memory sweep's unit."""

# Bounds of the flags that size memory, checked before any work (see the module doc).
# Each is far above what this command is for (a tiny LM on one GPU) and far below what
# exhausts a machine: a bad value is one line, not an allocation that grows for minutes.
MAX_SEQ_LEN = 16_384
"""--seq-len: 32 times the default window (a Python file is a few thousand tokens)."""
MAX_TOKENS_PER_STEP = 2**18
"""--batch-size times --seq-len: 8 times the default step's 32,768 tokens; the logits
alone take ``tokens x (K + 1) x 4`` bytes (4.3 GB at K = 4,096)."""
MAX_WIDTH = 16_384
"""--dim and --mlp-dim each (the default backbone is 256 wide, its MLP 448)."""
MAX_BLOCKS = 64
"""--n-blocks."""
MAX_HEAD_DIM = 1024
"""--head-dim (E; DeepSeek-V4.1 uses 128)."""
MAX_DENSE_PARAMETERS = 500_000_000
"""Dense parameters of one model (the wide baseline is the largest): with AdamW's two
moments and the gradient, 16 bytes each, 8 GB."""
MAX_TABLE_BYTES = 16 * 2**30
"""One Engram model's fp32 tables with :class:`SparseRowAdam`'s two moments (12 bytes per
value; the default tables take 0.3 GB): --buckets, --head-dim, --engram-layers and each
--memory-sweep multiple."""
MAX_ACTIVATION_BYTES = 48 * 2**30
"""A step's activations kept for the backward pass, estimated as 4 bytes x tokens per step x
(per block: 10 tensors of the ``hc x D`` streams and 3 of the MLP width; plus the logits and
their gradient, 2 x (K + 1)): 7 GB with the defaults; --dim, --mlp-dim, --n-blocks,
--batch-size, --seq-len and --vocab-k together."""
MAX_SEQUENCES = 65_536
"""--eval-sequences, --val-sequences, --sample-sequences (the default is 128)."""
TOKENIZER_IDS = 129_280
"""Ids of the DeepSeek-V4 tokenizer: --vocab-k keeps at most that many."""
MAX_SEED = 2**63 - 1
"""--seed: torch's generators take a 64-bit seed."""
MAX_SHORT_CONV = 64
"""--short-conv: taps (DeepSeek's demo uses 4); --short-conv-dilation is at most
:data:`MAX_SEQ_LEN`."""

MODEL_NAMES = ("engram", "baseline", "baseline_wide")
"""The models of a run, in the order they train (``--models``): the Engram model, the same
backbone without Engram, and the FLOP-matched wide baseline."""

SWEEP_ONLY = "sweep"
"""``--models sweep``: only the Engram models of ``--memory-sweep`` and ``--compare-layers``
(the main Engram model's point comes from a run of ``--models engram``; the seeds command
merges the two records)."""

ENGRAM_INITS = ("value-zero", "rows-zero")
"""--engram-init: which of the value projection and the rows starts at zero."""

WKV_HEADS = ("separate", "summed")
"""--wkv-heads: each hash head's row projected apart, or each order's heads' rows summed."""

RowsOf = Callable[[int, torch.Tensor], torch.Tensor]
"""``(engram layer index, row ids [T, C]) -> rows [T, C, E]`` float."""


@dataclass
class TrainSettings:
    """Everything the command line sets (see ``--help``)."""

    out: Path | None
    """The model directory; None only for a run of fewer than all three models
    (``models``), whose one output is the ``results`` record."""
    device: str = "auto"
    minutes: float = 1.5
    steps: int | None = None
    max_files: int | None = None
    max_train_chars: int | None = 160_000_000
    batch_size: int = 64
    seq_len: int = 512
    vocab_k: int = 4096
    vocab_k_given: bool = False
    """Whether ``--vocab-k`` was given: then a training split with fewer distinct ids is an
    error; with the default, the vocabulary keeps what the split holds (and says so)."""
    dim: int = LMConfig.dim
    n_blocks: int = LMConfig.n_blocks
    mlp_dim: int = LMConfig.mlp_dim
    lr: float = 2e-3
    table_lr: float = 1e-2
    engram_init: str = "value-zero"
    """How an Engram layer starts as the identity: ``value-zero`` (the value part of ``wkv``
    at zero, the rows normal with ``table_init_std``) or ``rows-zero`` (the rows at zero,
    the value part normal like the other matrices): a row no training n-gram reaches then
    stays zero, so its value is zero."""
    table_init_std: float = 0.02
    """Standard deviation of the tables' normal initialisation (``value-zero``: > 0, since
    rows at zero would get no gradient while the value part of ``wkv`` starts at zero;
    ``rows-zero``: 0)."""
    gate_slope_floor: float = MIN_ABS_DOT
    """The Engram gate's backward holds the slope of ``sqrt(|dot|)`` at
    ``0.5 / sqrt(floor)`` below ``|dot| = floor`` (the default, the clamp's, is exact;
    :func:`~engramrt_lab.training.engram_gate_train`)."""
    weight_decay: float = 0.1
    unseen_rate: float = 0.0
    """Training only, Engram models only: the share of training positions shown as if their
    n-gram were new (:class:`UnseenNgrams`); 0 (default) shows every position its own rows."""
    short_conv: int = 0
    """Engram models: taps of the short convolution after each Engram gate
    (:class:`~engramrt_lab.models.lm.ShortConv`); 0 (default): none."""
    short_conv_dilation: int | None = None
    """Positions between its taps; None: the largest n-gram order (DeepSeek's demo)."""
    wkv_heads: str = "separate"
    """Engram models: ``separate`` (default) projects every hash column's row apart, as
    DeepSeek's layer; ``summed`` sums the rows of one n-gram order's hash heads first
    (``LMConfig.engram_summed_heads``)."""
    eval_sequences: int = 128
    val_sequences: int = 64
    eval_every: int = 25
    sample_sequences: int = 32
    seed: int = 0
    engram_layers: tuple[int, ...] = (1, 2)
    buckets: tuple[int, ...] = (49_152, 32_768, 16_384)
    head_dim: int = 32
    models: tuple[str, ...] = MODEL_NAMES
    """The models to train, of :data:`MODEL_NAMES`, in that order; fewer than all three:
    no model directory (it holds all three and the fp8 check), ``steps`` fixed and
    ``results`` the record, so that runs of different models at different times compare
    (:mod:`engramrt_lab.models.seeds` merges their records per seed)."""
    memory_sweep: tuple[float, ...] = ()
    compare_layers: tuple[int, ...] | None = None
    results: Path | None = None
    stdlib_root: Path | None = None
    site_dirs: tuple[Path, ...] | None = None
    log: list[str] = field(default_factory=list)

    def say(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        self.log.append(line)
        print(line, flush=True)


def engram_config(
    dim: int,
    buckets: Sequence[int] = TrainSettings.buckets,
    layers: Sequence[int] = TrainSettings.engram_layers,
    head_dim: int = TrainSettings.head_dim,
) -> EngramConfig:
    """The ``tiny`` preset's hashing (tokenizer, token map, N = 4, 4 heads) with the
    backbone's width, ``buckets`` per head for each order 2..4, Engram at ``layers``
    and rows of ``head_dim`` values; ``num_embeddings`` is exactly the rows the
    layout's primes need."""
    from engramrt.layout import EngramLayout

    draft = PRESETS["tiny"].replace(
        hidden_size=dim,
        vocab_size=tuple(int(b) for b in buckets),
        layer_ids=tuple(int(x) for x in layers),
        num_embeddings=(1,) * len(layers),
        head_dim=head_dim,
        name="tiny-lm",
    )
    layout = EngramLayout(draft, check_num_embeddings=False)
    rows = tuple(int(r) for r in layout.rows_needed)
    return draft.replace(num_embeddings=rows)


def sweep_buckets(buckets: Sequence[int], multiple: float) -> tuple[int, ...]:
    """Per-order buckets in the proportions of ``buckets`` summing to ``multiple`` times
    the ``tiny`` preset's (``TODAY_BUCKETS`` per order), each at least 2."""
    total = multiple * TODAY_BUCKETS * len(buckets)
    scale = total / sum(buckets)
    return tuple(max(2, round(b * scale)) for b in buckets)


def wide_mlp_dim(lm_cfg: LMConfig) -> int:
    """The MLP width at which the baseline's dense parameters (and matmul FLOPs per
    token) match the Engram model's: the Engram heads' parameters spread over the
    blocks' SwiGLU (3 D parameters per unit of width per block). A short convolution's
    parameters (``(kernel + 1) hc D`` a layer, elementwise work) are left out, so the
    wide baseline is the same with or without one (``--short-conv`` changes the Engram
    model only)."""
    from engramrt_lab.models.lm import dense_parameters

    matched = dataclasses.replace(lm_cfg, engram_conv_kernel=0, engram_conv_dilation=1)
    extra = dense_parameters(matched) - dense_parameters(lm_cfg.baseline())
    return lm_cfg.mlp_dim + round(extra / (3 * lm_cfg.dim * lm_cfg.n_blocks))


def lm_configs(settings: TrainSettings, vocab_size: int, cfg: EngramConfig) -> LMConfig:
    return LMConfig(
        vocab_size=vocab_size,
        dim=settings.dim,
        n_blocks=settings.n_blocks,
        mlp_dim=settings.mlp_dim,
        hc_mult=cfg.hc_mult,
        max_seq_len=settings.seq_len,
        engram_layer_ids=cfg.layer_ids,
        engram_cols=cfg.n_cols,
        engram_head_dim=cfg.head_dim,
        engram_eps=cfg.rms_norm_eps,
        engram_conv_kernel=settings.short_conv,
        engram_conv_dilation=(
            cfg.max_ngram_size
            if settings.short_conv_dilation is None
            else settings.short_conv_dilation
        ),
        engram_summed_heads=cfg.n_heads if settings.wkv_heads == "summed" else 0,
    )


def engram_fns(
    model: TinyLM,
    rows_of: RowsOf,
    row_ids: torch.Tensor,
    gates: dict[int, list[torch.Tensor]] | None = None,
) -> dict[int, Any]:
    """The model's Engram layers for a batch whose row ids are ``row_ids [B, S, L, C]``;
    with ``gates`` (evaluation only), each layer appends its gate per position, mean
    over the streams, ``[B, S]``, to ``gates[block]``
    (:class:`~engramrt_lab.models.lm.TrainEngramHead`)."""
    fns = {}
    cols = row_ids.shape[-1]
    for index, block in enumerate(model.config.engram_layer_ids):
        head = model.engram_head(block)
        ids = row_ids[:, :, index].reshape(-1, cols)
        sink = None if gates is None else gates.setdefault(block, [])

        def apply(
            streams: torch.Tensor,
            head: Any = head,
            ids: torch.Tensor = ids,
            index: int = index,
            sink: list[torch.Tensor] | None = sink,
        ) -> torch.Tensor:
            return head(streams, rows_of(index, ids), sink)

        fns[block] = apply
    return fns


def segment_row_ids(
    segments: EvalSegments, consts: HashConstants, token_map: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Row ids ``[M, S, L, C]`` int32 of held-out sequences, each hashed as one
    request with its lookback ids (so: the ids it has in its document)."""
    count, seq = segments.tokens.shape
    batch = segments.hash_batch(device)
    ids = hash_batch_torch(batch, consts, token_map.to(device), out_dtype=torch.int32)
    return ids.view(count, seq, consts.n_layers, consts.n_cols)


@dataclass
class _EvalSet:
    """Fixed sequences of one split, on the device (tokens trimmed)."""

    segments: EvalSegments
    tokens: torch.Tensor
    lengths: torch.Tensor


@torch.no_grad()
def evaluate(
    model: TinyLM,
    rows_of: RowsOf | None,
    data: _EvalSet,
    row_ids: torch.Tensor | None,
    gates: dict[int, list[torch.Tensor]] | None = None,
) -> float:
    """Mean next-token loss (nats) of ``data``'s sequences over their valid predictions
    (Engram rows from ``rows_of`` by ``row_ids [M, S, L, C]`` unless either is None);
    with ``gates``, each Engram block's gate of every batch is appended as in
    :func:`engram_fns`."""
    total = torch.zeros((), dtype=torch.float64, device=data.tokens.device)
    count = 0
    batches = _batched_logits(model, rows_of, data.tokens, row_ids, 16, gates)
    for chunk, logits in batches:
        loss, n = next_token_loss_sum(logits, data.tokens[chunk], data.lengths[chunk])
        total += loss.double()
        count += n
    return float(total) / max(count, 1)


def _batched_logits(
    model: TinyLM,
    rows_of: RowsOf | None,
    tokens: torch.Tensor,
    row_ids: torch.Tensor | None,
    batch_size: int,
    gates: dict[int, list[torch.Tensor]] | None = None,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(rows of tokens, logits)`` of ``tokens [M, S]`` in batches of ``batch_size``
    sequences, the model in eval mode meanwhile (Engram rows from ``rows_of`` and
    ``row_ids`` unless either is None; ``gates`` as in :func:`engram_fns`)."""
    model.eval()
    for begin in range(0, tokens.shape[0], batch_size):
        chunk = slice(begin, begin + batch_size)
        fns = (
            {}
            if rows_of is None or row_ids is None
            else engram_fns(model, rows_of, row_ids[chunk], gates)
        )
        with autocast_for(tokens.device):
            logits = model(tokens[chunk], engram=fns)
        yield chunk, logits
    model.train()


def autocast_for(device: torch.device) -> Any:
    """The training command's autocast on ``device``: bf16 on CUDA, none elsewhere."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class FlagError(ValidationError):
    """A flag that only the corpus shows to be wrong (read before the models are built):
    one line, exit status 2, no model written."""


class TrainingDiverged(ValidationError):
    """A training loss that is not finite: the run stops and writes no model."""


class OnePassWindows:
    """Non-overlapping training windows in a seeded shuffled order: one pass at most.

    Window ``w`` is tokens ``[w S, w S + S]`` (``S + 1`` tokens: inputs and
    targets shifted by one), so consecutive windows share only a boundary
    token and every token is a target of exactly one window. The order is
    ``torch.randperm(num_windows)`` of a CPU generator seeded with ``seed``
    (the same on every device); batch ``i`` is windows ``order[i B:(i+1) B]``.
    """

    def __init__(
        self, num_tokens: int, seq_len: int, batch_size: int, seed: int, device: torch.device
    ) -> None:
        self.seq_len, self.batch_size = seq_len, batch_size
        self.num_windows = max(0, (num_tokens - 1) // seq_len)
        if self.num_windows < batch_size:
            raise ValidationError(
                f"the training split has {num_tokens} tokens: {self.num_windows} windows of "
                f"--seq-len={seq_len}, fewer than --batch-size={batch_size}"
            )
        generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(self.num_windows, generator=generator).to(device)
        self._offsets = torch.arange(seq_len + 1, device=device)

    @property
    def steps(self) -> int:
        """Full batches in one pass."""
        return self.num_windows // self.batch_size

    def starts(self, step: int) -> torch.Tensor:
        """``[B]`` first token of each window of batch ``step``."""
        if not 0 <= step < self.steps:
            raise ValidationError(f"step={step}; one pass has steps [0, {self.steps})")
        chosen = self.order[step * self.batch_size : (step + 1) * self.batch_size]
        return chosen * self.seq_len

    def trained_starts(self, steps: int) -> torch.Tensor:
        """``[steps B]`` first token of every window of the first ``steps`` batches."""
        return self.order[: steps * self.batch_size] * self.seq_len

    def batch(self, step: int) -> torch.Tensor:
        """``[B, S+1]`` token indices of batch ``step``."""
        return self.starts(step)[:, None] + self._offsets[None, :]


@dataclass
class TrainResult:
    """One model's run; ``val_curve`` is ``[[step, validation loss], ...]``.

    With validation, the model (and its tables) hold the weights of
    ``best_step``, the step of the lowest validation loss, when
    :func:`train_model` returns; ``last_heldout`` is the held-out loss of the
    last step's weights, measured before they were replaced.
    """

    steps: int
    schedule_steps: int
    seconds: float
    tokens_seen: int
    losses: list[float]
    val_curve: list[list[float]] = field(default_factory=list)
    best_step: int | None = None
    best_val: float | None = None
    last_heldout: float | None = None


def make_optimizers(
    model: TinyLM, tables: Sequence[EngramTable], settings: TrainSettings
) -> tuple[torch.optim.Optimizer, SparseRowAdam | None]:
    """AdamW for the dense weights, :class:`SparseRowAdam` for the tables (None without)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    # Weight decay on the projection matrices and the embedding only: not on norm
    # weights (the gate's q_weight/k_weight and the short convolution's norm_weight are
    # [hc, D] norm weights), the convolution's taps, nor the hyper-connections'
    # read/mix/write weights.
    for pname, param in model.named_parameters():
        matrix = param.dim() == 2 and not pname.endswith(
            (".mix", "q_weight", "k_weight", "norm_weight")
        )
        (decay if matrix else no_decay).append(param)
    dense = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    sparse = (
        SparseRowAdam([t.weight for t in tables], lr=settings.table_lr, betas=(0.9, 0.99))
        if tables
        else None
    )
    return dense, sparse


@dataclass
class UnseenNgrams:
    """Positions shown to an Engram model in training as if their n-grams were new.

    At a held-out position whose n-gram of order ``n`` training never saw, neither were
    the longer ones, and each of their hash heads lands in a bucket some other n-gram
    wrote. Training sees almost none of that: every training n-gram wrote its own rows.
    So, at a share ``rate`` of the positions of a batch (the same positions for every
    Engram layer: they see the same tokens), an order ``n`` is drawn uniformly from
    2..N and every column of order ``n`` and above reads a uniformly drawn bucket of its
    own hash head instead. Those rows give no gradient to the tables (no other n-gram's
    row learns from this context); the gate, the keys and values do learn, so that they
    can tell a row that belongs to the context from one that does not. Evaluation and
    serving are unchanged (SPEC §8 holds).

    Attributes:
        rate: the share of positions, in [0, 1).
        offsets, primes: ``[L, C]`` int64: each hash column's first row and bucket count.
        order_of_col: ``[C]`` int64: each column's n-gram order, from 0 (the 2-gram).
        orders: how many orders there are (``N - 1``).
        generator: the draws' random stream (seeded: a run repeats).
    """

    rate: float
    offsets: torch.Tensor
    primes: torch.Tensor
    order_of_col: torch.Tensor
    orders: int
    generator: torch.Generator

    @classmethod
    def of(
        cls, rate: float, consts: HashConstants, seed: int, device: torch.device
    ) -> UnseenNgrams:
        cols = consts.col_primes.shape[1]
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return cls(
            rate,
            torch.as_tensor(consts.offsets, dtype=torch.int64, device=device),
            torch.as_tensor(consts.col_primes, dtype=torch.int64, device=device),
            torch.arange(cols, device=device) // consts.n_heads,
            cols // consts.n_heads,
            generator,
        )

    def split(self, row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_ids [B, S, L, C]`` -> ``(own, other)``, each ``[B, S, L, C]`` int64: the
        ids whose rows train with the context, -1 at the columns made new (read as zeros,
        no gradient), and the drawn buckets there, -1 elsewhere."""
        batch, seq, layers, cols = row_ids.shape
        device, g = row_ids.device, self.generator
        hit = torch.rand((batch, seq, 1, 1), generator=g, device=device) < self.rate
        first = torch.randint(0, self.orders, (batch, seq, 1, 1), generator=g, device=device)
        new = hit & (self.order_of_col >= first)  # [B, S, 1, C]
        draw = torch.rand(
            (batch, seq, layers, cols), generator=g, device=device, dtype=torch.float64
        )
        drawn = self.offsets + torch.minimum((draw * self.primes).long(), self.primes - 1)
        own = torch.where(new, -1, row_ids.long())
        other = torch.where(new, drawn, -1)
        return own, other


def unseen_rows_of(rows_of: RowsOf, other: torch.Tensor) -> RowsOf:
    """``rows_of`` for the ids :meth:`UnseenNgrams.split` kept, plus, without gradient,
    the rows of the buckets it drew (``other [B, S, L, C]``): the two never overlap."""
    cols = other.shape[-1]

    def rows(index: int, own: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            drawn = rows_of(index, other[:, :, index].reshape(-1, cols))
        return rows_of(index, own) + drawn

    return rows


def train_step(
    model: TinyLM,
    rows_of: RowsOf,
    optimizers: tuple[torch.optim.Optimizer, SparseRowAdam | None],
    train_tokens: torch.Tensor,
    train_row_ids: torch.Tensor | None,
    index: torch.Tensor,
    *,
    lr_factor: float,
    settings: TrainSettings,
    unseen: UnseenNgrams | None = None,
) -> torch.Tensor:
    """One optimiser step on the windows ``index`` ``[B, S+1]``; returns the loss (on the
    device, not read). ``unseen``: some positions read other n-grams' rows (see
    :class:`UnseenNgrams`)."""
    dense, sparse = optimizers
    for group in dense.param_groups:
        group["lr"] = settings.lr * lr_factor
    if sparse is not None:
        for group in sparse.param_groups:
            group["lr"] = settings.table_lr * lr_factor
    window = train_tokens[index]
    inputs, targets = window[:, :-1], window[:, 1:]
    fns = {}
    if train_row_ids is not None:
        batch_ids = train_row_ids[index[:, :-1]]
        if unseen is not None:
            batch_ids, other = unseen.split(batch_ids)
            rows_of = unseen_rows_of(rows_of, other)
        fns = engram_fns(model, rows_of, batch_ids)
    with autocast_for(train_tokens.device):
        logits = model(inputs, engram=fns)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in dense.param_groups for p in g["params"]], 1.0)
    dense.step()
    if sparse is not None:
        sparse.step()
        sparse.zero_grad(set_to_none=True)
    dense.zero_grad(set_to_none=True)
    return loss


def _drain(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; nothing to wait for elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_model(
    name: str,
    model: TinyLM,
    tables: Sequence[EngramTable],
    train_tokens: torch.Tensor,
    train_row_ids: torch.Tensor | None,
    settings: TrainSettings,
    *,
    steps: int | None,
    budget_s: float | None,
    schedule_steps: int | None = None,
    validate: Callable[[], float] | None = None,
    heldout: Callable[[], float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    unseen: UnseenNgrams | None = None,
) -> TrainResult:
    """Train ``model`` (and its ``tables``) on one pass of the training stream.

    The stream is cut into non-overlapping windows (:class:`OnePassWindows`:
    every token is a target at most once) in a seeded shuffled order; step
    ``i`` takes the ``i``-th batch of that order, so models trained with the
    same settings see the same windows in the same order. Exactly ``steps``
    steps, or as many as fit ``budget_s`` seconds (the count is fixed after
    20 timed steps; a hard stop at 110% of the budget), never more than one
    pass holds. ``validate`` (the validation loss) runs every
    ``settings.eval_every`` steps and after the last; the weights of the
    best step are kept and put back at the end (early stopping as a guard;
    the held-out split is only evaluated, by ``heldout``, on the last
    step's weights before they are replaced, and afterwards by the caller).
    The budget starts after the first step, which carries one-time costs
    (kernel compilation, lazy imports, allocator warm-up). ``clock`` gives
    seconds (tests pass a simulated one). A non-finite loss stops the run
    with a :class:`TrainingDiverged` error.
    """
    device = train_tokens.device
    windows = OnePassWindows(
        int(train_tokens.shape[0]), settings.seq_len, settings.batch_size, settings.seed, device
    )
    dense, sparse = make_optimizers(model, tables, settings)
    # The schedule's length and the step to stop at: both ``steps`` when given; with
    # a budget, the schedule is fixed after the probe and the stop is its end (or the
    # hard stop); the baseline gets the Engram model's schedule and stop.
    total = schedule_steps if schedule_steps is not None else steps
    stop = steps
    probe = 20
    batch, seq = settings.batch_size, settings.seq_len
    if total is not None and total > windows.steps:
        settings.say(
            f"{name}: {total} steps asked, one pass holds {windows.steps}: {windows.steps} steps"
        )
        total = windows.steps
        stop = None if stop is None else min(stop, windows.steps)
    losses: list[torch.Tensor] = []
    began = clock()
    budget_began = began  # reset after the first step
    probe_began = began
    log_every = 10.0
    last_log = began
    step = 0
    rows_of: RowsOf = lambda index, ids: tables[index](ids)  # noqa: E731
    val_curve: list[list[float]] = []
    best: tuple[int, float, dict[str, torch.Tensor], list[torch.Tensor]] | None = None

    def check_validation() -> None:
        nonlocal best
        if validate is None or (val_curve and val_curve[-1][0] == step):
            return
        value = validate()
        val_curve.append([step, round(value, 5)])
        if best is None or value < best[1]:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best = (step, value, state, [t.weight.detach().clone() for t in tables])

    model.train()
    while True:
        end = stop if stop is not None else total
        if end is not None and step >= end:
            break
        elapsed = clock() - budget_began
        if budget_s is not None and step > 0 and elapsed > 1.1 * budget_s:
            settings.say(f"{name}: hard stop at step {step} ({elapsed:.0f} s)")
            break
        loss = train_step(
            model,
            rows_of,
            (dense, sparse),
            train_tokens,
            train_row_ids,
            windows.batch(step),
            lr_factor=_lr_factor(step, min(100, max(1, (total or 1000) // 10)), total or 10**9),
            settings=settings,
            unseen=unseen,
        )
        losses.append(loss.detach())
        step += 1
        if validate is not None and step % settings.eval_every == 0:
            check_validation()
        if step == 1:
            budget_began = clock()
        if step == 5:
            _drain(device)
            probe_began = clock()
        if total is None and step == probe:
            _drain(device)
            per_step = (clock() - probe_began) / (probe - 5)
            remaining = budget_s - (clock() - budget_began) if budget_s else 0.0
            total = min(windows.steps, max(probe, probe + int(remaining / per_step)))
            settings.say(f"{name}: {per_step * 1e3:.1f} ms/step -> {total} steps in the budget")
        now = clock()
        end = stop if stop is not None else total
        if now - last_log >= log_every or step == end:
            last_log = now
            recent = torch.stack(losses[-20:]).float().mean().item()
            if not math.isfinite(recent):
                raise TrainingDiverged(
                    f"{name}: the training loss is {recent} at step {step}; no model is written"
                )
            settings.say(
                f"{name}: step {step}/{end or '?'} loss {recent:.4f} "
                f"({step * batch * seq / (now - began):,.0f} tok/s, {now - began:.0f} s)"
            )
    _drain(device)
    seconds = clock() - began
    values = torch.stack(losses).float().cpu().tolist() if losses else []
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise TrainingDiverged(
            f"{name}: the training loss is {values[bad[0]]} at step {bad[0] + 1} "
            f"({len(bad)} non-finite steps); no model is written"
        )
    result = TrainResult(step, total or step, seconds, step * batch * seq, values)
    if validate is not None:
        check_validation()
        result.val_curve = val_curve
        if heldout is not None:
            result.last_heldout = heldout()
        assert best is not None
        result.best_step, result.best_val = best[0], best[1]
        model.load_state_dict(best[2])
        with torch.no_grad():
            for table, weight in zip(tables, best[3], strict=True):
                table.weight.copy_(weight)
        settings.say(
            f"{name}: kept step {best[0]} (validation loss {best[1]:.4f}; last step "
            f"{val_curve[-1][1]:.4f}"
            + (f", held-out {result.last_heldout:.4f}" if result.last_heldout is not None else "")
            + ")"
        )
    return result


def _subsample(values: list[float], points: int = 400) -> list[list[float]]:
    """``[[step, mean loss of the steps up to it since the previous point], ...]``."""
    if not values:
        return []
    edges = np.unique(np.linspace(0, len(values), min(points, len(values)) + 1).astype(int))
    return [
        [int(end), round(float(np.mean(values[begin:end])), 5)]
        for begin, end in itertools.pairwise(edges)
    ]


def _plot(
    path: Path,
    curves: dict[str, list[float]],
    evals: dict[str, float],
    validation: dict[str, list[list[float]]] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, (label, values) in enumerate(curves.items()):
        points = _subsample(values)
        color = f"C{index}"
        if points:
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=color,
                label=f"{label} (train)",
            )
        val = (validation or {}).get(label) or []
        if val:
            ax.plot(
                [p[0] for p in val],
                [p[1] for p in val],
                color=color,
                linestyle="--",
                label=f"{label} (validation)",
            )
    summary = "\n".join(f"held-out {label}: {value:.4f}" for label, value in evals.items())
    ax.text(
        0.98,
        0.75,
        summary,
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=8,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8},
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("tiny Engram LM vs baseline on Python stdlib sources")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    from engramrt._io import atomic_write_bytes

    atomic_write_bytes(path, buf.getvalue())


def _resolve_device(name: str) -> torch.device:
    if name != "auto" and torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device={name!r} but CUDA is not available; use --device cpu")
    return resolve_device(name)


@torch.no_grad()
def token_losses(
    model: TinyLM,
    rows_of: RowsOf | None,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    row_ids: torch.Tensor | None,
    *,
    batch_size: int = 16,
) -> np.ndarray:
    """``[M, S-1]`` float64 next-token loss of every prediction (NaN where invalid)."""
    return token_losses_and_gates(
        model, rows_of, tokens, lengths, row_ids, batch_size=batch_size, with_gates=False
    )[0]


@torch.no_grad()
def token_losses_and_gates(
    model: TinyLM,
    rows_of: RowsOf | None,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    row_ids: torch.Tensor | None,
    *,
    batch_size: int = 16,
    with_gates: bool = True,
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """:func:`token_losses` and, per Engram block, the gate of every prediction: ``{block:
    [M, S-1]}`` float64, the gate at position ``j`` averaged over the ``hc`` streams,
    NaN exactly where the loss is (an empty dict for a dense model or without
    ``with_gates``). Prediction ``j`` targets token ``j + 1``; the gate at ``j`` read the
    rows of the n-grams ending at token ``j``, i.e. of that prediction's context."""
    out = []
    seq = tokens.shape[1]
    engram = rows_of is not None and row_ids is not None and with_gates
    blocks = model.config.engram_layer_ids if engram else ()
    gates: dict[int, list[torch.Tensor]] = {}  # each batch's [B, S], filled by the forward
    gate_out: dict[int, list[np.ndarray]] = {block: [] for block in blocks}
    batches = _batched_logits(
        model, rows_of, tokens, row_ids, batch_size, gates if engram else None
    )
    for chunk, logits in batches:
        losses, valid = next_token_losses(logits, tokens[chunk], lengths[chunk])
        out.append(torch.where(valid, losses.double(), torch.nan).cpu().numpy())
        for block in blocks:
            gate = gates[block].pop()[:, : seq - 1].double()  # [B, S-1]: prediction j's context
            gate_out[block].append(torch.where(valid, gate, torch.nan).cpu().numpy())
    empty = np.zeros((0, seq - 1))
    return (
        np.concatenate(out) if out else empty,
        {block: np.concatenate(v) if v else empty for block, v in gate_out.items()},
    )


@dataclass
class _Outcome:
    """One trained model of a run."""

    name: str
    lm_cfg: LMConfig
    cfg: EngramConfig | None
    model: TinyLM
    tables: list[EngramTable]
    run: TrainResult
    losses: dict[str, float] = field(default_factory=dict)
    per_token: np.ndarray | None = None
    per_token_gates: dict[int, np.ndarray] = field(default_factory=dict)
    """Engram models: per block, the stdlib held-out gate per prediction (see
    :func:`token_losses_and_gates`)."""
    package_per_token: np.ndarray | None = None
    package_per_token_gates: dict[int, np.ndarray] = field(default_factory=dict)
    """:attr:`per_token` and :attr:`per_token_gates` on the package held-out set (when
    the run has one)."""
    rows_reached: list[float] | None = None
    """Engram models: the share of each table's rows training looked up
    (:func:`rows_reached`)."""
    engram_curve: list[list[Any]] | None = None
    """Engram models: ``[[step, engram_state], ...]`` at every validation
    (:func:`engram_state`: the mean gate per block, each table's row RMS)."""

    def record(self, settings: TrainSettings) -> dict[str, Any]:
        from engramrt_lab.models.lm import flops_per_token

        data = _run_record(self.run, settings)
        data["dense_parameters"] = sum(p.numel() for p in self.model.parameters())
        data["table_parameters"] = sum(t.weight.numel() for t in self.tables)
        data["table_bytes_fp8"] = sum(
            t.weight.shape[0] * (t.weight.shape[1] + t.weight.shape[1] // 32) for t in self.tables
        )
        data["flops_per_token"] = flops_per_token(self.lm_cfg)
        data["tokens_per_dense_parameter"] = round(
            self.run.tokens_seen / data["dense_parameters"], 2
        )
        data["mlp_dim"] = self.lm_cfg.mlp_dim
        if self.cfg is not None:
            data["engram_layers"] = list(self.cfg.layer_ids)
            data["buckets_per_head"] = list(self.cfg.vocab_size)
            data["head_dim"] = self.cfg.head_dim
            data["rows_reached"] = self.rows_reached
            data["engram_curve"] = self.engram_curve
        data["losses"] = dict(self.losses)
        return data


@dataclass
class _TrainRun:
    """What every stage of :func:`train` shares: the settings, the data, the models so far."""

    settings: TrainSettings
    device: torch.device
    out: Path | None
    """The model directory being written (None: a run of some models, no directory)."""
    began: float
    results: dict[str, Any]
    token_map: Any
    corpus: Corpus
    corpus_record: dict[str, Any]
    vocab: Vocab
    covered: float
    cfg: EngramConfig
    lm_cfg: LMConfig
    train_tokens: torch.Tensor
    map_cpu: torch.Tensor
    heldout: _EvalSet
    sample: EvalSegments
    validation: _EvalSet
    package: _EvalSet | None
    eval_sets: dict[str, _EvalSet]
    budget: float | None
    outcomes: dict[str, _Outcome] = field(default_factory=dict)
    schedule: dict[str, int] = field(default_factory=dict)

    def say(self, message: str) -> None:
        self.settings.say(message)

    def save_results(self) -> None:
        if self.settings.results is not None:
            self.results["seconds_so_far"] = round(time.perf_counter() - self.began, 1)
            artifacts.write_json(Path(self.settings.results), self.results)

    def model_dir(self) -> Path:
        """The model directory being written; only a run of all three models has one."""
        if self.out is None:
            raise ValueError(
                f"this run trains models {list(self.settings.models)}, not all of "
                f"{list(MODEL_NAMES)}, and writes no model directory"
            )
        return self.out

    def schedule_args(self) -> dict[str, Any]:
        """``train_model``'s schedule arguments: the first model's from the settings (its
        steps, or the ``--minutes`` budget), every later one's from the first's."""
        if not self.schedule:
            return {"steps": self.settings.steps, "budget_s": self.budget, "schedule_steps": None}
        return {
            "steps": self.schedule["steps"],
            "budget_s": None,
            "schedule_steps": self.schedule["schedule_steps"],
        }

    def fix_schedule(self, result: TrainResult) -> None:
        """Keep the first model's schedule for the rest (no-op after it)."""
        if not self.schedule:
            self.schedule.update(steps=result.steps, schedule_steps=result.schedule_steps)

    def keep(self, outcome: _Outcome) -> None:
        self.outcomes[outcome.name] = outcome
        self.results["models"][outcome.name] = outcome.record(self.settings)
        self.results["steps"] = self.schedule
        self.save_results()


def _compare_with_packaged_corpus(
    corpus_record: dict[str, Any], say: Callable[[str], None]
) -> None:
    """Say whether the corpus is the packaged model's (informative only)."""
    from engramrt_lab.models.corpus import manifest_differences

    try:
        from engramrt_lab.models.packaged import packaged_model_dir

        shipped = artifacts.read_model_json(packaged_model_dir())["training"]["corpus"]
        if "kept_sha256" in shipped:
            diffs = manifest_differences(shipped, corpus_record)
            say(
                "corpus: the packaged model's corpus exactly"
                if not diffs
                else "corpus differs from the packaged model's: " + "; ".join(diffs)
            )
    except Exception as exc:  # informative only: no packaged record to compare with
        say(f"corpus: no packaged record to compare with ({type(exc).__name__})")


def _prepare(settings: TrainSettings, began: float, out: Path | None) -> _TrainRun:
    """The corpus, the vocabulary and the evaluation sets of a run that writes its model
    directory into ``out`` (the staging directory of ``settings.out``; None: a run of
    some models, whose output is its record)."""
    from engramrt.tokenmap import TokenMap, load_tokenizer

    device = _resolve_device(settings.device)
    torch.manual_seed(settings.seed)
    say = settings.say
    written = (
        f"out {settings.out} (written in {out.name}, swapped in when complete)"
        if out is not None
        else f"models {','.join(settings.models)}, their record {settings.results}"
    )
    say(f"engramrt_lab.models.train: {written}, device {device}, torch {torch.__version__}")
    results: dict[str, Any] = {"command": training_command(settings), "models": {}}
    tokenizer = load_tokenizer()
    token_map = TokenMap.from_tokenizer_file(use_cache=False)
    cfg = engram_config(settings.dim, settings.buckets, settings.engram_layers, settings.head_dim)
    try:
        corpus: Corpus = build_corpus(
            tokenizer,
            max_files=settings.max_files,
            max_train_chars=settings.max_train_chars,
            root=settings.stdlib_root,
            sites=settings.site_dirs,
            say=say,
        )
    except ValidationError as exc:
        raise FlagError(f"--stdlib-root/--site-dirs/--max-files: {exc}") from exc
    corpus_record = corpus.record()
    say(
        f"corpus: python {corpus.python_version}, {len(corpus.train.files):,} train files "
        f"({corpus.train.num_tokens:,} tokens), {len(corpus.heldout.files)} held-out files "
        f"({corpus.heldout.num_tokens:,} tokens), {len(corpus.validation.files)} validation "
        f"files ({corpus.validation.num_tokens:,} tokens), {len(corpus.package_heldout.files)} "
        f"package held-out files {corpus_record['package_heldout_found']} "
        f"({corpus.package_heldout.num_tokens:,} tokens), digest "
        f"{corpus_record['kept_sha256'][:16]}, {corpus.seconds:.1f} s"
    )
    _compare_with_packaged_corpus(corpus_record, say)
    results["corpus"] = corpus_record
    counts = np.bincount(corpus.train.tokens, minlength=token_map.vocab_size)
    vocab = Vocab.from_counts(counts, settings.vocab_k)
    if vocab.num_kept < settings.vocab_k and settings.vocab_k_given:
        raise FlagError(
            f"--vocab-k={settings.vocab_k} but the training split holds {vocab.num_kept:,} "
            f"distinct token ids; expected at most {vocab.num_kept:,} (the vocabulary would "
            f"silently be smaller)"
        )
    covered = counts[list(vocab.token_ids)].sum() / max(1, counts.sum())
    say(f"vocab: K = {vocab.num_kept} kept ids + <other>, covering {covered:.2%} of train tokens")

    trim = torch.as_tensor(np.array(vocab.trim_map), device=device)
    train_tokens = trim[torch.as_tensor(corpus.train.tokens, device=device)]

    def eval_set(split: Any, count: int) -> _EvalSet:
        segments = eval_segments(split, settings.seq_len, count, cfg.max_ngram_size)
        return _EvalSet(
            segments,
            trim[torch.as_tensor(segments.tokens, device=device)],
            torch.as_tensor(segments.lengths, device=device),
        )

    heldout = eval_set(corpus.heldout, settings.eval_sequences)
    segments = heldout.segments
    sample_index = np.arange(
        0,
        segments.num_sequences,
        max(1, math.ceil(segments.num_sequences / settings.sample_sequences)),
    )[: settings.sample_sequences]
    sample = segments.subset(sample_index)
    sample_set = _EvalSet(
        sample,
        heldout.tokens[torch.as_tensor(sample_index, device=device)],
        heldout.lengths[torch.as_tensor(sample_index, device=device)],
    )
    validation = eval_set(corpus.validation, settings.val_sequences)
    package = (
        eval_set(corpus.package_heldout, settings.eval_sequences)
        if corpus.package_heldout.num_tokens
        else None
    )
    say(
        f"held-out: {segments.num_sequences} sequences ({segments.num_predictions:,} "
        f"predictions), sample {sample.num_sequences}; package held-out: "
        f"{package.segments.num_predictions if package else 0:,} predictions; validation: "
        f"{validation.segments.num_predictions:,} predictions, every {settings.eval_every} steps"
    )
    eval_sets = {"heldout": heldout, "sample": sample_set}
    if package is not None:
        eval_sets["package_heldout"] = package
    return _TrainRun(
        settings=settings,
        device=device,
        out=out,
        began=began,
        results=results,
        token_map=token_map,
        corpus=corpus,
        corpus_record=corpus_record,
        vocab=vocab,
        covered=float(covered),
        cfg=cfg,
        lm_cfg=lm_configs(settings, vocab.size, cfg),
        train_tokens=train_tokens,
        map_cpu=torch.as_tensor(np.array(token_map.map)),
        heldout=heldout,
        sample=sample,
        validation=validation,
        package=package,
        eval_sets=eval_sets,
        budget=None if settings.steps is not None else settings.minutes * 60,
    )


def _engram_row_ids(
    run: _TrainRun, consts: HashConstants
) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor], torch.Tensor]:
    """Row ids of the training tokens, of every evaluation set and of the validation set;
    checks that the held-out sequences' own hashing (lookback ids) gives their in-document
    ids."""
    settings, device, heldout = run.settings, run.device, run.heldout
    token_map = run.token_map
    train_ids, report = corpus_row_ids(run.corpus.train, consts, token_map.map, device)
    held_ids, _ = corpus_row_ids(run.corpus.heldout, consts, token_map.map, device)
    ids = {
        k: segment_row_ids(v.segments, consts, run.map_cpu, device)
        for k, v in run.eval_sets.items()
    }
    val_ids = segment_row_ids(run.validation.segments, consts, run.map_cpu, device)
    segs = heldout.segments
    valid = torch.arange(settings.seq_len, device=device)[None, :] < heldout.lengths[:, None]
    in_doc = held_ids[
        (
            torch.as_tensor(segs.starts, device=device)[:, None]
            + torch.arange(settings.seq_len, device=device)[None, :]
        ).clamp(max=held_ids.shape[0] - 1)
    ]
    if not bool((ids["heldout"] == in_doc)[valid].all()):
        raise AssertionError(
            "held-out sequences hashed with lookback ids differ from their documents"
        )
    return train_ids, report, ids, val_ids


def engram_state(
    gates: Mapping[int, Sequence[torch.Tensor]],
    lengths: torch.Tensor,
    tables: Sequence[EngramTable],
) -> dict[str, Any]:
    """What an Engram model's memory looks like at one evaluation: ``gate``, each block's
    mean gate over the predictions of the sequences evaluated (``gates``: that block's
    ``[B, S]`` gates of each batch, in order; ``lengths [M]``: the sequences' valid
    tokens, so positions ``< length - 1`` are predictions), and ``row_rms``, each table's
    root mean square value."""
    state: dict[str, Any] = {"gate": {}, "row_rms": []}
    for block, parts in gates.items():
        values = torch.cat(list(parts)).double()  # [M, S]
        mask = torch.arange(values.shape[1], device=values.device)[None, :] < (
            lengths.to(values.device)[:, None] - 1
        )
        state["gate"][str(block)] = round(float(values[mask].mean()), 5)
    for table in tables:
        weight = table.weight.detach()
        state["row_rms"].append(round(float(weight.double().pow(2).mean().sqrt()), 6))
    return state


def rows_reached(
    train_row_ids: torch.Tensor, windows: OnePassWindows, steps: int, num_rows: Sequence[int]
) -> list[float]:
    """The share of each table's rows that training looked up: ``train_row_ids [T, L, C]``
    (the training stream's row ids), the input positions of the first ``steps`` batches
    of ``windows``, table ``l`` of ``num_rows[l]`` rows. A row outside that share got no
    gradient; the rest is what n-grams the tables hold share with each other."""
    starts = windows.trained_starts(steps).to(train_row_ids.device)
    positions = (
        starts[:, None] + torch.arange(windows.seq_len, device=train_row_ids.device)[None, :]
    ).flatten()
    shares = []
    for layer, rows in enumerate(num_rows):
        hit = torch.zeros(rows, dtype=torch.bool, device=train_row_ids.device)
        for col in range(train_row_ids.shape[2]):
            hit[train_row_ids[positions, layer, col].long()] = True
        shares.append(round(float(hit.float().mean()), 6))
    return shares


def _finish(run: _TrainRun, outcome: _Outcome, rows: RowsOf | None, ids: Any) -> _Outcome:
    """Evaluate a trained model on every evaluation set (``ids``: their row ids, or None
    for a dense model)."""
    model, heldout = outcome.model, run.heldout
    for key, data in run.eval_sets.items():
        key_ids = None if ids is None else ids[key]
        outcome.losses[key] = evaluate(model, rows, data, key_ids)
    outcome.per_token, outcome.per_token_gates = token_losses_and_gates(
        model, rows, heldout.tokens, heldout.lengths, None if ids is None else ids["heldout"]
    )
    if run.package is not None:
        package = run.package
        outcome.package_per_token, outcome.package_per_token_gates = token_losses_and_gates(
            model,
            rows,
            package.tokens,
            package.lengths,
            None if ids is None else ids["package_heldout"],
        )
    outcome.losses["last_step_heldout"] = outcome.run.last_heldout  # type: ignore[assignment]
    run.say(f"{outcome.name}: held-out losses {_rounded(outcome.losses)}")
    return outcome


def _run_engram(run: _TrainRun, name: str, engram_cfg: EngramConfig) -> _Outcome:
    """Train (and evaluate) an Engram model; the run's first model sets the schedule of the
    rest."""
    settings, device = run.settings, run.device
    validation, heldout = run.validation, run.heldout
    t0 = time.perf_counter()
    consts = HashConstants.from_config(engram_cfg, run.token_map)
    train_ids, report, ids, val_ids = _engram_row_ids(run, consts)
    _drain(device)
    run.say(f"{name}: row ids {report}, {time.perf_counter() - t0:.1f} s")
    model_cfg = lm_configs(settings, run.vocab.size, engram_cfg)
    torch.manual_seed(settings.seed)
    model = TinyLM(model_cfg).to(device)
    if settings.engram_init == "rows-zero":
        model.engram_values_normal_()
    for block in engram_cfg.layer_ids:
        model.engram_head(block).slope_floor = settings.gate_slope_floor
    tables = [
        EngramTable(rows, engram_cfg.head_dim, init_std=settings.table_init_std, device=device)
        for rows in engram_cfg.num_embeddings
    ]
    run.say(
        f"{name}: {sum(p.numel() for p in model.parameters()):,} dense parameters, "
        f"Engram at blocks {list(engram_cfg.layer_ids)}, buckets per head "
        f"{list(engram_cfg.vocab_size)}, tables {[tuple(t.weight.shape) for t in tables]}"
    )
    rows: RowsOf = lambda index, ids_: tables[index](ids_)  # noqa: E731
    states: list[dict[str, Any]] = []

    def validate() -> float:
        gates: dict[int, list[torch.Tensor]] = {}
        loss = evaluate(model, rows, validation, val_ids, gates)
        states.append(engram_state(gates, validation.lengths, tables))
        return loss

    result = train_model(
        name,
        model,
        tables,
        run.train_tokens,
        train_ids,
        settings,
        **run.schedule_args(),
        validate=validate,
        heldout=lambda: evaluate(model, rows, heldout, ids["heldout"]),
        unseen=(
            UnseenNgrams.of(settings.unseen_rate, consts, settings.seed, device)
            if settings.unseen_rate
            else None
        ),
    )
    run.fix_schedule(result)
    windows = OnePassWindows(
        run.train_tokens.shape[0], settings.seq_len, settings.batch_size, settings.seed, device
    )
    reached = rows_reached(train_ids, windows, result.steps, engram_cfg.num_embeddings)
    del train_ids
    run.say(f"{name}: training looked up {[f'{r:.1%}' for r in reached]} of each table's rows")
    outcome = _finish(run, _Outcome(name, model_cfg, engram_cfg, model, tables, result), rows, ids)
    outcome.rows_reached = reached
    outcome.engram_curve = [
        [step, state] for (step, _), state in zip(result.val_curve, states, strict=True)
    ]
    outcome.ids = ids  # type: ignore[attr-defined]
    return outcome


def _run_dense(run: _TrainRun, name: str, model_cfg: LMConfig) -> _Outcome:
    """Train (and evaluate) a model without Engram; the run's first model sets the schedule
    of the rest."""
    settings, validation, heldout = run.settings, run.validation, run.heldout
    torch.manual_seed(settings.seed)
    model = TinyLM(model_cfg).to(run.device)
    run.say(
        f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"MLP width {model_cfg.mlp_dim}"
    )
    result = train_model(
        name,
        model,
        [],
        run.train_tokens,
        None,
        settings,
        **run.schedule_args(),
        validate=lambda: evaluate(model, None, validation, None),
        heldout=lambda: evaluate(model, None, heldout, None),
    )
    run.fix_schedule(result)
    return _finish(run, _Outcome(name, model_cfg, None, model, [], result), None, None)


WHERE_IT_WINS = {"heldout": "where_it_wins", "package_heldout": "where_it_wins_package"}
"""The record's key of the where-it-wins split of each held-out set (stdlib, packages)."""


def _where_it_wins(run: _TrainRun) -> Callable[[], dict[str, Any]]:
    """The held-out predictions by what the trained windows held: returns the function that
    computes, for the models trained so far, the losses per category of each held-out set
    (``{record key: split}``, keys :data:`WHERE_IT_WINS`; the package set's only when the
    run has one). The categories come from the windows of the run's schedule, so it is
    first called after a model has trained."""
    from engramrt_lab.models.wins import (
        category_losses,
        category_masks,
        file_masks,
        training_ngrams,
    )

    settings = run.settings
    sets = {"heldout": (run.heldout, run.corpus.heldout)}
    if run.package is not None:
        sets["package_heldout"] = (run.package, run.corpus.package_heldout)
    masks: dict[str, dict[str, Any]] = {}

    def categories() -> dict[str, dict[str, Any]]:
        windows = OnePassWindows(
            run.corpus.train.num_tokens,
            settings.seq_len,
            settings.batch_size,
            settings.seed,
            torch.device("cpu"),
        )
        used = windows.trained_starts(run.schedule["steps"]).numpy()
        starts = used[:, None] + np.arange(settings.seq_len + 1)
        seen = training_ngrams(run.corpus.train.tokens[starts])
        found = {}
        for key, (data, split) in sets.items():
            segments = data.segments
            found[key] = category_masks(segments.tokens, segments.lengths, segments.lookback, seen)
            found[key]["file"] = file_masks(
                segments.tokens.shape[1], segments.lengths, segments.starts, split.doc_starts,
                split.files,
            )  # fmt: skip
        return found

    def wins() -> dict[str, Any]:
        if not masks:
            masks.update(categories())
        outcomes = run.outcomes.values()
        per_set = {
            "heldout": (
                {o.name: o.per_token for o in outcomes if o.per_token is not None},
                {o.name: o.per_token_gates for o in outcomes if o.per_token_gates},
            ),
            "package_heldout": (
                {o.name: o.package_per_token for o in outcomes if o.package_per_token is not None},
                {o.name: o.package_per_token_gates for o in outcomes if o.package_per_token_gates},
            ),
        }
        return {WHERE_IT_WINS[key]: category_losses(masks[key], *per_set[key]) for key in masks}

    return wins


def _fp8_losses(run: _TrainRun) -> dict[str, float]:
    """The Engram model's losses with its tables converted to fp8: float tables -> source
    checkpoint (V4.1 names) -> the convert command's conversion -> the normal loader."""
    from safetensors.torch import save_file

    from engramrt.checkpoint import (
        DEFAULT_SOURCE_NAMES,
        load_tables,
        plan_conversion,
        read_table,
        run_conversion,
    )
    from engramrt.lookup.tiers import DeviceOptions, TablePlacement

    cfg, out, device, token_map = run.cfg, run.model_dir(), run.device, run.token_map
    engram = run.outcomes["engram"]
    work = out / "_work"
    work.mkdir(exist_ok=True)
    source = work / "engram-float.safetensors"
    save_file(
        {
            DEFAULT_SOURCE_NAMES[0].format(layer=layer): table.weight.detach().cpu().contiguous()
            for layer, table in zip(cfg.layer_ids, engram.tables, strict=True)
        },
        str(source),
    )
    plan = plan_conversion(source, out / artifacts.ENGRAM_TABLES, cfg, token_map=token_map)
    run_conversion(plan, device=device)
    # Kernels on CUDA; on a CPU the references (the same bytes and rows, without
    # Triton's interpreter when it is switched on).
    backend = "auto" if device.type == "cuda" else "reference"
    for index, table in enumerate(engram.tables):
        converted = read_table(out / artifacts.ENGRAM_TABLES, cfg, index, token_map=token_map)
        if not torch.equal(converted, table.packed_rows(backend=backend).cpu()):
            raise AssertionError(
                f"converted table of layer {cfg.layer_ids[index]} differs from packed_rows()"
            )
    placement = TablePlacement(DeviceOptions(backend=backend), device=device)
    stores = load_tables(out / artifacts.ENGRAM_TABLES, cfg, placement, token_map=token_map)
    fp8_rows: RowsOf = lambda index, ids: stores[index].lookup(ids).float()  # noqa: E731
    engram_ids = engram.ids  # type: ignore[attr-defined]
    fp8 = {
        key: evaluate(engram.model, fp8_rows, data, engram_ids[key])
        for key, data in run.eval_sets.items()
    }
    shutil.rmtree(work, ignore_errors=True)
    return fp8


def _training_record(run: _TrainRun, fp8: dict[str, float], fp8_rel: float) -> dict[str, Any]:
    """The ``training`` record of ``model.json``."""
    outcomes, settings, segments = run.outcomes, run.settings, run.heldout.segments

    def losses_of(key: str) -> dict[str, float]:
        values = {name: outcomes[name].losses[key] for name in MODEL_NAMES}
        values["engram_fp8"] = fp8[key]
        return values

    record: dict[str, Any] = {
        "command": run.results["command"],
        "device": str(run.device),
        "torch": torch.__version__,
        "corpus": run.corpus_record,
        "settings": settings_record(settings),
        **{name: outcomes[name].record(settings) for name in MODEL_NAMES},
        "heldout": {
            "sequences": segments.num_sequences,
            "predictions": segments.num_predictions,
            "losses": losses_of("heldout"),
            "fp8_vs_float_relative": fp8_rel,
            "weights": "each model at its step of lowest validation loss (early stopping "
            "as a guard; one pass)",
            "last_step_losses": {name: outcomes[name].run.last_heldout for name in MODEL_NAMES},
            "sample_sequences": run.sample.num_sequences,
            "sample_predictions": run.sample.num_predictions,
            "sample_losses": losses_of("sample"),
        },
        **{key: run.results[key] for key in WHERE_IT_WINS.values() if key in run.results},
        "vocab_coverage_train": run.covered,
    }
    if run.package is not None:
        record["package_heldout"] = {
            "packages": run.corpus_record["package_heldout_found"],
            "sequences": run.package.segments.num_sequences,
            "predictions": run.package.segments.num_predictions,
            "losses": losses_of("package_heldout"),
        }
    return record


def _write_model_dir(run: _TrainRun, record: dict[str, Any], wide_cfg: LMConfig) -> None:
    """The weights, the held-out sample, ``model.json`` and the curves, into ``run.out``."""
    out, outcomes, cfg, lm_cfg = run.model_dir(), run.outcomes, run.cfg, run.lm_cfg
    artifacts.save_weights(out / artifacts.ENGRAM_WEIGHTS, outcomes["engram"].model)
    artifacts.save_weights(out / artifacts.BASELINE_WEIGHTS, outcomes["baseline"].model)
    artifacts.save_weights(out / artifacts.BASELINE_WIDE_WEIGHTS, outcomes["baseline_wide"].model)
    artifacts.save_sample(out / artifacts.HELDOUT_SAMPLE, run.sample)
    files = {
        "engram_tables": artifacts.ENGRAM_TABLES,
        "engram_weights": artifacts.ENGRAM_WEIGHTS,
        "baseline_weights": artifacts.BASELINE_WEIGHTS,
        "baseline_wide_weights": artifacts.BASELINE_WIDE_WEIGHTS,
        "heldout_sample": artifacts.HELDOUT_SAMPLE,
    }
    model_json: dict[str, Any] = {
        "format": "engramrt-tiny-lm/1",
        "lm": lm_cfg.to_dict(),
        "baseline_lm": lm_cfg.baseline().to_dict(),
        "baseline_wide_lm": wide_cfg.to_dict(),
        "engram": cfg.to_hf_dict(),
        "vocab": run.vocab.to_dict(),
        "files": files,
        "training": record,
    }
    model_json["checksums"] = artifacts.file_checksums(out, files)
    artifacts.write_model_json(out / artifacts.MODEL_JSON, model_json)
    artifacts.write_json(out / artifacts.CONFIG_JSON, cfg.to_hf_dict())
    shipped = {name: (out / name).stat().st_size for name in artifacts.SHIPPED_FILES}
    total_bytes = sum(shipped.values())
    run.say(f"shipped files: {shipped}, total {total_bytes:,} bytes (budget {SIZE_BUDGET_BYTES:,})")
    if total_bytes > SIZE_BUDGET_BYTES or max(shipped.values()) > FILE_LIMIT_BYTES:
        run.say("WARNING: the shipped files exceed the size budget")
    record["shipped_bytes"] = shipped
    served = _served_sample_loss(out, run.device, run.say)
    record["heldout"]["sample_losses"]["engram_fp8_served"] = served
    record["seconds_total"] = round(time.perf_counter() - run.began, 1)
    artifacts.write_model_json(out / artifacts.MODEL_JSON, model_json)
    run.results["heldout"] = record["heldout"]
    run.results["package_heldout"] = record.get("package_heldout")
    run.save_results()
    _plot(
        out / artifacts.LOSS_CURVES,
        {name: outcomes[name].run.losses for name in MODEL_NAMES},
        record["heldout"]["losses"],
        {name: outcomes[name].run.val_curve for name in MODEL_NAMES},
    )
    run.say(f"model directory written in {record['seconds_total']} s")
    artifacts.write_json(
        out / artifacts.TRAIN_LOG,
        {
            "log": run.settings.log,
            "losses": {name: outcomes[name].run.losses for name in MODEL_NAMES},
            "record": record,
        },
    )


def _sweep_entry(run: _TrainRun, name: str, cfg: EngramConfig) -> dict[str, Any]:
    return {
        "name": name,
        "multiple_of_tiny_buckets": sum(cfg.vocab_size)
        / (TODAY_BUCKETS * len(run.settings.buckets)),
        "buckets_per_head": list(cfg.vocab_size),
        "table_bytes_fp8": run.results["models"][name]["table_bytes_fp8"],
        "rows_reached": run.results["models"][name]["rows_reached"],
        "losses": run.results["models"][name]["losses"],
    }


def sweep_model_name(multiple: float) -> str:
    """The model name of the memory sweep's point ``multiple`` (``engram_x4``)."""
    return f"engram_x{multiple:g}"


def layers_model_name(blocks: Sequence[int]) -> str:
    """The model name of the placement comparison at ``blocks`` (``engram_blocks_1_3``)."""
    return "engram_blocks_" + "_".join(str(b) for b in blocks)


def _run_extras(run: _TrainRun, wins: Callable[[], dict[str, Any]]) -> None:
    """The memory curve and the placement comparison: more Engram models, the same steps,
    windows and schedule; their tables are not kept."""
    settings = run.settings
    extras: list[tuple[str, EngramConfig]] = []
    for multiple in settings.memory_sweep:
        buckets = sweep_buckets(settings.buckets, multiple)
        if buckets == tuple(settings.buckets):
            run.say(
                f"memory sweep x{multiple:g}: the Engram model's own tables "
                f"({list(buckets)} buckets per head); its point is that model, not trained again"
            )
            continue
        extras.append(
            (
                sweep_model_name(multiple),
                engram_config(settings.dim, buckets, settings.engram_layers, settings.head_dim),
            )
        )
    if settings.compare_layers is not None:
        extras.append(
            (
                layers_model_name(settings.compare_layers),
                engram_config(
                    settings.dim, settings.buckets, settings.compare_layers, settings.head_dim
                ),
            )
        )
    run.results["memory_sweep"] = (
        [_sweep_entry(run, "engram", run.cfg)] if "engram" in run.results["models"] else []
    )
    for name, extra_cfg in extras:
        outcome = _run_engram(run, name, extra_cfg)
        outcome.model.cpu()
        run.keep(outcome)
        if name.startswith("engram_x"):
            run.results["memory_sweep"].append(_sweep_entry(run, name, extra_cfg))
        run.results.update(wins())
        run.outcomes[name].tables = []
        run.outcomes[name].model = outcome.model
        run.save_results()
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


def train(settings: TrainSettings) -> dict[str, Any]:
    """Run every stage (see the module docstring); returns the training record.

    The model directory is written into a staging directory beside ``settings.out``
    (:func:`engramrt._io.staged_directory`) and put in its place in one rename once it
    is complete; a run that fails (or is killed) before that leaves ``settings.out``
    as it was, an earlier model included. A run of some of the models
    (``settings.models``) writes no directory: it returns its ``--results`` record.
    """
    began = time.perf_counter()
    if settings.out is None:
        return _train_some(settings, began)
    with staged_directory(settings.out) as staging:
        run = _prepare(settings, began, staging)
        record, wins = _train_and_write(run)
    run.out = Path(settings.out)
    run.say(f"model directory in place: {run.out}")
    _run_extras(run, wins)
    run.results["seconds_total"] = round(time.perf_counter() - run.began, 1)
    run.save_results()
    run.say(f"done in {run.results['seconds_total']} s")
    return record


def _train_some(settings: TrainSettings, began: float) -> dict[str, Any]:
    """``settings.models`` (some of the three) and the where-it-wins split of them, then
    the memory sweep and the placement comparison when the Engram model is among them
    (only those: ``--models sweep``, :data:`SWEEP_ONLY`); every stage rewrites the record
    (``settings.results``), which is returned."""
    run = _prepare(settings, began, None)
    wins = _where_it_wins(run)
    if settings.models != (SWEEP_ONLY,):
        for name in settings.models:
            run.keep(_run_model(run, name))
        run.results.update(wins())
        run.save_results()
    if "engram" in settings.models or settings.models == (SWEEP_ONLY,):
        _run_extras(run, wins)
    run.results["seconds_total"] = round(time.perf_counter() - run.began, 1)
    run.save_results()
    run.say(f"done in {run.results['seconds_total']} s")
    return run.results


def _wide_cfg(run: _TrainRun) -> LMConfig:
    """The FLOP-matched baseline: the backbone without Engram, its MLP widened."""
    return dataclasses.replace(run.lm_cfg.baseline(), mlp_dim=wide_mlp_dim(run.lm_cfg))


def _run_model(run: _TrainRun, name: str) -> _Outcome:
    """Train (and evaluate) model ``name`` of :data:`MODEL_NAMES`."""
    if name == "engram":
        return _run_engram(run, name, run.cfg)
    return _run_dense(run, name, run.lm_cfg.baseline() if name == "baseline" else _wide_cfg(run))


def _train_and_write(run: _TrainRun) -> tuple[dict[str, Any], Callable[[], dict[str, Any]]]:
    """The three models, their fp8 check and the model directory, into ``run.out``."""
    for name in MODEL_NAMES:
        run.keep(_run_model(run, name))

    t0 = time.perf_counter()
    wins = _where_it_wins(run)
    run.results.update(wins())
    run.save_results()
    run.say(
        f"where it wins: {run.results['where_it_wins']['longest_seen']}, "
        f"{time.perf_counter() - t0:.1f} s"
    )

    t0 = time.perf_counter()
    fp8 = _fp8_losses(run)
    float_loss = run.outcomes["engram"].losses["heldout"]
    fp8_rel = (fp8["heldout"] - float_loss) / float_loss
    run.say(
        f"fp8 tables: held-out loss {fp8['heldout']:.5f} vs float {float_loss:.5f} "
        f"(relative {fp8_rel:+.4%}), {time.perf_counter() - t0:.1f} s"
    )
    record = _training_record(run, fp8, fp8_rel)
    _write_model_dir(run, record, _wide_cfg(run))
    return record, wins


PROG = "python -m engramrt_lab.models.train"
_WHERE_FILES_GO = ("out", "results")
"""Settings a training record leaves out: where this machine put the files."""
_ROOTS = ("stdlib_root", "site_dirs")
"""Settings a training record keeps by directory name only (:func:`~engramrt_lab.models.corpus.root_name`)."""


_RECORDED_WHEN_USED = ("unseen_rate", "short_conv", "short_conv_dilation", "wkv_heads")
"""Settings added after models were shipped: a record holds them only when they differ
from their defaults, so a record without one was trained at its default and the records
of the same training read alike before and after."""


def settings_record(settings: TrainSettings) -> dict[str, Any]:
    """The ``settings`` of a training record: every setting as JSON but ``out``,
    ``results``, the log and the settings of :data:`_RECORDED_WHEN_USED` at their
    defaults; the source roots by name (:func:`~engramrt_lab.models.corpus.root_name`)."""
    record: dict[str, Any] = {}
    defaults = TrainSettings(out=None)
    for name, value in vars(settings).items():
        if name in (*_WHERE_FILES_GO, "log"):
            continue
        if name in _RECORDED_WHEN_USED and value == getattr(defaults, name):
            continue
        if name == "stdlib_root" and value is not None:
            value = root_name(value)
        elif name == "site_dirs" and value is not None:
            value = [root_name(directory) for directory in value]
        record[name] = _jsonable(value)
    return record


def _flag_value(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(_flag_value(v) for v in value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def training_command(settings: TrainSettings) -> str:
    """The command line of ``settings`` as a record keeps it: ``python -m
    engramrt_lab.models.train`` and every flag whose setting differs from its default, but
    ``--out`` and ``--results`` (where this machine put the files); ``--stdlib-root`` and
    ``--site-dirs`` name their directories in angle brackets (``'<python3.12>'``),
    placeholders for where they are on another machine. With ``--out DIR`` added (``--results
    FILE`` for a run of some ``--models``) it trains the same models (the tests parse it
    back)."""
    defaults = TrainSettings(out=Path("."))
    words = [*PROG.split()]
    for item in dataclasses.fields(TrainSettings):
        name = item.name
        if name in (*_WHERE_FILES_GO, "log", "vocab_k_given"):
            continue
        value = getattr(settings, name)
        given = settings.vocab_k_given if name == "vocab_k" else False
        if not given and value == getattr(defaults, name):
            continue
        if name in _ROOTS:
            names = [value] if name == "stdlib_root" else list(value)
            value = [f"<{root_name(path)}>" for path in names]
        words += [f"--{name.replace('_', '-')}", _flag_value(value)]
    return shlex.join(words)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in values.items()}


def _served_sample_loss(
    out: Path, device: torch.device, say: Callable[[str], None]
) -> float | None:
    """The sample's loss through the serving path (:func:`engramrt_lab.models.serve.load_model`
    of the directory just written); None, and a printed reason, if that fails: the
    directory is complete either way."""
    try:
        from engramrt.lookup.tiers import DeviceOptions, TablePlacement
        from engramrt_lab.models.serve import load_model

        began = time.perf_counter()
        backend = "auto" if device.type == "cuda" else "reference"
        model = load_model(
            out,
            TablePlacement(DeviceOptions(backend=backend), device=device),
            load_baseline=False,
            head_backend=backend,
        )
        loss = model.evaluate()
        say(f"served fp8 model, sample loss {loss:.5f} ({time.perf_counter() - began:.1f} s)")
        return loss
    except Exception as exc:
        say(f"served fp8 model: evaluation failed: {type(exc).__name__}: {exc}")
        return None


def _run_record(run: TrainResult, settings: TrainSettings) -> dict[str, Any]:
    return {
        "steps": run.steps,
        "schedule_steps": run.schedule_steps,
        "seconds": round(run.seconds, 1),
        "tokens_seen": run.tokens_seen,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "final_train_loss": (float(np.mean(run.losses[-50:])) if run.losses else None),
        "kept_step": run.best_step,
        "kept_validation_loss": run.best_val,
        "last_step_heldout_loss": run.last_heldout,
        "validation_curve": run.val_curve,
        "loss_curve": _subsample(run.losses),
    }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(",")) if text else ()


_POSITIVE_INTS = (
    "batch_size",
    "seq_len",
    "val_sequences",
    "eval_every",
    "vocab_k",
    "dim",
    "n_blocks",
    "mlp_dim",
    "eval_sequences",
    "sample_sequences",
    "head_dim",
)


def _table_bytes(buckets: Sequence[int], layers: Sequence[int], head_dim: int) -> int:
    """fp32 table bytes with the optimiser's two moments of an Engram model, from the
    bucket counts (each head's prime is just above its bucket count; the layout's exact
    rows are not needed for a bound, and computing them for 2**62 buckets fails)."""
    heads = PRESETS["tiny"].n_heads
    return len(layers) * heads * sum(int(b) for b in buckets) * head_dim * 12


def _size_problem(args: argparse.Namespace) -> str | None:
    """The first flag whose value would exhaust memory (bounds: the ``MAX_*`` constants)."""
    if args.seq_len > MAX_SEQ_LEN:
        return f"--seq-len={args.seq_len} must be at most {MAX_SEQ_LEN:,} (MAX_SEQ_LEN)"
    if args.vocab_k > TOKENIZER_IDS:
        return (
            f"--vocab-k={args.vocab_k} must be at most {TOKENIZER_IDS:,} (the tokenizer's ids; "
            f"the training split decides how many it holds)"
        )
    tokens = args.batch_size * args.seq_len
    if tokens > MAX_TOKENS_PER_STEP:
        return (
            f"--batch-size={args.batch_size} x --seq-len={args.seq_len} = {tokens:,} tokens per "
            f"step; expected at most {MAX_TOKENS_PER_STEP:,} (MAX_TOKENS_PER_STEP)"
        )
    for name, bound in (("dim", MAX_WIDTH), ("mlp_dim", MAX_WIDTH), ("n_blocks", MAX_BLOCKS)):
        if getattr(args, name) > bound:
            flag = "--" + name.replace("_", "-")
            return f"{flag}={getattr(args, name)} must be at most {bound:,}"
    hc = PRESETS["tiny"].hc_mult
    per_token = args.n_blocks * (10 * hc * args.dim + 3 * args.mlp_dim) + 2 * (args.vocab_k + 1)
    activations = 4 * tokens * per_token
    if activations > MAX_ACTIVATION_BYTES:
        return (
            f"--dim={args.dim}, --mlp-dim={args.mlp_dim}, --n-blocks={args.n_blocks}, "
            f"--vocab-k={args.vocab_k} at {tokens:,} tokens per step (--batch-size x "
            f"--seq-len) keep about {activations / 2**30:,.1f} GiB of activations; expected "
            f"at most {MAX_ACTIVATION_BYTES / 2**30:g} GiB (MAX_ACTIVATION_BYTES): a smaller "
            f"--batch-size or --seq-len"
        )
    if args.head_dim > MAX_HEAD_DIM:
        return f"--head-dim={args.head_dim} must be at most {MAX_HEAD_DIM:,}"
    for name, value in (
        ("--eval-sequences", args.eval_sequences),
        ("--val-sequences", args.val_sequences),
        ("--sample-sequences", args.sample_sequences),
    ):
        if value > MAX_SEQUENCES:
            return f"{name}={value} must be at most {MAX_SEQUENCES:,}"
    from engramrt_lab.models.lm import dense_parameters

    config = LMConfig(
        vocab_size=args.vocab_k + 1,
        dim=args.dim,
        n_blocks=args.n_blocks,
        mlp_dim=args.mlp_dim,
        max_seq_len=args.seq_len,
        engram_layer_ids=tuple(args.engram_layers),
        engram_cols=PRESETS["tiny"].n_cols,
        engram_head_dim=args.head_dim,
    )
    largest = dense_parameters(dataclasses.replace(config.baseline(), mlp_dim=wide_mlp_dim(config)))
    largest = max(largest, dense_parameters(config))
    if largest > MAX_DENSE_PARAMETERS:
        return (
            f"--dim={args.dim}, --mlp-dim={args.mlp_dim}, --n-blocks={args.n_blocks}, "
            f"--vocab-k={args.vocab_k} give a model of {largest:,} dense parameters; expected "
            f"at most {MAX_DENSE_PARAMETERS:,} (MAX_DENSE_PARAMETERS: 16 bytes each with AdamW)"
        )
    tables = [("--buckets", args.buckets, args.engram_layers)]
    tables += [
        (f"--memory-sweep {m:g}", sweep_buckets(args.buckets, m), args.engram_layers)
        for m in args.memory_sweep
    ]
    if args.compare_layers is not None:
        tables.append(("--compare-layers", args.buckets, args.compare_layers))
    for name, buckets, layers in tables:
        size = _table_bytes(buckets, layers, args.head_dim)
        if max(buckets) > 2**31 - 1 or size > MAX_TABLE_BYTES:
            return (
                f"{name} gives Engram tables of {size / 2**30:,.1f} GiB with their optimiser "
                f"state (buckets per head {','.join(map(str, buckets))}, {len(layers)} layer(s), "
                f"--head-dim={args.head_dim}); expected at most {MAX_TABLE_BYTES / 2**30:g} GiB "
                f"(MAX_TABLE_BYTES) and buckets below 2**31"
            )
    return None


_MODEL_DIR_ENTRIES = frozenset(
    {*artifacts.SHIPPED_FILES, artifacts.LOSS_CURVES, artifacts.TRAIN_LOG, "_work"}
)
"""What a model directory this command wrote may hold (``_work``: a killed run's)."""


def _foreign_entries(out: Path, results: Path | None) -> list[str]:
    """Entries of an existing ``--out`` that the swap would discard: neither model files,
    their atomic writers' temporaries, nor the ``--results`` file."""
    allowed = set(_MODEL_DIR_ENTRIES)
    if results is not None and Path(results).parent.resolve() == out.resolve():
        allowed.add(Path(results).name)
    foreign = []
    for entry in sorted(out.iterdir()):
        name = entry.name
        temporary = name.startswith(".") and name.endswith(".tmp")
        if name not in allowed and not temporary:
            foreign.append(name)
    return foreign


def _models_problem(args: argparse.Namespace) -> str | None:
    """What ``--models`` cannot do with the other flags (and puts ``args.models`` in the
    order of :data:`MODEL_NAMES`)."""
    given = ",".join(args.models)
    sweep_only = args.models == (SWEEP_ONLY,)
    unknown = [name for name in args.models if name not in MODEL_NAMES]
    if sweep_only:
        if not args.memory_sweep and args.compare_layers is None:
            return (
                f"--models={SWEEP_ONLY} trains only the Engram models of --memory-sweep and "
                f"--compare-layers; expected at least one of them"
            )
    elif unknown or not args.models or len(set(args.models)) != len(args.models):
        what = f"names {unknown[0]!r}" if unknown else "is empty or repeats a name"
        return (
            f"--models={given} {what}; expected distinct comma-separated names of "
            f"{', '.join(MODEL_NAMES)}, or {SWEEP_ONLY} alone"
        )
    else:
        args.models = tuple(name for name in MODEL_NAMES if name in args.models)
    if args.models == MODEL_NAMES:
        if args.out is None:
            return "--out is required: the model directory of the three models"
        return None
    if args.out is not None:
        return (
            f"--out={str(args.out)!r} with --models={given}: a run of fewer than all three "
            f"models writes no model directory; leave --out out (its record is --results)"
        )
    if args.results is None:
        return f"--models={given} needs --results: the record is the run's only output"
    if args.steps is None:
        return (
            f"--models={given} needs --steps: models trained in separate runs compare only on "
            f"one schedule, and --minutes fixes it from each run's own timing"
        )
    if (
        not sweep_only
        and "engram" not in args.models
        and (args.memory_sweep or args.compare_layers is not None)
    ):
        flag = "--memory-sweep" if args.memory_sweep else "--compare-layers"
        return (
            f"{flag} with --models={given}: the sweep's points are Engram models; add engram "
            f"(or run them alone: --models {SWEEP_ONLY})"
        )
    return None


def _settings_problem(args: argparse.Namespace) -> str | None:
    """The first flag that cannot work, as one sentence naming it and its value."""

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    if args.steps is not None and args.steps < 1:
        return f"--steps={args.steps} must be at least 1"
    problem = _models_problem(args)
    if problem is not None:
        return problem
    if args.eval_every < 1:
        return f"--eval-every={args.eval_every} must be at least 1"
    if not math.isfinite(args.minutes) or args.minutes <= 0:
        return f"--minutes={args.minutes} must be positive (a finite number of minutes)"
    for name in _POSITIVE_INTS:
        if getattr(args, name) < 1:
            return f"{flag(name)}={getattr(args, name)} must be at least 1"
    if args.seq_len < 8:
        return f"--seq-len={args.seq_len} must be at least 8 (a window of n-grams to predict)"
    if args.max_files is not None and args.max_files < 1:
        return f"--max-files={args.max_files} must be at least 1"
    if args.max_train_chars is not None and args.max_train_chars < 1:
        return f"--max-train-chars={args.max_train_chars} must be at least 1"
    if not 0 <= args.seed <= MAX_SEED:
        return f"--seed={args.seed} must be in [0, 2**63 - 1]"
    for name in ("lr", "table_lr"):
        value = getattr(args, name)
        if not math.isfinite(value) or value <= 0:
            return f"{flag(name)}={value} must be a finite positive number"
    if not math.isfinite(args.weight_decay) or args.weight_decay < 0:
        return f"--weight-decay={args.weight_decay} must be a finite number >= 0"
    if not (math.isfinite(args.unseen_rate) and 0 <= args.unseen_rate < 1):
        return f"--unseen-rate={args.unseen_rate} must be a number in [0, 1)"
    if not 0 <= args.short_conv <= MAX_SHORT_CONV:
        return (
            f"--short-conv={args.short_conv} must be in [0, {MAX_SHORT_CONV}] (0: no convolution)"
        )
    dilation = args.short_conv_dilation
    if dilation is not None and not 1 <= dilation <= MAX_SEQ_LEN:
        return f"--short-conv-dilation={dilation} must be in [1, {MAX_SEQ_LEN:,}]"
    if not math.isfinite(args.gate_slope_floor) or args.gate_slope_floor < MIN_ABS_DOT:
        return (
            f"--gate-slope-floor={args.gate_slope_floor} must be a finite number >= {MIN_ABS_DOT} "
            f"(the gate's clamp of |dot|)"
        )
    if args.engram_init == "rows-zero" and args.table_init_std != 0:
        return (
            f"--table-init-std={args.table_init_std} with --engram-init=rows-zero: the rows "
            f"start at zero there; expected 0 or no --table-init-std"
        )
    if args.engram_init == "value-zero" and (
        not math.isfinite(args.table_init_std) or args.table_init_std <= 0
    ):
        return (
            f"--table-init-std={args.table_init_std} must be a finite positive number: rows "
            f"that start at zero, with the value projection's zero start, get no gradient "
            f"(zero keys give the gate no slope) and the tables never learn"
        )
    if args.head_dim % 32:
        return f"--head-dim={args.head_dim} must be a multiple of 32 (one fp8 scale per 32)"
    layer_sets = [("--engram-layers", args.engram_layers)]
    if args.compare_layers is not None:
        layer_sets.append(("--compare-layers", args.compare_layers))
    for name, layers in layer_sets:
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
            return f"{name}={','.join(map(str, layers))} must be distinct block indices >= 0"
        if max(layers) >= args.n_blocks:
            return (
                f"{name}={','.join(map(str, layers))} names a block >= --n-blocks={args.n_blocks}"
            )
    if len(args.buckets) != 3 or min(args.buckets) < 2:
        return f"--buckets={','.join(map(str, args.buckets))} must be 3 counts >= 2 (orders 2-4)"
    for multiple in args.memory_sweep:
        if not math.isfinite(multiple) or multiple <= 0:
            return f"--memory-sweep holds {multiple}; expected finite positive multiples"
    problem = _size_problem(args)
    if problem is not None:
        return problem
    for name, root in [
        ("--stdlib-root", args.stdlib_root),
        *(("--site-dirs", d) for d in (args.site_dirs or ())),
    ]:
        if root is not None and not Path(root).is_dir():
            return f"{name} names {str(root)!r}, which is not a directory"
    if args.stdlib_root is not None and next(Path(args.stdlib_root).rglob("*.py"), None) is None:
        return (
            f"--stdlib-root names {str(args.stdlib_root)!r}, which holds no .py file; expected "
            f"a directory of Python sources (the held-out and validation files come from it)"
        )
    device = args.device
    if device not in ("auto", "cpu") and not (
        device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())
    ):
        return f"--device={device!r}; expected auto, cpu, cuda or cuda:N"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return f"--device={device!r} but CUDA is not available; use --device cpu"
        index = int(device[5:]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            return f"--device={device!r} but there are {torch.cuda.device_count()} CUDA devices"
    for name, path in (("--out", args.out), ("--results", args.results)):
        if path is None:
            continue
        target = Path(path)
        if name == "--out" and target.exists() and not target.is_dir():
            return f"--out={str(target)!r} exists and is not a directory"
        if name == "--out" and target.is_dir():
            foreign = _foreign_entries(target, args.results)
            if foreign:
                listed = ", ".join(repr(n) for n in foreign[:5])
                return (
                    f"--out={str(target)!r} holds {listed}, which a model directory does not "
                    f"hold; expected a new or empty directory, or one written by this command "
                    f"(the new model replaces the directory whole)"
                )
        if name == "--results" and target.is_dir():
            return f"--results={str(target)!r} is a directory; expected a file path"
        for parent in target.parents:
            if parent.exists():
                if not parent.is_dir():
                    return f"{name}={str(target)!r} lies under {str(parent)!r}, which is a file"
                break
    return None


def _add_engram_layer_flags(parser: argparse.ArgumentParser, defaults: TrainSettings) -> None:
    """The flags that change how the Engram models' layers start, train and compute."""
    parser.add_argument(
        "--gate-slope-floor",
        type=float,
        default=defaults.gate_slope_floor,
        help="the Engram gate's backward: below |dot| = this, the slope of sqrt(|dot|) is "
        "held at 0.5/sqrt(this) (default 1e-6, the forward's clamp: the exact gradient)",
    )
    parser.add_argument(
        "--unseen-rate",
        type=float,
        default=defaults.unseen_rate,
        help="Engram models: the share of training positions that read, from their first "
        "n-gram order drawn at random up, buckets of other n-grams, with no gradient to "
        "those rows, as a held-out position with a new n-gram does (default 0: none)",
    )
    parser.add_argument(
        "--short-conv",
        type=int,
        default=defaults.short_conv,
        help="Engram models: taps of a short causal convolution after each Engram gate, "
        "over the gated values, as the Engram paper's (starts at zero; default 0: none)",
    )
    parser.add_argument(
        "--short-conv-dilation",
        type=int,
        default=None,
        help="positions between the short convolution's taps (default: the largest "
        "n-gram order, 4)",
    )
    parser.add_argument(
        "--wkv-heads",
        choices=WKV_HEADS,
        default=defaults.wkv_heads,
        help="Engram models: separate (default) projects each hash head's row apart, as "
        "DeepSeek's layer; summed adds the rows of one n-gram order's heads first (a "
        "projection a quarter as wide, its blocks tied across the heads)",
    )
    parser.add_argument(
        "--engram-init",
        choices=ENGRAM_INITS,
        default=defaults.engram_init,
        help="value-zero (default): the value projection starts at zero, the rows normal "
        "(--table-init-std, default 0.02); rows-zero: the rows start at zero, the value "
        "projection normal, so rows no training n-gram reaches add nothing",
    )


def parse_args(argv: Sequence[str] | None = None) -> TrainSettings:
    """The settings of a command line; every flag is checked here, before any work (a
    bad one: one line on stderr, exit status 2)."""
    parser = OneLineParser(
        prog="python -m engramrt_lab.models.train",
        description="Train the tiny Engram LM and its baselines; write the model directory.",
    )
    defaults = TrainSettings(out=Path("."))
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the model directory to write (required but with --models of fewer than all "
        "three, which write none)",
    )
    parser.add_argument(
        "--models",
        type=_names,
        default=defaults.models,
        help=f"the models to train, comma-separated, of {','.join(MODEL_NAMES)} (default all "
        "three); fewer: no model directory, and --steps and --results are required (the "
        "record is the run's output; the seeds command merges such records per seed); "
        f"{SWEEP_ONLY}: only the Engram models of --memory-sweep and --compare-layers",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    parser.add_argument(
        "--minutes",
        type=float,
        default=defaults.minutes,
        help=f"wall-clock training budget of the Engram model (default {defaults.minutes})",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="train exactly this many steps instead of --minutes"
    )
    parser.add_argument(
        "--max-files", type=int, default=None, help="only the first N training files (tests)"
    )
    for name in (*_POSITIVE_INTS, "seed"):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None if name == "vocab_k" else getattr(defaults, name),
        )
    for name in ("lr", "table_lr", "table_init_std", "weight_decay"):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=float,
            default=None if name == "table_init_std" else getattr(defaults, name),
        )
    _add_engram_layer_flags(parser, defaults)
    parser.add_argument(
        "--engram-layers",
        type=_ints,
        default=defaults.engram_layers,
        help="blocks of the Engram layers (default 1,2)",
    )
    parser.add_argument(
        "--buckets",
        type=_ints,
        default=defaults.buckets,
        help="buckets per hash head for n-gram orders 2,3,4 (default 49152,32768,16384)",
    )
    parser.add_argument(
        "--memory-sweep",
        type=_floats,
        default=(),
        help="after the three models, Engram models with tables of these multiples of the "
        "tiny preset's buckets (e.g. 1,4,12; same steps and windows); the multiple of "
        "--buckets itself (8 by default) is the Engram model, not trained again",
    )
    parser.add_argument(
        "--compare-layers",
        type=_ints,
        default=None,
        help="after the sweep, an Engram model at these blocks instead (e.g. 1,3)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="a JSON of every model's results, rewritten after each model",
    )
    parser.add_argument(
        "--max-train-chars",
        type=int,
        default=defaults.max_train_chars,
        help="characters of training text read (default 160,000,000: ~40 M tokens; the "
        "stdlib's training files always, then package files by sha256 of their names)",
    )
    parser.add_argument(
        "--stdlib-root",
        type=Path,
        default=None,
        help="read this directory as the stdlib (tests; default: the interpreter's)",
    )
    parser.add_argument(
        "--site-dirs",
        type=lambda text: tuple(Path(p) for p in text.split(",") if p),
        default=None,
        help="comma-separated directories read as the site directories (tests; default: "
        "the interpreter's; empty for none)",
    )
    args = parser.parse_args(argv)
    args.vocab_k_given = args.vocab_k is not None
    if args.table_init_std is None:
        args.table_init_std = 0.0 if args.engram_init == "rows-zero" else defaults.table_init_std
    if args.vocab_k is None:
        args.vocab_k = defaults.vocab_k
    problem = _settings_problem(args)
    if problem is not None:
        parser.error(problem)
    return TrainSettings(**vars(args))


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    try:
        train(settings)
    except TrainingDiverged as exc:
        sys.stderr.write(f"python -m engramrt_lab.models.train: error: {exc}\n")
        return 1
    except FlagError as exc:
        sys.stderr.write(f"python -m engramrt_lab.models.train: error: {exc}\n")
        return 2
    except OSError as exc:  # a full or read-only disk, mid-run: the staged model is dropped
        kept = (
            f"--out={str(settings.out)!r} is left as it was"
            if settings.out is not None
            else f"--results={str(settings.results)!r} holds the last complete record, if any"
        )
        sys.stderr.write(
            f"python -m engramrt_lab.models.train: error: writing the model failed: {exc}; {kept}\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
