"""Sequence parallelism: tp = 2, 3, 4 gloo processes against the single-process reference.

One world of 4 spawned CPU processes over gloo (tests/layer/sp_worker.py)
runs every tp as a sub-group, so the processes start once; on a machine with
several GPUs the same workers run over NCCL, one GPU each. Each rank looks up all T
tokens from its column shard, the collective rebuilds its token share, and
it runs wkv and the gate on that share. Here, in the test process:

- rows: bit for bit equal to the unsharded lookup reference of the rank's
  tokens, zeros for padding tokens (both collectives move bit patterns, so
  even -0.0 survives);
- kv and out: within the derived tolerances of the single-process
  reference applied to those rows (``assert_layer_within_tolerance``);
- padding tokens: hidden passes through bit for bit.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.helpers import assert_same_bits
from tests.layer import sp_worker
from tests.layer.common import (
    CONFIG,
    exact_wkv,
    full_store,
    layer_table,
    layout,
    random_hidden,
    random_row_ids,
    random_weights,
    shard_store,
)
from tests.spawn import spawn_world

from engramrt.errors import ShardingError, ValidationError
from engramrt.exchange import (
    SEQUENCE_PARALLEL_COLLECTIVES as COLLECTIVES,
)
from engramrt.exchange import (
    SequenceParallelExchange,
    shard_tokens,
    token_range,
    tokens_per_rank,
)
from engramrt.layer import EngramLayer, assert_layer_within_tolerance
from engramrt.layout import cols_per_rank, owned_columns
from engramrt.lookup import lookup_rows_reference

WORLD = max(sp_worker.TPS)
CPU = torch.device("cpu")  # gloo moves CPU tensors; NCCL would run the same code on GPUs
NEGATIVE_ZERO_BITS = -(2**15)  # bf16 -0.0 (0x8000) as int16
DEADLINE_S = 120.0
NCCL_WORLD = (
    min(WORLD, torch.cuda.device_count()) if torch.cuda.is_available() else 0
)  # whole world, start-up included (it takes ~10 s on 2 cores)


# --- token and column arithmetic -----------------------------------------------


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(0, 300), tp=st.integers(1, 8))
def test_token_shares_cover_every_token_once(num_tokens: int, tp: int) -> None:
    part = tokens_per_rank(num_tokens, tp)
    assert part == -(-num_tokens // tp)
    ranges = [token_range(num_tokens, tp, rank) for rank in range(tp)]
    covered = [t for begin, end in ranges for t in range(begin, end)]
    assert covered == list(range(num_tokens))
    # rank r's share is chunk r of the padded [tp * part] layout the collective splits
    assert all(begin == min(rank * part, num_tokens) for rank, (begin, _) in enumerate(ranges))
    assert all(end - begin <= part for begin, end in ranges)
    x = torch.arange(1, num_tokens + 1).view(num_tokens, 1).float()
    shares = [shard_tokens(x, tp, rank) for rank in range(tp)]
    assert all(share.shape == (part, 1) for share in shares)
    assert torch.equal(torch.cat(shares)[:num_tokens], x)
    assert not bool(torch.cat(shares)[num_tokens:].any())  # padding is zero


def test_negative_control_floor_split_drops_tokens() -> None:
    """The coverage invariant above fails for a floor split (T // tp per rank)."""
    part = 7 // 2
    covered = [t for rank in range(2) for t in range(rank * part, min((rank + 1) * part, 7))]
    assert covered != list(range(7))


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6])
def test_owned_columns_match_the_layout(tp: int) -> None:
    for rank in range(tp):
        begin, end = owned_columns(CONFIG.n_cols, tp, rank)
        shard = layout().column_shard(0, tp, rank)
        assert (begin, end) == (shard.col_begin, shard.col_end)
        assert cols_per_rank(CONFIG.n_cols, tp) == layout().cols_per_rank(tp)
        # SPEC §7 written out independently: rank r owns [r*ceil(C/tp), min((r+1)*ceil(C/tp), C))
        part = -(-CONFIG.n_cols // tp)
        assert (begin, end) == (rank * part, min((rank + 1) * part, CONFIG.n_cols))


def test_owned_columns_refuse_a_rank_without_columns() -> None:
    with pytest.raises(ShardingError, match=r"tp=5 leaves rank\(s\) \[4\] without a hash column"):
        owned_columns(12, 5, 0)


def sp_layer(store, group, *, max_tokens: int, collective: str = "reduce_scatter") -> EngramLayer:
    exchange = SequenceParallelExchange(
        store, num_cols=CONFIG.n_cols, max_tokens=max_tokens, group=group, collective=collective
    )
    return EngramLayer(CONFIG, exchange, max_tokens=max_tokens)


# --- in this process: a world of one ---------------------------------------------


def test_group_needs_initialised_distributed(tmp_path: Path) -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ShardingError, match="not initialised"):
        sp_layer(full_store(layer_table(), CPU), object(), max_tokens=4)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_tp1_group_equals_the_plain_layer(world_of_one, collective: str) -> None:
    table = layer_table()
    weights = random_weights(4, fp8=False)
    plain = EngramLayer(CONFIG, full_store(table, CPU), max_tokens=8)
    grouped = sp_layer(full_store(table, CPU), world_of_one, max_tokens=8, collective=collective)
    for layer in (plain, grouped):
        layer.load_weights(**weights)
    row_ids = random_row_ids(5, seed=1)
    hidden = random_hidden(5, seed=2)
    assert_same_bits(grouped(hidden, row_ids), plain(hidden, row_ids), label="tp=1 out")


def test_group_refuses_a_store_of_other_columns(world_of_one) -> None:
    with pytest.raises(ShardingError, match=r"serves hash columns \[0, 6\).*owns \[0, 12\)"):
        sp_layer(shard_store(layer_table(), tp=2, rank=0, device=CPU), world_of_one, max_tokens=4)
    with pytest.raises(ValidationError, match="collective='all_gather'"):
        sp_layer(
            full_store(layer_table(), CPU), world_of_one, max_tokens=4, collective="all_gather"
        )


# --- tp = 2, 3, 4 processes -----------------------------------------------------


def run_world(out_dir: Path, world: int, backend: str) -> Path:
    """Spawn ``world`` worker processes, wait (bounded), fail with their tracebacks."""
    spawn_world(sp_worker.run, world, out_dir, backend, deadline_s=DEADLINE_S, label=backend)
    return out_dir


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-process gloo world, run once; the folder of saved results."""
    return run_world(tmp_path_factory.mktemp("gloo"), WORLD, "gloo")


@pytest.fixture(scope="module")
def nccl_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process per GPU (up to 4) over NCCL: the same code on GPUs."""
    return run_world(tmp_path_factory.mktemp("nccl"), NCCL_WORLD, "nccl")


def check_results(out_dir: Path, tp: int, collective: str, num_tokens: int) -> None:
    seed = sp_worker.scenario_seed(tp, num_tokens)
    table = layer_table()
    weights = random_weights(seed, fp8=tp == 3)
    row_ids = random_row_ids(num_tokens, seed)
    rows_all = lookup_rows_reference(row_ids, table, CONFIG.head_dim)  # single process, [T, C, E]
    part = tokens_per_rank(num_tokens, tp)
    hidden_all = random_hidden(tp * part, seed)
    for rank in range(tp):
        saved = torch.load(sp_worker.result_path(out_dir, tp, collective, num_tokens, rank))
        begin, end = token_range(num_tokens, tp, rank)
        label = f"tp={tp} {collective} T={num_tokens} rank {rank}"
        hidden = hidden_all[rank * part : (rank + 1) * part]
        assert_same_bits(saved["hidden"], hidden, label=f"{label} hidden")
        expected_rows = shard_tokens(rows_all, tp, rank)  # zeros for padding tokens
        assert_same_bits(saved["rows"], expected_rows, label=f"{label} rows")
        assert_layer_within_tolerance(
            hidden=hidden,
            rows=expected_rows,
            kv=saved["kv"],
            out=saved["out"],
            wkv_exact=exact_wkv(weights),
            q_weight=saved["q_weight"],
            k_weight=saved["k_weight"],
            eps=CONFIG.rms_norm_eps,
            weight_rounding=saved["weight_rounding"],
            truncating_store=saved["truncating_store"],
            label=label,
        )
        padding = slice(end - begin, part)
        assert_same_bits(saved["out"][padding], hidden[padding], label=f"{label} padding out")
    if num_tokens == 7:  # the bit-for-bit check sees negative zeros (a bf16 sum would lose them)
        assert bool((rows_all.view(torch.int16) == NEGATIVE_ZERO_BITS).any())


@pytest.mark.parametrize("num_tokens", sp_worker.TOKEN_COUNTS)
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("tp", sp_worker.TPS)
def test_gloo_sequence_parallel_matches_single_process(
    gloo_results: Path, tp: int, collective: str, num_tokens: int
) -> None:
    check_results(gloo_results, tp, collective, num_tokens)


@pytest.mark.skipif(NCCL_WORLD < 2, reason="NCCL sequence parallelism needs >= 2 GPUs")
@pytest.mark.parametrize("num_tokens", sp_worker.TOKEN_COUNTS)
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("tp", sp_worker.TPS)
def test_nccl_sequence_parallel_matches_single_process(
    nccl_results: Path, tp: int, collective: str, num_tokens: int
) -> None:
    if tp > NCCL_WORLD:
        pytest.skip(f"tp={tp} needs {tp} GPUs; {NCCL_WORLD} visible")
    check_results(nccl_results, tp, collective, num_tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU (none here)")
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_nccl_world_of_one_graph_capture(tmp_path: Path, collective: str) -> None:
    """The NCCL path on one GPU: equal to the plain layer eagerly, and prepare (with
    its collective, on a side stream) + forward captured in a CUDA graph replay
    equal to eager steps."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp_path / 'init'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )
    try:
        cuda = torch.device("cuda", torch.cuda.current_device())
        table = layer_table()
        weights = random_weights(5, fp8=True)
        plain = EngramLayer(CONFIG, full_store(table, cuda), max_tokens=16)
        grouped = sp_layer(
            full_store(table, cuda), dist.group.WORLD, max_tokens=16, collective=collective
        )
        for layer in (plain, grouped):
            layer.load_weights(**weights)
        row_ids = random_row_ids(11, seed=1).to(cuda)
        hidden = random_hidden(11, seed=2).to(cuda)
        assert_same_bits(grouped(hidden, row_ids), plain(hidden, row_ids), label="tp=1 out")

        side = torch.cuda.Stream()

        def step() -> torch.Tensor:
            grouped.prepare(row_ids, stream=side)
            return grouped(hidden)

        step()  # eager first: the communicator and the kernels exist before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for seed in (3, 4):
            row_ids.copy_(random_row_ids(11, seed=seed).to(cuda))
            hidden.copy_(random_hidden(11, seed=seed + 10).to(cuda))
            graph.replay()
            torch.cuda.synchronize()
            assert_same_bits(captured, plain(hidden, row_ids), label="graph replay")
    finally:
        dist.destroy_process_group()


def test_negative_control_bf16_sum_loses_negative_zero() -> None:
    """Why the exchange sums bit patterns: adding the other ranks' +0.0 in bf16 turns
    a row's -0.0 into +0.0, which the bit-for-bit rows check above would report."""
    rows = lookup_rows_reference(random_row_ids(7, seed=1), layer_table(), CONFIG.head_dim)
    with pytest.raises(AssertionError, match="values differ"):
        assert_same_bits(rows + torch.zeros_like(rows), rows)
    as_words = rows.view(torch.int32)
    assert_same_bits((as_words + torch.zeros_like(as_words)).view(torch.bfloat16), rows)
