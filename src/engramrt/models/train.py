"""Train the tiny Engram LM and its baseline on the stdlib sources; write the model directory.

One command (on one H200 it runs in well under 10 minutes, both models)::

    python -m engramrt.models.train --out DIR --minutes 1.5 --device cuda

A small end-to-end run on a CPU (what the tests do)::

    python -m engramrt.models.train --out DIR --device cpu --max-files 20 --steps 5 \\
        --batch-size 2 --seq-len 64 --eval-sequences 8

What it does, in order (every stage prints a line, flushed):

1. corpus (:mod:`engramrt.models.corpus`): stdlib ``*.py`` files, the held-out
   split by ``sha256(path) % 20 == 0``, DeepSeek-V4 tokenizer batch
   encoding, one document per file;
2. trimmed vocabulary (:mod:`engramrt.models.vocab`) from the training split;
3. row ids of every position of both splits, once, with the exact hasher
   (the Triton kernel on CUDA, checked against the torch hashing);
4. the Engram model (``tiny`` Engram config: layers 1 and 3, N = 4, 4 heads,
   E = 64, ~50k rows per layer; backbone D = 256, 4 blocks, hc = 4):
   AdamW for the dense weights, :class:`~engramrt.training.SparseRowAdam`
   for the fp32 tables, linear warmup then cosine to 10%, bf16 autocast on
   CUDA; for ``--minutes`` of wall clock (the step count is fixed after 20
   timed steps) or ``--steps``;
5. the baseline (the same backbone without Engram) for exactly as many
   steps, with the same schedule; both are evaluated on the validation
   files every ``--eval-every`` steps and each keeps the weights of its
   lowest validation loss (early stopping: the corpus is small, a few
   million tokens, so a minute of training is many epochs and both models,
   the Engram tables most, go on to memorise it; the held-out loss of the
   last step's weights is recorded too);
6. held-out loss of both on the same fixed held-out sequences; then the
   float tables are written as a source checkpoint with the V4.1 tensor
   names, converted to fp8 by the conversion the ``engramrt convert``
   command runs (:func:`~engramrt.checkpoint.plan_conversion` +
   :func:`~engramrt.checkpoint.run_conversion`), loaded back with
   :func:`~engramrt.checkpoint.load_tables`, and the Engram model evaluated
   again on those fp8 rows (the relative change is reported);
7. the model directory (:mod:`engramrt.models.artifacts`).

Nothing is cached outside DIR (the token map is built in memory).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engramrt.config import PRESETS, EngramConfig
from engramrt.hashing import HashBatch, HashConstants
from engramrt.hashing.vectorized import hash_batch_torch
from engramrt.models import artifacts
from engramrt.models.corpus import Corpus, EvalSegments, build_corpus, corpus_row_ids, eval_segments
from engramrt.models.lm import LMConfig, TinyLM, next_token_loss_sum
from engramrt.models.vocab import Vocab
from engramrt.training import EngramTable, SparseRowAdam

__all__ = ["TrainSettings", "main", "segment_row_ids", "train"]

SIZE_BUDGET_BYTES = 24_000_000
FILE_LIMIT_BYTES = 15 * 2**20

RowsOf = Callable[[int, torch.Tensor], torch.Tensor]
"""``(engram layer index, row ids [T, C]) -> rows [T, C, E]`` float."""


@dataclass
class TrainSettings:
    """Everything the command line sets (see ``--help``)."""

    out: Path
    device: str = "auto"
    minutes: float = 1.5
    steps: int | None = None
    max_files: int | None = None
    batch_size: int = 64
    seq_len: int = 512
    vocab_k: int = 4096
    dim: int = 256
    n_blocks: int = 4
    mlp_dim: int = 448
    lr: float = 2e-3
    table_lr: float = 1e-2
    weight_decay: float = 0.1
    eval_sequences: int = 128
    val_sequences: int = 64
    eval_every: int = 25
    sample_sequences: int = 32
    seed: int = 0
    log: list[str] = field(default_factory=list)

    def say(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        self.log.append(line)
        print(line, flush=True)


def engram_config(dim: int) -> EngramConfig:
    """The ``tiny`` preset with the backbone's width (same hashing structure)."""
    return PRESETS["tiny"].replace(hidden_size=dim, name="tiny-lm")


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
    )


def engram_fns(model: TinyLM, rows_of: RowsOf, row_ids: torch.Tensor) -> dict[int, Any]:
    """The model's Engram layers for a batch whose row ids are ``row_ids [B, S, L, C]``."""
    fns = {}
    cols = row_ids.shape[-1]
    for index, block in enumerate(model.config.engram_layer_ids):
        head = model.engram_head(block)
        ids = row_ids[:, :, index].reshape(-1, cols)

        def apply(
            streams: torch.Tensor, head: Any = head, ids: torch.Tensor = ids, index: int = index
        ) -> torch.Tensor:
            return head(streams, rows_of(index, ids))

        fns[block] = apply
    return fns


def segment_row_ids(
    segments: EvalSegments, consts: HashConstants, token_map: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Row ids ``[M, S, L, C]`` int32 of held-out sequences, each hashed as one
    request with its lookback ids (so: the ids it has in its document)."""
    count, seq = segments.tokens.shape
    batch = HashBatch(
        input_ids=torch.as_tensor(segments.tokens.reshape(-1), device=device),
        positions=torch.as_tensor(
            (segments.positions[:, None] + np.arange(seq)[None, :]).reshape(-1), device=device
        ),
        query_start_loc=torch.arange(0, (count + 1) * seq, seq, device=device, dtype=torch.int32),
        lookback_token_ids=torch.as_tensor(segments.lookback, device=device),
    )
    ids = hash_batch_torch(batch, consts, token_map.to(device), out_dtype=torch.int32)
    return ids.view(count, seq, consts.n_layers, consts.n_cols)


@torch.no_grad()
def evaluate(
    model: TinyLM,
    rows_of: RowsOf | None,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    row_ids: torch.Tensor | None,
    *,
    batch_size: int = 16,
) -> float:
    """Mean next-token loss (nats) of ``tokens [M, S]`` (trimmed) over the valid predictions."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=tokens.device)
    count = 0
    for begin in range(0, tokens.shape[0], batch_size):
        chunk = slice(begin, begin + batch_size)
        fns = (
            {} if rows_of is None or row_ids is None else engram_fns(model, rows_of, row_ids[chunk])
        )
        with _autocast(tokens.device):
            logits = model(tokens[chunk], engram=fns)
        loss, n = next_token_loss_sum(logits, tokens[chunk], lengths[chunk])
        total += loss.double()
        count += n
    model.train()
    return float(total) / max(count, 1)


def _autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


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
) -> TrainResult:
    """Train ``model`` (and its ``tables``) on random windows of the training stream.

    Exactly ``steps`` steps, or as many as fit ``budget_s`` seconds (the
    count is fixed after 20 timed steps; a hard stop at 110% of the budget).
    ``validate`` (the validation loss) runs every ``settings.eval_every``
    steps and after the last; the weights of the best step are kept and put
    back at the end (early stopping on the validation split; the held-out
    split is only evaluated, by ``heldout``, on the last step's weights
    before they are replaced, and afterwards by the caller).
    The budget starts after the first step, which carries one-time costs
    (kernel compilation, lazy imports, allocator warm-up). ``clock`` gives
    seconds (tests pass a simulated one).
    """
    device = train_tokens.device
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    # Weight decay on the projection matrices and the embedding only: not on norm
    # weights (the gate's q_weight/k_weight are [hc, D] norm weights) nor on the
    # hyper-connections' read/mix/write weights.
    for pname, param in model.named_parameters():
        matrix = param.dim() == 2 and not pname.endswith((".mix", "q_weight", "k_weight"))
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
    # The schedule's length and the step to stop at: both ``steps`` when given; with
    # a budget, the schedule is fixed after the probe and the stop is its end (or the
    # hard stop); the baseline gets the Engram model's schedule and stop.
    total = schedule_steps if schedule_steps is not None else steps
    stop = steps
    probe = 20
    batch, seq = settings.batch_size, settings.seq_len
    max_start = train_tokens.shape[0] - seq - 1
    if max_start < 1:
        raise ValueError(
            f"the training split has {train_tokens.shape[0]} tokens; --seq-len={seq} needs more"
        )
    offsets = torch.arange(seq + 1, device=device)
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
        warmup = min(100, max(1, (total or 1000) // 10))
        factor = _lr_factor(step, warmup, total or 10**9)
        for group in dense.param_groups:
            group["lr"] = settings.lr * factor
        if sparse is not None:
            for group in sparse.param_groups:
                group["lr"] = settings.table_lr * factor
        starts = torch.randint(0, max_start, (batch,), generator=generator, device=device)
        index = starts[:, None] + offsets[None, :]  # [B, S+1]
        window = train_tokens[index]
        inputs, targets = window[:, :-1], window[:, 1:]
        fns = {}
        if train_row_ids is not None:
            fns = engram_fns(model, rows_of, train_row_ids[index[:, :-1]])
        with _autocast(device):
            logits = model(inputs, engram=fns)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in dense.param_groups for p in g["params"]], 1.0)
        dense.step()
        if sparse is not None:
            sparse.step()
            sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        step += 1
        if validate is not None and step % settings.eval_every == 0:
            check_validation()
        if step == 1:
            budget_began = clock()
        if step == 5:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            probe_began = clock()
        if total is None and step == probe:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            per_step = (clock() - probe_began) / (probe - 5)
            remaining = budget_s - (clock() - budget_began) if budget_s else 0.0
            total = max(probe, probe + int(remaining / per_step))
            settings.say(f"{name}: {per_step * 1e3:.1f} ms/step -> {total} steps in the budget")
        now = clock()
        end = stop if stop is not None else total
        if now - last_log >= log_every or step == end:
            last_log = now
            recent = torch.stack(losses[-20:]).float().mean().item()
            settings.say(
                f"{name}: step {step}/{end or '?'} loss {recent:.4f} "
                f"({step * batch * seq / (now - began):,.0f} tok/s, {now - began:.0f} s)"
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = clock() - began
    values = torch.stack(losses).float().cpu().tolist() if losses else []
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
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device={name!r} but CUDA is not available; use --device cpu")
    return device


def train(settings: TrainSettings) -> dict[str, Any]:
    """Run every stage (see the module docstring); returns the training record."""
    from engramrt.checkpoint import (
        DEFAULT_SOURCE_NAMES,
        load_tables,
        plan_conversion,
        read_table,
        run_conversion,
    )
    from engramrt.tokenmap import TokenMap, load_tokenizer

    began = time.perf_counter()
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    device = _resolve_device(settings.device)
    torch.manual_seed(settings.seed)
    say = settings.say
    say(f"engramrt.models.train: out {out}, device {device}, torch {torch.__version__}")

    tokenizer = load_tokenizer()
    token_map = TokenMap.from_tokenizer_file(use_cache=False)
    cfg = engram_config(settings.dim)
    consts = HashConstants.from_config(cfg, token_map)
    corpus: Corpus = build_corpus(tokenizer, max_files=settings.max_files)
    say(
        f"corpus: python {corpus.python_version}, {len(corpus.train.files)} train files "
        f"({corpus.train.num_tokens:,} tokens), {len(corpus.heldout.files)} held-out files "
        f"({corpus.heldout.num_tokens:,} tokens), {len(corpus.validation.files)} validation "
        f"files ({corpus.validation.num_tokens:,} tokens), {corpus.seconds:.1f} s"
    )
    counts = np.bincount(corpus.train.tokens, minlength=token_map.vocab_size)
    vocab = Vocab.from_counts(counts, settings.vocab_k)
    covered = counts[list(vocab.token_ids)].sum() / max(1, counts.sum())
    say(f"vocab: K = {vocab.num_kept} kept ids + <other>, covering {covered:.2%} of train tokens")

    t0 = time.perf_counter()
    train_ids, train_report = corpus_row_ids(corpus.train, consts, token_map.map, device)
    heldout_ids, _ = corpus_row_ids(corpus.heldout, consts, token_map.map, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    say(f"row ids: {train_report}, {time.perf_counter() - t0:.1f} s")

    trim = torch.as_tensor(np.array(vocab.trim_map), device=device)
    train_tokens = trim[torch.as_tensor(corpus.train.tokens, device=device)]
    segments = eval_segments(
        corpus.heldout, settings.seq_len, settings.eval_sequences, cfg.max_ngram_size
    )
    sample_index = np.arange(
        0,
        segments.num_sequences,
        max(1, math.ceil(segments.num_sequences / settings.sample_sequences)),
    )[: settings.sample_sequences]
    sample = segments.subset(sample_index)
    eval_tokens = trim[torch.as_tensor(segments.tokens, device=device)]
    eval_lengths = torch.as_tensor(segments.lengths, device=device)
    eval_ids = segment_row_ids(segments, consts, torch.as_tensor(np.array(token_map.map)), device)
    # The sequences' own hashing (lookback ids) must give their in-document ids.
    valid = torch.arange(settings.seq_len, device=device)[None, :] < eval_lengths[:, None]
    in_doc = heldout_ids[
        (
            torch.as_tensor(segments.starts, device=device)[:, None]
            + torch.arange(settings.seq_len, device=device)[None, :]
        ).clamp(max=heldout_ids.shape[0] - 1)
    ]
    if not bool((eval_ids == in_doc)[valid].all()):
        raise AssertionError(
            "held-out sequences hashed with lookback ids differ from their documents"
        )
    say(
        f"held-out: {segments.num_sequences} sequences ({segments.num_predictions:,} predictions), "
        f"sample {sample.num_sequences} sequences ({int(sample.lengths.sum()):,} tokens)"
    )
    # Validation (its own files) chooses the step each model keeps; held-out stays unseen.
    val_segments = eval_segments(
        corpus.validation, settings.seq_len, settings.val_sequences, cfg.max_ngram_size
    )
    val_tokens = trim[torch.as_tensor(val_segments.tokens, device=device)]
    val_lengths = torch.as_tensor(val_segments.lengths, device=device)
    val_ids = segment_row_ids(
        val_segments, consts, torch.as_tensor(np.array(token_map.map)), device
    )
    say(
        f"validation: {val_segments.num_sequences} sequences "
        f"({val_segments.num_predictions:,} predictions), every {settings.eval_every} steps"
    )

    lm_cfg = lm_configs(settings, vocab.size, cfg)
    engram_model = TinyLM(lm_cfg).to(device)
    tables = [EngramTable(rows, cfg.head_dim, device=device) for rows in cfg.num_embeddings]
    budget = None if settings.steps is not None else settings.minutes * 60
    say(
        f"Engram model: {sum(p.numel() for p in engram_model.parameters()):,} backbone "
        f"parameters, tables {[tuple(t.weight.shape) for t in tables]}"
    )
    table_rows: RowsOf = lambda index, ids: tables[index](ids)  # noqa: E731
    engram_run = train_model(
        "engram",
        engram_model,
        tables,
        train_tokens,
        train_ids,
        settings,
        steps=settings.steps,
        budget_s=budget,
        validate=lambda: evaluate(engram_model, table_rows, val_tokens, val_lengths, val_ids),
        heldout=lambda: evaluate(engram_model, table_rows, eval_tokens, eval_lengths, eval_ids),
    )
    torch.manual_seed(settings.seed)
    baseline = TinyLM(lm_cfg.baseline()).to(device)
    say(f"baseline: {sum(p.numel() for p in baseline.parameters()):,} parameters")
    baseline_run = train_model(
        "baseline",
        baseline,
        [],
        train_tokens,
        None,
        settings,
        steps=engram_run.steps,
        budget_s=None,
        schedule_steps=engram_run.schedule_steps,
        validate=lambda: evaluate(baseline, None, val_tokens, val_lengths, None),
        heldout=lambda: evaluate(baseline, None, eval_tokens, eval_lengths, None),
    )
    del train_ids

    t0 = time.perf_counter()
    sample_rows = torch.as_tensor(sample_index, device=device)
    float_rows: RowsOf = lambda index, ids: tables[index](ids)  # noqa: E731
    losses = {
        "engram": evaluate(engram_model, float_rows, eval_tokens, eval_lengths, eval_ids),
        "baseline": evaluate(baseline, None, eval_tokens, eval_lengths, None),
    }
    sample_losses = {
        "engram": evaluate(
            engram_model,
            float_rows,
            eval_tokens[sample_rows],
            eval_lengths[sample_rows],
            eval_ids[sample_rows],
        ),
        "baseline": evaluate(
            baseline, None, eval_tokens[sample_rows], eval_lengths[sample_rows], None
        ),
    }
    say(f"held-out loss (float tables): {losses}, {time.perf_counter() - t0:.1f} s")

    # fp8: float tables -> source checkpoint (V4.1 names) -> the convert command's
    # conversion -> the normal loader -> evaluate again.
    t0 = time.perf_counter()
    work = out / "_work"
    work.mkdir(exist_ok=True)
    from safetensors.torch import save_file

    source = work / "engram-float.safetensors"
    save_file(
        {
            DEFAULT_SOURCE_NAMES[0].format(layer=layer): table.weight.detach().cpu().contiguous()
            for layer, table in zip(cfg.layer_ids, tables, strict=True)
        },
        str(source),
    )
    plan = plan_conversion(source, out / artifacts.ENGRAM_TABLES, cfg, token_map=token_map)
    run_conversion(plan, device=device)
    # Kernels on CUDA; on a CPU the references (the same bytes and rows, without
    # Triton's interpreter when it is switched on).
    backend = "auto" if device.type == "cuda" else "reference"
    for index, table in enumerate(tables):
        converted = read_table(out / artifacts.ENGRAM_TABLES, cfg, index, token_map=token_map)
        if not torch.equal(converted, table.packed_rows(backend=backend).cpu()):
            raise AssertionError(
                f"converted table of layer {cfg.layer_ids[index]} differs from packed_rows()"
            )
    stores = load_tables(
        out / artifacts.ENGRAM_TABLES,
        cfg,
        tier="device",
        device=device,
        token_map=token_map,
        backend=backend,
    )
    fp8_rows: RowsOf = lambda index, ids: stores[index].lookup(ids).float()  # noqa: E731
    losses["engram_fp8"] = evaluate(engram_model, fp8_rows, eval_tokens, eval_lengths, eval_ids)
    sample_losses["engram_fp8"] = evaluate(
        engram_model,
        fp8_rows,
        eval_tokens[sample_rows],
        eval_lengths[sample_rows],
        eval_ids[sample_rows],
    )
    shutil.rmtree(work, ignore_errors=True)
    fp8_rel = (losses["engram_fp8"] - losses["engram"]) / losses["engram"]
    say(
        f"fp8 tables: held-out loss {losses['engram_fp8']:.5f} vs float {losses['engram']:.5f} "
        f"(relative {fp8_rel:+.4%}), {time.perf_counter() - t0:.1f} s"
    )

    artifacts.save_weights(out / artifacts.ENGRAM_WEIGHTS, engram_model)
    artifacts.save_weights(out / artifacts.BASELINE_WEIGHTS, baseline)
    artifacts.save_sample(out / artifacts.HELDOUT_SAMPLE, sample)
    record: dict[str, Any] = {
        "command": " ".join(sys.argv) if sys.argv else "",
        "device": str(device),
        "torch": torch.__version__,
        "corpus": corpus.record(),
        "row_ids": train_report,
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(settings).items()
            if k != "log"
        },
        "engram": _run_record(engram_run, settings),
        "baseline": _run_record(baseline_run, settings),
        "heldout": {
            "sequences": segments.num_sequences,
            "predictions": segments.num_predictions,
            "losses": losses,
            "fp8_vs_float_relative": fp8_rel,
            "weights": "each model at its step of lowest validation loss (early stopping)",
            "last_step_losses": {
                "engram": engram_run.last_heldout,
                "baseline": baseline_run.last_heldout,
            },
            "sample_sequences": sample.num_sequences,
            "sample_predictions": sample.num_predictions,
            "sample_losses": sample_losses,
        },
        "vocab_coverage_train": float(covered),
    }
    model_json = {
        "format": "engramrt-tiny-lm/1",
        "lm": lm_cfg.to_dict(),
        "baseline_lm": lm_cfg.baseline().to_dict(),
        "engram": cfg.to_hf_dict(),
        "vocab": vocab.to_dict(),
        "files": {
            "engram_tables": artifacts.ENGRAM_TABLES,
            "engram_weights": artifacts.ENGRAM_WEIGHTS,
            "baseline_weights": artifacts.BASELINE_WEIGHTS,
            "heldout_sample": artifacts.HELDOUT_SAMPLE,
        },
        "training": record,
    }
    artifacts.write_json(out / artifacts.MODEL_JSON, model_json)
    artifacts.write_json(out / artifacts.CONFIG_JSON, cfg.to_hf_dict())
    shipped = {name: (out / name).stat().st_size for name in artifacts.SHIPPED_FILES}
    total_bytes = sum(shipped.values())
    say(f"shipped files: {shipped}, total {total_bytes:,} bytes (budget {SIZE_BUDGET_BYTES:,})")
    if total_bytes > SIZE_BUDGET_BYTES or max(shipped.values()) > FILE_LIMIT_BYTES:
        say("WARNING: the shipped files exceed the size budget")
    record["shipped_bytes"] = shipped
    record["heldout"]["sample_losses"]["engram_fp8_served"] = _served_sample_loss(out, device, say)
    record["seconds_total"] = round(time.perf_counter() - began, 1)
    artifacts.write_json(out / artifacts.MODEL_JSON, model_json)
    _plot(
        out / artifacts.LOSS_CURVES,
        {"engram": engram_run.losses, "baseline": baseline_run.losses},
        {k: v for k, v in losses.items()},
        {"engram": engram_run.val_curve, "baseline": baseline_run.val_curve},
    )
    say(f"done in {record['seconds_total']} s: {out}")
    artifacts.write_json(
        out / artifacts.TRAIN_LOG,
        {
            "log": settings.log,
            "losses": {"engram": engram_run.losses, "baseline": baseline_run.losses},
            "record": record,
        },
    )
    return record


def _served_sample_loss(
    out: Path, device: torch.device, say: Callable[[str], None]
) -> float | None:
    """The sample's loss through the serving path (:func:`engramrt.models.serve.load_model`
    of the directory just written); None, and a printed reason, if that fails: the
    directory is complete either way."""
    try:
        from engramrt.models.serve import load_model

        began = time.perf_counter()
        backend = "auto" if device.type == "cuda" else "reference"
        model = load_model(
            out,
            tier="device",
            device=device,
            load_baseline=False,
            head_backend=backend,
            backend=backend,
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


def parse_args(argv: Sequence[str] | None = None) -> TrainSettings:
    parser = argparse.ArgumentParser(
        prog="python -m engramrt.models.train",
        description="Train the tiny Engram LM and its baseline; write the model directory.",
    )
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    defaults_minutes = TrainSettings(out=Path(".")).minutes
    parser.add_argument(
        "--minutes",
        type=float,
        default=defaults_minutes,
        help=f"wall-clock training budget of the Engram model (default {defaults_minutes})",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="train exactly this many steps instead of --minutes"
    )
    parser.add_argument(
        "--max-files", type=int, default=None, help="only the first N training files (tests)"
    )
    defaults = TrainSettings(out=Path("."))
    for name in (
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
        "seed",
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name)
        )
    for name in ("lr", "table_lr", "weight_decay"):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name)
        )
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1")
    if args.eval_every < 1:
        parser.error(f"--eval-every={args.eval_every} must be at least 1")
    if args.minutes <= 0:
        parser.error(f"--minutes={args.minutes} must be positive")
    return TrainSettings(**vars(args))


def main(argv: Sequence[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
