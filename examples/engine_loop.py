"""An engine step loop around EngramRuntime: scheduler output -> adapter -> plan -> run.

    python examples/engine_loop.py [--device cpu|cuda] [--steps 30] [--seed 0]

The engine here is engramrt's simulator (:mod:`engramrt.testing`): a
scheduler over paged KV blocks (chunked prefill, decode, speculative drafts,
prefix-cache hits, preemption) and a vLLM-v1 model runner's persistent,
CUDA-graph-padded buffers. What an engine writes is the loop in
:func:`main`: each step, the runner's metadata goes through
:func:`~engramrt.adapters.from_vllm_step` into ``runtime.plan`` (host side:
hash, start every layer's lookup), then the model's blocks run, calling
``runtime.run(layer, hidden)`` at each Engram layer; right after sampling
the next step is planned (``runtime.prefetch``). On CUDA the blocks between
Engram layers replay as CUDA graphs captured once per padded token count
(piecewise, around eager ``run`` calls reading and writing fixed buffers);
on a CPU they run eagerly. Every step's row ids are checked against one-shot
hashing of each request and every layer's rows against the reference lookup
of a copy of the table; any mismatch makes the exit code 1.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from engramrt.adapters import from_vllm_step, vllm_slot_cache
from engramrt.config import PRESETS
from engramrt.hashing import HashConstants, NgramHasher
from engramrt.lookup import lookup_rows_reference
from engramrt.testing import CAPTURE_SIZES, RandomSchedule, Scheduler, VllmView, one_shot_rows
from engramrt.testing.model import synthetic_runtime
from engramrt.tokenmap import TokenMap

BLOCK, NUM_BLOCKS, MAX_TOKENS, MAX_REQUESTS = 16, 64, max(CAPTURE_SIZES), 8


def backbone(cfg, device):
    """A toy model: an embedding and three pieces of blocks around the two Engram layers."""
    gen = torch.Generator().manual_seed(1)
    width = cfg.hc_mult * cfg.hidden_size
    embed = (torch.randn(2**17, width, generator=gen) / 4).bfloat16().to(device)
    weights = [(torch.randn(width, width, generator=gen) / width**0.5).bfloat16().to(device)]
    weights += [weights[0].T.contiguous(), weights[0]]

    def piece(k: int, x: torch.Tensor) -> torch.Tensor:  # [T, hc, D] -> [T, hc, D]
        flat = x.reshape(x.shape[0], width)
        return (flat + torch.tanh(flat @ weights[k])).view_as(x)

    return embed, piece


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg, token_map = PRESETS["tiny"], TokenMap.from_tokenizer_file()
    consts = HashConstants.from_config(cfg, token_map)
    rng = np.random.default_rng(args.seed)

    # Engine start-up: the scheduler, the runner's buffers, the KV cache's hash history.
    scheduler = Scheduler(
        block_size=BLOCK, num_blocks=NUM_BLOCKS, max_requests=MAX_REQUESTS, max_len=40, rng=rng
    )
    policy = RandomSchedule(scheduler, rng, token_map.vocab_size, handoff=False, always_pad=True)
    runner = VllmView(
        rng,
        token_map.vocab_size,
        max_tokens=MAX_TOKENS,
        max_requests=MAX_REQUESTS,
        max_blocks=NUM_BLOCKS,
        num_slots=NUM_BLOCKS * BLOCK,
        block_size=BLOCK,
    )
    cache = vllm_slot_cache(NUM_BLOCKS, BLOCK, device)
    hasher = NgramHasher(consts, token_map, device)
    runtime = synthetic_runtime(
        cfg, hasher, cache, max_tokens=MAX_TOKENS, max_requests=MAX_REQUESTS
    )
    tables = [
        s.gather_packed(torch.arange(s.num_rows, device=device)).cpu() for s in runtime.sources
    ]
    embed, piece = backbone(cfg, device)
    shape = (cfg.hc_mult, cfg.hidden_size)

    # The blocks between Engram layers read and write fixed buffers: the embedding's
    # input ids, then each Engram layer's output buffer; on CUDA each piece is
    # captured once per padded token count and replayed.
    token_ids = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
    sources = [
        lambda t: embed[token_ids[:t]].view(t, *shape),
        lambda t: runtime.output_buffer(0)[:t],
        lambda t: runtime.output_buffer(1)[:t],
    ]
    graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def run_piece(k: int, t: int) -> torch.Tensor:
        if device.type != "cuda":
            return piece(k, sources[k](t))
        if (k, t) not in graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                piece(k, sources[k](t))  # warm-up before capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = piece(k, sources[k](t))
            graphs[(k, t)] = (graph, out)
        graph, out = graphs[(k, t)]
        graph.replay()
        return out

    checked = mismatches = 0
    step = policy.next_step()
    batch = from_vllm_step(**runner.express([step], None, device), cache=cache)
    plan = runtime.plan(batch)
    for index in range(args.steps):
        # The model: blocks, Engram layer 0, blocks, Engram layer 1, blocks.
        t = plan.num_tokens
        token_ids[:t].copy_(batch.input_ids)
        hidden = run_piece(0, t)
        hidden = runtime.run(0, hidden)
        hidden = run_piece(1, t)
        hidden = runtime.run(1, hidden)
        run_piece(2, t)  # the last blocks, then logits

        mismatches += check(step, plan, tables, token_map, consts, cfg.head_dim)
        checked += 1
        policy.advance(step)  # "sampling": drafts verified, positions advance
        if index + 1 < args.steps:  # right after sampling, plan the next step
            step = policy.next_step()
            batch = from_vllm_step(**runner.express([step], None, device), cache=cache)
            plan = runtime.prefetch(batch)
    runtime.close()
    mode = "CUDA graphs between Engram layers" if device.type == "cuda" else "eager"
    print(f"{checked} steps ({mode}) checked: row ids and rows, {mismatches} mismatches")
    return 1 if mismatches else 0


def check(step, plan, tables, token_map, consts, head_dim: int) -> int:
    """1 if the step's row ids differ from one-shot hashing of each request (padding rows:
    a lone token) or a layer's rows from the reference lookup of the table's copy."""
    sequences = []
    for c in step.chunks:
        ids = token_map.map[np.asarray(c.request.tokens[: c.end])]
        sequences.append((ids, np.asarray(c.request.dead[: c.end]), c.start, c.end))
    for token in step.pad_tokens:
        sequences.append((token_map.map[[token]], np.zeros(1, dtype=bool), 0, 1))
    want = one_shot_rows(sequences, consts)
    if not np.array_equal(plan.row_ids.to(torch.int64).cpu().numpy(), want):
        return 1
    for layer, table in enumerate(tables):
        rows = lookup_rows_reference(torch.from_numpy(want[:, layer]), table, head_dim)
        if not torch.equal(plan.rows(layer).cpu().view(torch.int16), rows.view(torch.int16)):
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
