"""Soak the streaming invariant (SPEC §5): many random engine schedules, every history mode.

Each schedule (drawn from its seed by the engine simulator,
:mod:`engramrt.testing`: vLLM runner steps through the adapter) runs through every
history mode — lookback ids, the slot-keyed cache, request history — on the reference, and the first ``--kernel``
schedules also through the Triton kernel (CUDA when available, else the
CPU interpreter, which needs ``TRITON_INTERPRET=1`` before the kernel is
imported: :func:`main` sets it). ``--width`` schedules run at once, each
step of all of them hashed as the requests of one batch (one kernel launch),
and every schedule's every step is compared with hashing each full sequence
at once by numpy array ops (not by the kernel). The last line is
``N schedules, 0 mismatches``; otherwise the exit code is 1 and the first
mismatch's seed, mode, backend and step are printed, so
``scripts/soak 1 --seed SEED`` replays it alone.

Run as ``scripts/soak N [--seed S] [--kernel K] [--width W]`` or
``python -m engramrt.hashing.soak N``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Mismatch", "SoakResult", "main", "soak"]


@dataclass(frozen=True)
class Mismatch:
    """The first failing step of one schedule."""

    seed: int
    mode: str
    backend: str
    detail: str

    def __str__(self) -> str:
        return (
            f"seed {self.seed}, mode {self.mode}, backend {self.backend}: {self.detail} "
            f"(replay: scripts/soak 1 --seed {self.seed} --modes {self.mode}"
            f"{' --kernel 1' if self.backend == 'triton' else ''})"
        )


@dataclass(frozen=True)
class SoakResult:
    """``schedules`` run; ``mismatches`` lists every failing (schedule, mode, backend);
    ``backend_seconds`` the time spent replaying through each backend (the simulator,
    the hashing and the checks of its runs)."""

    schedules: int
    mismatches: tuple[Mismatch, ...]
    seconds: float
    backend_seconds: tuple[tuple[str, float], ...] = ()


def soak(
    count: int,
    *,
    seed: int = 0,
    kernel: int = 0,
    modes: Sequence[str] | None = None,
    max_steps: int = 12,
    device: str | None = None,
    config: str = "tiny",
    stop_at_first: bool = False,
    progress: int = 0,
    width: int = 64,
) -> SoakResult:
    """Run ``count`` schedules with seeds ``seed, seed + 1, ...``.

    Args:
        count: schedules to run (each through every mode in ``modes``).
        seed: the first schedule's seed.
        kernel: how many of the schedules (the first ones) also run through
            the Triton kernel.
        modes: history modes (default all of :data:`~engramrt.testing.MODES`).
        max_steps: batches per schedule after the first.
        device: where the kernel runs (default CUDA when available, else CPU).
        config: preset whose hash layout is used.
        stop_at_first: return after the group holding the first mismatch.
        progress: print ``k schedules, m mismatches`` every ``progress``
            schedules (0: never), so a run stopped early still says how far
            it got.
        width: schedules run at once, as the requests of one batch per step
            (:func:`~engramrt.testing.run_schedules`): one hasher
            call serves a step of ``width`` schedules. A schedule draws the
            same steps whatever ``width``, so ``scripts/soak 1 --seed S``
            (``count=1, seed=S``) replays schedule S alone.
    """

    from engramrt._device import resolve_device
    from engramrt.config import load_config
    from engramrt.errors import ValidationError
    from engramrt.hashing import HashConstants, NgramHasher
    from engramrt.testing import MODES, run_schedules
    from engramrt.tokenmap import TokenMap

    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValidationError(f"count={count!r}; expected a number of schedules >= 0")
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 0:
        raise ValidationError(f"kernel={kernel!r}; expected a number of schedules >= 0")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValidationError(f"width={width!r}; expected a number of schedules >= 1")
    chosen = tuple(MODES if modes is None else modes)
    for mode in chosen:
        if mode not in MODES:
            raise ValidationError(f"mode {mode!r}; expected one of {', '.join(MODES)}")
    kernel_device = resolve_device(device)
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_config(load_config(config), token_map)
    hashers = {
        (backend, where): NgramHasher(consts, token_map, where, backend=backend, check_ids=True)
        for backend, where in (("reference", "cpu"), ("triton", kernel_device))
        if backend == "reference" or kernel
    }
    start = time.perf_counter()
    found: list[Mismatch] = []
    spent: dict[str, float] = {}
    done = 0
    while done < count:
        # Groups do not straddle the last kernel schedule, so each runs one set of backends.
        size = min(width, count - done, kernel - done if done < kernel else count)
        seeds = list(range(seed + done, seed + done + size))
        runs = [("reference", "cpu")] + ([("triton", kernel_device)] if done < kernel else [])
        group: list[tuple[int, int, Mismatch]] = []
        for order, mode in enumerate(chosen):
            for backend, where in runs:
                began = time.perf_counter()
                engines = run_schedules(
                    seeds,
                    mode,
                    backend,
                    consts,
                    token_map,
                    max_steps=max_steps,
                    device=where,
                    hasher=hashers[(backend, where)],
                )
                spent[backend] = spent.get(backend, 0.0) + time.perf_counter() - began
                group += [
                    (schedule_seed, order, Mismatch(schedule_seed, mode, backend, e.mismatches[0]))
                    for schedule_seed, e in zip(seeds, engines, strict=True)
                    if e.mismatches
                ]
        found += [m for _, _, m in sorted(group, key=lambda g: g[:2])]
        before, done = done, done + size
        if found and stop_at_first:
            return SoakResult(done, tuple(found), time.perf_counter() - start, tuple(spent.items()))
        if progress and done // progress > before // progress:
            print(f"{done} schedules, {len(found)} mismatches so far", flush=True)
    return SoakResult(count, tuple(found), time.perf_counter() - start, tuple(spent.items()))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="soak",
        description="Run N random engine schedules through every history mode and compare "
        "each step's row ids with one-shot hashing.",
    )
    parser.add_argument("count", type=int, help="number of schedules (N)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first schedule")
    parser.add_argument(
        "--kernel",
        type=int,
        default=0,
        help="how many schedules (the first ones) also run through the Triton kernel",
    )
    parser.add_argument(
        "--modes", default="lookback,slot,request", help="comma-separated history modes"
    )
    parser.add_argument("--max-steps", type=int, default=12, help="batches per schedule")
    parser.add_argument("--device", default=None, help="kernel device (default: cuda if any)")
    parser.add_argument(
        "--progress", type=int, default=0, help="print a count every this many schedules"
    )
    parser.add_argument(
        "--width",
        type=int,
        default=64,
        help="schedules hashed at once, as the requests of one batch per step",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``scripts/soak`` entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.count < 0 or args.kernel < 0 or args.max_steps < 0:
        print(
            f"error: count={args.count}, --kernel={args.kernel}, --max-steps={args.max_steps}; "
            f"expected numbers >= 0",
            file=sys.stderr,
        )
        return 2
    if args.kernel:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    from engramrt.errors import EngramError

    try:
        result = soak(
            args.count,
            seed=args.seed,
            kernel=args.kernel,
            modes=[m for m in args.modes.split(",") if m],
            max_steps=args.max_steps,
            device=args.device,
            stop_at_first=True,
            progress=args.progress,
            width=args.width,
        )
    except EngramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.mismatches:
        print(f"first mismatch: {result.mismatches[0]}")
        print(f"{result.schedules} schedules, {len(result.mismatches)} mismatches")
        return 1
    split = ", ".join(f"{backend} {seconds:.1f} s" for backend, seconds in result.backend_seconds)
    print(f"ran in {result.seconds:.1f} s ({split})")
    print(f"{result.schedules} schedules, 0 mismatches")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
