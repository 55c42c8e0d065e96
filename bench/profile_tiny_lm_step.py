"""Where a training step of the tiny LM spends its time, and what the hyper-connections cost.

    python bench/profile_tiny_lm_step.py --out bench/results/tiny-lm-step-DATE.json  # needs a GPU

For the Engram model and the same-backbone baseline of ``python -m
engramrt_lab.models.train`` at its defaults (64 windows of 512 tokens, D = 256, 4
blocks, hc = 4, Engram at blocks 1 and 2 with the default buckets, bf16 autocast on
CUDA), one optimiser step exactly as the training command takes it
(:func:`engramrt_lab.models.train.train_step`: forward, loss, backward, clipping,
AdamW, the tables' sparse Adam), on random tokens and row ids, the
hyper-connections' weights moved off their start (a step's work does not depend on
the values). For each hyper-connection implementation:

- ``einsum``: :class:`~engramrt_lab.models.lm.HyperConnection` as it is
  (``torch.einsum`` over the streams; cuBLAS GEMMs with an inner or outer size of
  hc = 4 over B·S·D rows, forward and backward);
- ``broadcast``: the same sums as a broadcast product summed over the streams
  (reading) and a batched 4 × 4 matmul per token (mixing), computed here only;

``step_ms``: the median of ``--steps`` steps (CUDA events; wall clock on a CPU) and
the tokens per second it gives; ``kernels``: each kernel's time per step
(``torch.profiler``, ``--profile-steps`` steps), the largest first; ``agrees``: the
two implementations' losses on the same weights and batch and their relative
difference (fp32 sums of 4 terms in another order, under the same bf16 sub-layers:
the check that ``broadcast`` computes the same function, not a tolerance of the
product).

On a CPU (``--device cpu``, small ``--batch-size``/``--seq-len``) it runs the same
code for its tests; only a GPU's figures mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_ple_layer  # one profile of kernels for the bench scripts

IMPLEMENTATIONS = ("einsum", "broadcast")
AGREE_RELATIVE = 1e-3
"""The largest relative difference of the two implementations' losses accepted as
"the same function" (a reordered fp32 sum of 4 terms differs by ~1e-7 relative per
element; bf16 sub-layers after it can turn that into ~1e-4 of the loss)."""


def _read_broadcast(self: Any, streams: torch.Tensor) -> torch.Tensor:
    from engramrt_lab.models.lm import no_autocast

    with no_autocast(streams.device.type):
        return (streams.float() * self.read.float()[:, None]).sum(dim=-2)


def _update_broadcast(self: Any, streams: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    from engramrt_lab.models.lm import no_autocast

    with no_autocast(streams.device.type):
        mixed = torch.matmul(self.mix.float().t(), streams.float())  # [..., j, d]
        return mixed + self.write.float()[:, None] * output.float().unsqueeze(-2)


@contextmanager
def hyper_connections(implementation: str) -> Iterator[None]:
    """Every :class:`HyperConnection` computes with ``implementation`` inside."""
    from engramrt_lab.models.lm import HyperConnection

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; expected one of {IMPLEMENTATIONS}")
    saved = HyperConnection.read_input, HyperConnection.update
    if implementation == "broadcast":
        HyperConnection.read_input = _read_broadcast  # type: ignore[method-assign]
        HyperConnection.update = _update_broadcast  # type: ignore[method-assign]
    try:
        yield
    finally:
        HyperConnection.read_input, HyperConnection.update = saved  # type: ignore[method-assign]


def make_step(model_name: str, device: torch.device, batch: int, seq: int) -> dict[str, Any]:
    """The model, its optimisers, random data and ``step()`` (one optimiser step, the
    loss returned on the device) of ``model_name`` (``engram`` or ``baseline``)."""
    from engramrt_lab.models import train
    from engramrt_lab.models.lm import HyperConnection, TinyLM
    from engramrt_lab.training import EngramTable

    settings = train.TrainSettings(out=Path("."), batch_size=batch, seq_len=seq)
    vocab = settings.vocab_k + 1
    cfg = train.engram_config(settings.dim)
    lm_cfg = train.lm_configs(settings, vocab, cfg)
    if model_name == "baseline":
        lm_cfg = lm_cfg.baseline()
    elif model_name != "engram":
        raise ValueError(f"model_name={model_name!r}; expected 'engram' or 'baseline'")
    torch.manual_seed(0)
    model = TinyLM(lm_cfg).to(device)
    with torch.no_grad():  # off their start (one-hot reads, identity mixes), so that the
        for module in model.modules():  # agreement check sums terms that are not zero
            if isinstance(module, HyperConnection):
                for weight in (module.read, module.mix, module.write):
                    weight.add_(0.2 * torch.randn(weight.shape, device=device))
    tables = (
        [EngramTable(rows, cfg.head_dim, device=device) for rows in cfg.num_embeddings]
        if model_name == "engram"
        else []
    )
    optimizers = train.make_optimizers(model, tables, settings)
    generator = torch.Generator().manual_seed(1)
    stream = batch * (seq + 1)
    tokens = torch.randint(0, vocab, (stream,), generator=generator).to(device)
    row_ids = None
    if tables:
        cols = cfg.n_heads * (cfg.max_ngram_size - 1)
        row_ids = torch.stack(
            [
                torch.randint(0, table.weight.shape[0], (stream, cols), generator=generator)
                for table in tables
            ],
            dim=1,
        ).to(device)  # [N, L, C]
    index = torch.arange(stream, device=device).view(batch, seq + 1)
    rows_of = lambda i, ids: tables[i](ids)  # noqa: E731

    def step() -> torch.Tensor:
        return train.train_step(
            model,
            rows_of,
            optimizers,
            tokens,
            row_ids,
            index,
            lr_factor=1.0,
            settings=settings,
        )

    def loss() -> float:
        """The loss of the batch, no step taken."""
        fns = {} if row_ids is None else train.engram_fns(model, rows_of, row_ids[index[:, :-1]])
        with torch.no_grad(), train.autocast_for(device):
            logits = model(tokens[index[:, :-1]], engram=fns)
        return float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tokens[index[:, 1:]].reshape(-1)
            )
        )

    return {"step": step, "loss": loss, "model": model}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times_ms(step: Callable[[], Any], device: torch.device, steps: int) -> list[float]:
    """Each of ``steps`` steps' time in ms, after 3 warm-up steps."""
    for _ in range(3):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return times


def kernel_times(step: Callable[[], Any], device: torch.device, steps: int) -> list[dict[str, Any]]:
    """Each kernel's (on a CPU: each operator's) time per step, the largest first
    (``bench/profile_ple_layer.py``'s profile, counted per step)."""
    rows = profile_ple_layer.kernel_times(step, steps, device=device, warmup=1)
    return [
        {"kernel": r["kernel"], "calls_per_step": r["count"] / steps, "us": r["us"]} for r in rows
    ]


def run(
    device: torch.device, batch: int, seq: int, steps: int, profile_steps: int, top: int
) -> dict[str, Any]:
    record: dict[str, Any] = {"batch_size": batch, "seq_len": seq, "models": {}}
    for model_name in ("engram", "baseline"):
        case: dict[str, Any] = {}
        made = make_step(model_name, device, batch, seq)
        losses = {}
        for implementation in IMPLEMENTATIONS:
            with hyper_connections(implementation):
                losses[implementation] = made["loss"]()
        rel = abs(losses["broadcast"] - losses["einsum"]) / abs(losses["einsum"])
        case["agrees"] = {**losses, "relative": rel, "bound": AGREE_RELATIVE}
        for implementation in IMPLEMENTATIONS:
            with hyper_connections(implementation):
                times = step_times_ms(made["step"], device, steps)
                kernels = kernel_times(made["step"], device, profile_steps)
            median = statistics.median(times)
            case[implementation] = {
                "step_ms": median,
                "step_ms_quartiles": statistics.quantiles(times, n=4) if len(times) > 1 else [],
                "tokens_per_s": batch * seq / (median / 1e3),
                "kernels": kernels[:top],
                "kernel_us_total": sum(k["us"] for k in kernels),
            }
        record["models"][model_name] = case
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (tests)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case")
    parser.add_argument("--profile-steps", type=int, default=5, help="profiled steps per case")
    parser.add_argument("--top", type=int, default=25, help="kernels kept per case")
    args = parser.parse_args(argv)
    for name in ("batch_size", "seq_len", "steps", "profile_steps", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}; expected >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "profile_tiny_lm_step: --device cuda needs a CUDA device (none here)", file=sys.stderr
        )
        return 2
    from engramrt.bench.runner import environment

    report = {
        "environment": environment(device),
        **run(device, args.batch_size, args.seq_len, args.steps, args.profile_steps, args.top),
    }
    for model_name, case in report["models"].items():
        agrees = case["agrees"]
        print(
            f"{model_name}: einsum {case['einsum']['step_ms']:.2f} ms/step "
            f"({case['einsum']['tokens_per_s']:,.0f} tok/s), broadcast "
            f"{case['broadcast']['step_ms']:.2f} ms/step; losses agree to "
            f"{agrees['relative']:.1e} (bound {agrees['bound']:.0e})"
        )
        for row in case["einsum"]["kernels"][:8]:
            print(f"  {row['us']:10.1f} us  x{row['calls_per_step']:<5g} {row['kernel'][:90]}")
    if args.out is not None:
        from engramrt._io import atomic_write_bytes

        atomic_write_bytes(args.out, (json.dumps(report, indent=1) + "\n").encode())
    disagree = [m for m, c in report["models"].items() if c["agrees"]["relative"] > AGREE_RELATIVE]
    if disagree:
        print(f"profile_tiny_lm_step: the implementations disagree on {disagree}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
