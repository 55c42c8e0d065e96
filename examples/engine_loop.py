"""A simulated serving engine driving EngramRuntime, the way a model runner would.

    python examples/engine_loop.py [--device cpu|cuda] [--requests 6] [--steps 40]

Continuous batching with chunked prefill: each step the scheduler gives every
running request either a prefill chunk or one decode token; the model runner
builds the flattened batch (input_ids, positions, query_start_loc,
slot_mapping, block_table), calls ``runtime.step`` before the backbone, calls
each of the model's Engram layers (``runtime.layers[i]``, built from the
model's heads) with the hidden states alone at its block, and right after
sampling calls ``runtime.prefetch`` for the next step. The history lives in a
SlotHashCache keyed by KV slots, as in an engine whose token history lacks
generated tokens. Every step's row ids are checked against one-shot hashing.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from engramrt.config import PRESETS
from engramrt.hashing import HashBatch, HashConstants, NgramHasher, SlotHashCache, hash_sequence
from engramrt.layer import EngramHead
from engramrt.layout import EngramLayout
from engramrt.runtime import EngramRuntime, synthetic_stores
from engramrt.tokenmap import TokenMap

BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=24, help="prefill chunk size")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg = PRESETS["tiny"]
    layout = EngramLayout(cfg)
    token_map = TokenMap.from_tokenizer_file()
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    rng = np.random.default_rng(0)

    # Engine start-up: KV cache of 64 blocks; the hash cache is bound to it.
    num_blocks = 64
    cache = SlotHashCache(num_blocks * BLOCK, BLOCK, device)
    hasher = NgramHasher(consts, token_map, device, check_ids=True)  # every batch checked
    # The model's Engram heads (wkv + gate); a real engine loads them from its checkpoint.
    gen = torch.Generator().manual_seed(0)
    heads = []
    for _ in range(cfg.n_layers):
        head = EngramHead(cfg, device=device)
        hc, dim, width = cfg.hc_mult, cfg.hidden_size, cfg.n_cols * cfg.head_dim
        head.load_weights(
            wkv=(torch.randn((hc + 1) * dim, width, generator=gen) / width**0.5).bfloat16(),
            q_weight=torch.ones(hc, dim, dtype=torch.bfloat16),
            k_weight=torch.ones(hc, dim, dtype=torch.bfloat16),
        )
        heads.append(head)
    runtime = EngramRuntime(
        hasher,
        synthetic_stores(layout, "device", device=device),
        heads=heads,
        max_tokens=256,
        max_requests=args.requests,
        history=cache,
    )
    free_blocks = list(range(num_blocks))
    requests = []
    for _ in range(args.requests):
        prompt = rng.integers(0, token_map.vocab_size, int(rng.integers(10, 60))).tolist()
        requests.append({"tokens": prompt, "prompt_len": len(prompt), "done": 0, "blocks": []})

    def schedule() -> list[tuple[dict, int]]:
        plan = []
        for req in requests:
            if len(req["tokens"]) >= req["prompt_len"] + 8 and req["done"] == len(req["tokens"]):
                continue  # finished: 8 generated tokens
            todo = len(req["tokens"]) - req["done"]
            count = min(args.chunk, todo) if todo > 0 else 0
            if count:
                plan.append((req, count))
        return plan

    def build(plan: list[tuple[dict, int]]) -> HashBatch:
        ids, pos, qsl, slots, tables = [], [], [0], [], []
        for req, count in plan:
            start = req["done"]
            while len(req["blocks"]) * BLOCK < start + count:
                req["blocks"].append(free_blocks.pop())
            ids += req["tokens"][start : start + count]
            pos += list(range(start, start + count))
            qsl.append(qsl[-1] + count)
            slots += [
                req["blocks"][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + count)
            ]
            tables.append(req["blocks"])
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        return HashBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(pos),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            slot_mapping=torch.tensor(slots),
            block_table=table,
        ).to(device)

    checked = mismatches = 0
    plan = schedule()
    handle = runtime.plan(build(plan)) if plan else None
    for _ in range(args.steps):
        if handle is None:
            break
        # The backbone: its blocks would run between the Engram layers, each of
        # which is called with the hidden states alone and waits for its own rows.
        hidden = torch.randn(
            handle.num_tokens, cfg.hc_mult, cfg.hidden_size, generator=gen
        ).bfloat16()
        hidden = hidden.to(device)
        for layer in runtime.layers:
            hidden = layer(hidden).clone()  # the output buffer is reused next step
        assert hidden.shape == (handle.num_tokens, cfg.hc_mult, cfg.hidden_size)
        offset = 0
        for req, count in plan:
            start = req["done"]
            want = hash_sequence(token_map.compress(req["tokens"][: start + count]), consts)[start:]
            got = handle.row_ids[offset : offset + count].to(torch.int64).cpu().numpy()
            mismatches += int(not np.array_equal(got, want))
            checked += 1
            offset += count
            req["done"] += count
            if req["done"] == len(req["tokens"]) and len(req["tokens"]) < req["prompt_len"] + 8:
                req["tokens"].append(int(rng.integers(0, token_map.vocab_size)))  # "sampled"
        plan = schedule()
        handle = runtime.prefetch(build(plan)) if plan else None  # right after sampling
    runtime.close()
    print(f"{checked} request-steps checked against one-shot hashing, {mismatches} mismatches")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
