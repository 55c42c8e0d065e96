"""Where the host time of one eager hashing call goes (run on a GPU machine).

python bench/profile_launch.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from engramrt.bench.cases_hash import _setup


def main() -> None:
    device = torch.device("cuda")
    s = _setup(device, 256, 1, seed=1)
    hasher, batch, out = s["hasher"], s["batch"], s["out"]
    for _ in range(20):
        hasher(batch, out=out)
    torch.cuda.synchronize()
    for label, fn in [
        ("hasher call", lambda: hasher(batch, out=out)),
        ("empty python loop", lambda: None),
        ("current_stream", lambda: torch.cuda.current_stream(device).cuda_stream),
        ("13x data_ptr", lambda: [batch.input_ids.data_ptr() for _ in range(13)]),
    ]:
        n = 2000
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        print(f"{label}: {(time.perf_counter() - start) * 1e6 / n:.2f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        hasher(batch, out=out)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
