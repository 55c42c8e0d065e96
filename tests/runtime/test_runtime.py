"""The runtime's rows equal hashing + the reference lookup, step after step."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from engramrt.config import PRESETS
from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch, HashConstants, NgramHasher, SlotHashCache, hash_sequence
from engramrt.layout import EngramLayout
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import HostOptions, TablePlacement
from engramrt.lookup.tiers.host_gather import ROWS_PER_WAITED_GATHER_THREAD
from engramrt.runtime import EngramRuntime, synthetic_stores
from engramrt.runtime.runtime import lookup_worker, worker_jobs

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def layout() -> EngramLayout:
    return EngramLayout(CFG)


def _runtime(layout, token_map, device, tier="device", tp=1, rank=0, history=None, **kw):
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    # The hasher's checks are its own settings (graph capture: no synchronising ones).
    hasher = NgramHasher(consts, token_map, device, validate=kw.get("validate", True))
    stores = synthetic_stores(layout, TablePlacement(tier, device, tp, rank), seed=3)
    return EngramRuntime(
        hasher, stores, history=history, **{"max_tokens": 64, "max_requests": 8, **kw}
    )


@pytest.mark.parametrize("tier", ["device", "host"])
def test_step_rows_equal_reference_lookups(tier, layout, token_map, device, tmp_path) -> None:
    runtime = _runtime(layout, token_map, device, tier=tier)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, token_map.vocab_size, 40)
    batch = HashBatch.single(ids[10:], start=10, device=device)
    batch.lookback_token_ids = torch.from_numpy(ids[9:6:-1].copy()).view(1, 3).to(device)
    handle = runtime.plan(batch)
    want_ids = hash_sequence(
        token_map.compress(ids), HashConstants.from_layout(layout, token_map.pad_id(CFG))
    )[10:]
    np.testing.assert_array_equal(handle.row_ids.cpu().numpy(), want_ids)
    for li, store in enumerate(runtime.sources):
        packed = _packed(store)
        want = lookup_rows_reference(
            torch.from_numpy(want_ids[:, li]), packed, CFG.head_dim, row_begin=store.row_begin
        )
        got = handle.rows(li).cpu()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"layer {li}"
    runtime.close()


def _packed(store) -> torch.Tensor:
    """The packed rows a store holds, read back through its own memory."""
    for name in ("source", "table", "_table", "packed"):
        rows = getattr(store, name, None)
        if isinstance(rows, torch.Tensor):
            return rows.cpu()
    raise AssertionError(f"cannot read the rows of {store!r}")


def _check_step_rows(runtime, step) -> None:
    """Every layer's rows of ``step`` equal the reference lookup of its row ids, bit for bit."""
    for li, store in enumerate(runtime.sources):
        want = lookup_rows_reference(
            step.row_ids[:, li].cpu(), _packed(store), CFG.head_dim, row_begin=store.row_begin
        )
        assert torch.equal(step.rows(li).cpu().view(torch.int16), want.view(torch.int16))


def test_streaming_through_runtime_matches_one_shot(layout, token_map, device) -> None:
    cache = SlotHashCache(32 * 4, 4, device)
    runtime = _runtime(layout, token_map, device, history=cache)
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    ids = np.random.default_rng(2).integers(0, token_map.vocab_size, 30)
    want = hash_sequence(token_map.compress(ids), consts)
    start = 0
    handles = []
    for size in (7, 1, 1, 5, 16):
        batch = HashBatch.single(ids[start : start + size], start=start, device=device)
        batch.slot_mapping = torch.arange(start, start + size, device=device)
        batch.block_table = torch.arange(32, dtype=torch.int32, device=device)[None]
        handle = runtime.plan(batch)
        np.testing.assert_array_equal(handle.row_ids.cpu().numpy(), want[start : start + size])
        handles.append(handle)
        start += size
    runtime.close()


def test_prefetch_uses_the_other_slot(layout, token_map, device) -> None:
    runtime = _runtime(layout, token_map, device)
    first = runtime.plan(HashBatch.single([5, 6, 7], device=device))
    before = first.rows(0).clone()
    second = runtime.prefetch(HashBatch.single([8, 9], start=3, device=device))
    assert first.slot != second.slot
    assert torch.equal(first.rows(0), before)  # the prefetch did not overwrite the current rows
    runtime.close()


@pytest.mark.parametrize("tier", ["device", "host"])
def test_steps_of_changing_sizes_over_a_small_view_cache(
    tier, layout, token_map, device, monkeypatch
) -> None:
    """plan() keeps its views of the fixed buffers per (slot, tokens); with room for two
    pairs, steps whose sizes come back after the cache was cleared still get their own
    rows (each compared with the reference), in both staging slots."""
    from engramrt.runtime import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "VIEW_CACHE_SIZE", 2)
    runtime = _runtime(layout, token_map, device, tier=tier)
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    ids = np.random.default_rng(5).integers(0, token_map.vocab_size, 40)
    want_ids = hash_sequence(token_map.compress(ids), consts)
    start = 0
    for size in (3, 5, 3, 1, 5, 3, 3, 1):
        handle = runtime.plan(HashBatch.single(ids[: start + size], device=device))
        end = start + size
        np.testing.assert_array_equal(handle.row_ids.cpu().numpy(), want_ids[:end])
        for li, store in enumerate(runtime.sources):
            want = lookup_rows_reference(
                torch.from_numpy(want_ids[:end, li]),
                _packed(store),
                CFG.head_dim,
                row_begin=store.row_begin,
            )
            got = handle.rows(li).cpu()
            assert got.shape[0] == end, (size, li)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (size, li)
        assert runtime.cached_views <= 2
        start = (start + 2) % 20
    runtime.close()


def test_plans_after_close_run_without_threads(layout, token_map, device) -> None:
    """close() stops the worker threads; a later plan still returns every layer's rows."""
    runtime = _runtime(layout, token_map, device, tier="host")
    plain = _runtime(layout, token_map, device)
    runtime.close()
    batch = HashBatch.single([4, 8, 15, 16, 23], device=device)
    got, want = runtime.plan(batch), plain.plan(batch)
    for li in range(runtime.n_layers):
        assert torch.equal(got.rows(li).view(torch.int16), want.rows(li).view(torch.int16))
    plain.close()


def test_sizes_are_enforced(layout, token_map, device) -> None:
    runtime = _runtime(layout, token_map, device, max_tokens=4, max_requests=1)
    with pytest.raises(ValidationError, match=r"5 tokens.*max_tokens=4"):
        runtime.plan(HashBatch.single([1, 2, 3, 4, 5], device=device))
    two = HashBatch(
        input_ids=torch.tensor([1, 2], device=device),
        positions=torch.tensor([0, 0], device=device),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
    )
    with pytest.raises(ValidationError, match=r"2 requests.*max_requests=1"):
        runtime.plan(two)
    with pytest.raises(ValidationError, match="layer_index=5"):
        runtime.plan(HashBatch.single([1], device=device)).rows(5)
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    with pytest.raises(ValidationError, match="sources has 1 entries"):
        EngramRuntime(
            NgramHasher(consts, token_map, device),
            runtime.sources[:1],
            max_tokens=4,
            max_requests=1,
        )
    with pytest.raises(ValidationError, match="max_tokens=0"):
        EngramRuntime(
            NgramHasher(consts, token_map, device), runtime.sources, max_tokens=0, max_requests=1
        )
    with pytest.raises(ValidationError, match=r"sources\[1\] is a Tensor; expected a RowSource"):
        EngramRuntime(
            NgramHasher(consts, token_map, device),
            [runtime.sources[0], torch.zeros(1)],
            max_tokens=4,
            max_requests=1,
        )
    with pytest.raises(ValidationError, match="heads has 1 entries"):
        EngramRuntime(
            NgramHasher(consts, token_map, device),
            runtime.sources,
            heads=[CFG],
            max_tokens=4,
            max_requests=1,
        )
    runtime.close()


def test_tensor_parallel_shards_hold_their_columns(layout, token_map, device) -> None:
    full = _runtime(layout, token_map, device)
    ids = np.random.default_rng(4).integers(0, token_map.vocab_size, 12)
    want = [full.plan(HashBatch.single(ids, device=device)).rows(li).clone() for li in range(2)]
    for rank in range(3):
        part = _runtime(layout, token_map, device, tp=3, rank=rank)
        handle = part.plan(HashBatch.single(ids, device=device))
        for li in range(2):
            shard = layout.column_shard(li, 3, rank)
            got = handle.rows(li).view(torch.int16)
            mine = slice(shard.col_begin, shard.col_end)
            assert torch.equal(got[:, mine], want[li].view(torch.int16)[:, mine])
            others = torch.ones(CFG.n_cols, dtype=torch.bool)
            others[mine] = False
            assert bool((got[:, others] == 0).all())  # +0.0 for columns other ranks own
        part.close()
    full.close()


def _captured(step) -> torch.cuda.CUDAGraph:
    """``step`` run once on a side stream (kernels compile outside the capture), then
    captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_capture_replays_like_eager(layout, token_map) -> None:
    """Capture one step (hash + both lookups, device tier), replay it over many batches."""
    device = torch.device("cuda")
    t_len, rng = 48, np.random.default_rng(9)
    static = HashBatch(
        input_ids=torch.zeros(t_len, dtype=torch.int64, device=device),
        positions=torch.arange(t_len, device=device),
        query_start_loc=torch.tensor([0, 20, 21, 48], dtype=torch.int32, device=device),
        lookback_token_ids=torch.full((3, 3), -1, dtype=torch.int64, device=device),
    )
    captured = _runtime(layout, token_map, device, validate=False)
    eager = _runtime(layout, token_map, device, validate=False)
    outs = [
        torch.empty(t_len, CFG.n_cols, CFG.head_dim, dtype=torch.bfloat16, device=device)
        for _ in range(2)
    ]

    def step() -> None:
        handle = captured.plan(static)
        for li in range(2):
            outs[li].copy_(handle.rows(li))

    graph = _captured(step)
    for _ in range(10):
        ids = torch.as_tensor(rng.integers(0, token_map.vocab_size, t_len), device=device)
        lookback = torch.as_tensor(rng.integers(-1, token_map.vocab_size, (3, 3)), device=device)
        static.input_ids.copy_(ids)
        static.lookback_token_ids.copy_(lookback)
        graph.replay()
        want = eager.plan(
            HashBatch(ids, static.positions, static.query_start_loc, lookback_token_ids=lookback)
        )
        for li in range(2):
            assert torch.equal(outs[li].view(torch.int16), want.rows(li).view(torch.int16))


def test_cached_layers_are_updated_and_report_stats(layout, token_map, device) -> None:
    """A hot-row cache in front of a layer: same rows, admitted after each step, counted."""
    from engramrt.cache import CachedRowStore

    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    hasher = NgramHasher(consts, token_map, device)
    backing = synthetic_stores(layout, TablePlacement("host", device), seed=3)
    plain = synthetic_stores(layout, TablePlacement("host", device), seed=3)
    stores = [CachedRowStore(backing[0], 64 * 1024), backing[1]]
    runtime = EngramRuntime(hasher, stores, max_tokens=64, max_requests=8)
    reference = EngramRuntime(
        NgramHasher(consts, token_map, device), plain, max_tokens=64, max_requests=8
    )
    ids = np.random.default_rng(4).integers(0, token_map.vocab_size, 24)
    for _ in range(3):  # the same text three times: the later steps hit
        batch = HashBatch.single(ids, device=device)
        handle, want = runtime.plan(batch), reference.plan(batch)
        for li in range(2):
            assert torch.equal(handle.rows(li).view(torch.int16), want.rows(li).view(torch.int16))
    stats = runtime.cache_stats()
    assert stats[1] is None and stats[0] is not None
    # Step 0 misses everything and admits all 24 x C rows (the seeded text
    # has no repeated n-gram and they fit); steps 1 and 2 hit every one.
    assert stats[0].hits == (2 * 24,) * CFG.n_cols
    assert stats[0].misses == (24,) * CFG.n_cols
    assert stats[0].admitted == 24 * CFG.n_cols
    # The miss path reads each distinct missed row once; a probe that reads
    # misses itself (host rows mapped for a GPU) reads them, then the admitted.
    reads_in_probe = stores[0].probe_reads_misses
    assert reads_in_probe == (device.type == "cuda")
    assert stats[0].rows_fetched == 24 * CFG.n_cols * (2 if reads_in_probe else 1)
    runtime.close()
    reference.close()


def test_frozen_cached_layers_serve_their_warm_up_and_queue_no_update(
    layout, token_map, device
) -> None:
    """A frozen cache in front of a layer: the runtime queues no update behind its lookups,
    the rows stay the backing's bit for bit, and what the cache holds is its warm-up's.
    The unfrozen cache of the test above admits the same steps' rows (the control)."""
    from engramrt.cache import CachedRowStore

    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    backing = synthetic_stores(layout, TablePlacement("host", device), seed=3)
    plain = synthetic_stores(layout, TablePlacement("host", device), seed=3)
    cache = CachedRowStore(backing[0], 64 * 1024, frozen=True)
    rng = np.random.default_rng(6)
    profile = EngramRuntime(
        NgramHasher(consts, token_map, device), plain, max_tokens=64, max_requests=8
    )
    warm = profile.plan(HashBatch.single(rng.integers(0, token_map.vocab_size, 24), device=device))
    assert cache.warm_up([warm.row_ids[:, 0]]) > 0
    tags = cache.policy.tags.clone()
    runtime = EngramRuntime(
        NgramHasher(consts, token_map, device), [cache, backing[1]], max_tokens=64, max_requests=8
    )
    # The jobs a step gives worker threads (CUDA): no update behind the frozen cache's
    # lookups; an unfrozen cache of the same rows gets one.
    fetches = [("fetch", 0), ("fetch", 1)]
    assert worker_jobs(runtime.sources, {0: 0, 1: 0}) == fetches
    unfrozen = CachedRowStore(backing[0], 64 * 1024)
    assert worker_jobs([unfrozen, backing[1]], {0: 0, 1: 0}) == [*fetches, ("update", 0)]
    for _ in range(3):
        batch = HashBatch.single(rng.integers(0, token_map.vocab_size, 24), device=device)
        handle, want = runtime.plan(batch), profile.plan(batch)
        for li in range(2):
            assert torch.equal(handle.rows(li).view(torch.int16), want.rows(li).view(torch.int16))
    assert torch.equal(cache.policy.tags, tags)
    stats = runtime.cache_stats()[0]
    assert stats.admitted == 0 and stats.lookups == 3 * 24 * CFG.n_cols
    runtime.close()
    profile.close()


# --- the composed path: the runtime's rows feed the model's Engram layers ------------


def _heads(device, seeds=(11, 12)):
    from tests.layer.common import random_weights

    from engramrt.layer import EngramHead

    heads, weights = [], []
    for seed in seeds:
        head = EngramHead(CFG, device=device)
        weights.append(random_weights(seed, fp8=seed % 2 == 0, config=CFG))
        head.load_weights(**weights[-1])
        heads.append(head)
    return heads, weights


@pytest.mark.parametrize("tier", ["device", "host"])
def test_runtime_layers_compute_the_model_step(tier, layout, token_map, device) -> None:
    """One engine step: runtime.plan(batch), then each layer called with hidden alone.
    Rows are checked bit for bit against hashing + the lookup reference computed here,
    kv and out against the float reference."""
    from tests.layer.common import check_head_step, random_hidden

    heads, weights = _heads(device)
    runtime = _runtime(layout, token_map, device, tier=tier, heads=heads)
    consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
    ids = np.random.default_rng(5).integers(0, token_map.vocab_size, 21)
    want_ids = hash_sequence(token_map.compress(ids), consts)
    runtime.plan(HashBatch.single(ids, device=device))
    for li, layer in enumerate(runtime.layers):
        hidden = random_hidden(21, seed=30 + li, config=CFG).to(device)
        out, kv = layer(hidden, return_kv=True)
        store = runtime.sources[li]
        rows = lookup_rows_reference(
            torch.from_numpy(want_ids[:, li]),
            _packed(store),
            CFG.head_dim,
            row_begin=store.row_begin,
        ).to(device)
        check_head_step(heads[li], weights[li], hidden, rows, kv, out)
    runtime.close()


def test_runtime_layers_consume_prefetched_steps_in_order(layout, token_map, device) -> None:
    """plan(A), prefetch(B): the layers get A's rows, then B's; a third plan before
    the layers ran both is refused (its slot would overwrite A's rows)."""
    from tests.layer.common import random_hidden

    heads, _ = _heads(device)
    runtime = _runtime(layout, token_map, device, heads=heads)
    plain = _runtime(layout, token_map, device)  # the same tables, no heads
    batches = [
        HashBatch.single([5, 6, 7, 8], device=device),
        HashBatch.single([9, 10, 11], start=4, device=device),
    ]
    runtime.plan(batches[0])
    runtime.prefetch(batches[1])
    with pytest.raises(ValidationError, match=r"2 planned steps have layers whose rows were not"):
        runtime.plan(batches[0])
    for batch in batches:
        want = plain.plan(batch)
        for li, layer in enumerate(runtime.layers):
            hidden = random_hidden(batch.num_tokens, seed=li, config=CFG).to(device)
            out = layer(hidden).clone()
            # the same head on the rows computed without the runtime
            expected = heads[li](hidden, want.rows(li))
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"layer {li}"
    with pytest.raises(ValidationError, match=r"run\(0\) but no planned step"):
        runtime.layers[0](random_hidden(3, seed=1, config=CFG).to(device))
    with pytest.raises(ValidationError, match=r"hidden has shape \[2, "):
        runtime.plan(batches[1])
        runtime.run(0, random_hidden(2, seed=1, config=CFG).to(device))
    runtime.close()
    plain.close()


def test_negative_control_layers_fed_the_wrong_step_differ(layout, token_map, device) -> None:
    """The in-order check above can fail: the rows of the second step fed to the head
    with the first step's hidden states give another output."""
    from tests.layer.common import random_hidden

    heads, _ = _heads(device)
    plain = _runtime(layout, token_map, device)
    first = plain.plan(HashBatch.single([5, 6, 7], device=device)).rows(0).clone()
    second = plain.plan(HashBatch.single([9, 10, 11], start=3, device=device)).rows(0).clone()
    hidden = random_hidden(3, seed=0, config=CFG).to(device)
    a = heads[0](hidden, first).clone()
    b = heads[0](hidden, second)
    assert not torch.equal(a.view(torch.int16), b.view(torch.int16))
    plain.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("overlap", ["side", "layer"])
def test_graph_capture_of_a_model_step(overlap, layout, token_map) -> None:
    """Capture runtime.step + both layers (device tier), replay over fresh batches: the
    outputs equal eager steps of a runtime with the same heads, bit for bit; with the
    lookups beside the blocks and at their layers (``lookup_overlap``)."""
    from tests.layer.common import random_hidden

    device = torch.device("cuda", torch.cuda.current_device())
    t_len, rng = 40, np.random.default_rng(10)
    static = HashBatch(
        input_ids=torch.zeros(t_len, dtype=torch.int64, device=device),
        positions=torch.arange(t_len, device=device),
        query_start_loc=torch.tensor([0, 17, 40], dtype=torch.int32, device=device),
        lookback_token_ids=torch.full((2, 3), -1, dtype=torch.int64, device=device),
    )
    heads, _ = _heads(device)
    captured = _runtime(
        layout, token_map, device, heads=heads, validate=False, lookup_overlap=overlap
    )
    eager = _runtime(layout, token_map, device, heads=heads)
    hidden = [random_hidden(t_len, seed=li, config=CFG).to(device) for li in range(2)]
    outs = [torch.empty_like(h) for h in hidden]

    def step() -> None:
        captured.plan(static)
        for li, layer in enumerate(captured.layers):
            outs[li].copy_(layer(hidden[li]))

    graph = _captured(step)
    for _ in range(5):
        ids = torch.as_tensor(rng.integers(0, token_map.vocab_size, t_len), device=device)
        lookback = torch.as_tensor(rng.integers(-1, token_map.vocab_size, (2, 3)), device=device)
        static.input_ids.copy_(ids)
        static.lookback_token_ids.copy_(lookback)
        graph.replay()
        eager.plan(
            HashBatch(ids, static.positions, static.query_start_loc, lookback_token_ids=lookback)
        )
        for li, layer in enumerate(eager.layers):
            want = layer(hidden[li])
            assert torch.equal(outs[li].view(torch.int16), want.view(torch.int16)), f"layer {li}"


# --- lookup_workers: which threads run the sources that need one ----------------------


class _Flags:
    """Only the capability flags the plan reads."""

    def __init__(self, host_sync: bool, collective: bool = False, has_update: bool = False) -> None:
        self.host_sync, self.collective, self.has_update = host_sync, collective, has_update


@pytest.mark.parametrize(
    ("flags", "per_layer", "shared"),
    [
        ([(True, False), (True, False)], {0: 0, 1: 1}, {0: -2, 1: -2}),
        ([(True, False), (False, False)], {0: 0}, {0: -2}),
        ([(False, False), (False, False)], {}, {}),
        # Collective sources keep their one ordered worker either way.
        ([(True, True), (True, False)], {0: -1, 1: 1}, {0: -1, 1: -2}),
    ],
)
def test_shared_lookup_worker_plan(flags, per_layer, shared) -> None:
    from engramrt.runtime.runtime import worker_plan

    sources = [_Flags(h, c) for h, c in flags]
    assert worker_plan(sources) == per_layer  # type: ignore[arg-type]
    assert worker_plan(sources, shared=True) == shared  # type: ignore[arg-type]


def test_shared_lookup_worker_rows_equal_per_layer(layout, token_map, device) -> None:
    """Host tables with one lookup thread for both layers give the per-layer rows, step
    after step, prefetch included."""
    per_layer = _runtime(layout, token_map, device, tier="host", lookup_workers="per-layer")
    shared = _runtime(layout, token_map, device, tier="host")
    assert shared.lookup_workers == "shared"  # the default
    if device.type == "cuda":
        assert set(shared.worker_assignment.values()) == {-2}
    rng = np.random.default_rng(7)
    batches = [
        HashBatch.single(rng.integers(0, token_map.vocab_size, n), start=s, device=device)
        for n, s in ((17, 0), (5, 17), (1, 22))
    ]
    want = [per_layer.plan(b) for b in batches[:1]]
    got = [shared.plan(b) for b in batches[:1]]
    for batch in batches[1:]:  # each next step prefetched before the current one is read
        want.append(per_layer.prefetch(batch))
        got.append(shared.prefetch(batch))
        for w, g in zip(want[-2:-1], got[-2:-1], strict=True):
            for li in range(2):
                assert torch.equal(g.rows(li).view(torch.int16), w.rows(li).view(torch.int16))
    for li in range(2):
        assert torch.equal(got[-1].rows(li).view(torch.int16), want[-1].rows(li).view(torch.int16))
    per_layer.close()
    shared.close()


def test_lookup_workers_is_checked(layout, token_map, device) -> None:
    with pytest.raises(ValidationError, match=r"lookup_workers='one'; expected one of per-layer"):
        _runtime(layout, token_map, device, lookup_workers="one")


@pytest.mark.parametrize("shared", [False, True])
def test_updates_are_queued_after_every_lookup_of_the_step(shared) -> None:
    """A layer's wait joins its lookup job only: updates are jobs of their own, after all of
    the step's lookups, so on a shared worker layer 1's lookup never queues behind layer 0's
    update (a cache's admission planning, which synchronises with the device)."""
    from engramrt.runtime.runtime import worker_jobs, worker_plan

    sources = [_Flags(True, has_update=True), _Flags(False), _Flags(True, has_update=True)]
    sources.append(_Flags(True))
    plan = worker_plan(sources, shared=shared)  # type: ignore[arg-type]
    jobs = worker_jobs(sources, plan)  # type: ignore[arg-type]
    assert jobs == [("fetch", 0), ("fetch", 2), ("fetch", 3), ("update", 0), ("update", 2)]
    # On each worker, a source's update comes after its own lookup.
    for key in set(plan.values()):
        mine = [job for job in jobs if plan[job[1]] == key]
        for job, index in mine:
            if job == "update":
                assert mine.index(("fetch", index)) < mine.index((job, index))


@pytest.mark.parametrize(
    ("policy", "on_cuda"), [("first", [True, False]), ("all", [True, True]), ("sources", None)]
)
def test_gpu_reads_policy_per_layer(policy, on_cuda, layout, token_map, device) -> None:
    """The first Engram layer's host rows are read by the GPU, later layers' gathered by
    the CPU (``"first"``); rows are the same whichever way, and equal the reference."""
    runtime = _runtime(layout, token_map, device, tier="host", gpu_reads=policy)
    built = _runtime(layout, token_map, device, tier="host", gpu_reads="sources")
    mapped = device.type == "cuda"
    assert [s.use_gpu_reads(s.gpu_reads) for s in built.sources] == [mapped, mapped]
    if not mapped:  # nothing mapped for a GPU: no choice, nothing changes
        assert [s.gpu_reads for s in runtime.sources] == [False, False]
    elif on_cuda is None:
        assert [s.gpu_reads for s in runtime.sources] == [True, True]  # as built
    else:
        assert [s.gpu_reads for s in runtime.sources] == on_cuda
    rng = np.random.default_rng(11)
    for n, start in ((23, 0), (6, 23)):
        ids = rng.integers(0, token_map.vocab_size, n)
        got = runtime.plan(HashBatch.single(ids, start=start, device=device))
        for li, store in enumerate(runtime.sources):
            want = lookup_rows_reference(
                got.row_ids[:, li].cpu(), _packed(store), CFG.head_dim, row_begin=store.row_begin
            )
            assert torch.equal(got.rows(li).cpu().view(torch.int16), want.view(torch.int16))
    runtime.close()
    built.close()


def test_gpu_reads_default_reads_every_layers_small_batches(layout, token_map, device) -> None:
    """The default (``gpu_reads="all"``): on a GPU every layer's small batches are read by
    the GPU and started from the planning thread (no worker), with the reference's rows."""
    runtime = _runtime(layout, token_map, device, tier="host")
    assert runtime.gpu_reads == "all"
    on_cuda = device.type == "cuda"
    assert [s.gpu_reads for s in runtime.sources] == [on_cuda, on_cuda]
    rng = np.random.default_rng(14)
    step = runtime.plan(HashBatch.single(rng.integers(0, token_map.vocab_size, 5), device=device))
    assert all(p.future is None for p in step.pending)  # on a GPU: no worker hand-off
    for li, store in enumerate(runtime.sources):
        want = lookup_rows_reference(
            step.row_ids[:, li].cpu(), _packed(store), CFG.head_dim, row_begin=store.row_begin
        )
        assert torch.equal(step.rows(li).cpu().view(torch.int16), want.view(torch.int16))
    runtime.close()


def test_gpu_reads_policy_is_checked(layout, token_map, device) -> None:
    with pytest.raises(ValidationError, match=r"gpu_reads='none'; expected one of first, all"):
        _runtime(layout, token_map, device, tier="host", gpu_reads="none")


@pytest.mark.parametrize("tier", ["device", "host"])
def test_lookups_on_the_step_stream_give_the_same_rows(tier, layout, token_map, device) -> None:
    """``lookup_overlap="none"``: the lookups run inside plan on the step's stream; the rows
    are the reference's, as on the side stream."""
    runtime = _runtime(
        layout, token_map, device, tier=tier, lookup_overlap="none", gpu_reads="first"
    )
    assert runtime.lookup_overlap == "none"
    rng = np.random.default_rng(12)
    ids = rng.integers(0, token_map.vocab_size, 19)
    got = runtime.plan(HashBatch.single(ids, device=device))
    want_ids = hash_sequence(
        token_map.compress(ids), HashConstants.from_layout(layout, token_map.pad_id(CFG))
    )
    np.testing.assert_array_equal(got.row_ids.cpu().numpy(), want_ids)
    if tier == "host":  # on a GPU the first layer's small batch is read by it: no host wait
        waits = [s.waits_on_host(got.row_ids[:, li]) for li, s in enumerate(runtime.sources)]
        assert waits == ([False, True] if device.type == "cuda" else [True, True])
        large = torch.zeros((40_000, CFG.n_cols), dtype=torch.int64, device=device)
        assert runtime.sources[0].waits_on_host(large)  # gathered by the CPU
    for li, store in enumerate(runtime.sources):
        want = lookup_rows_reference(
            torch.from_numpy(want_ids[:, li]),
            _packed(store),
            CFG.head_dim,
            row_begin=store.row_begin,
        )
        assert torch.equal(got.rows(li).cpu().view(torch.int16), want.view(torch.int16))
    runtime.close()


def test_gpu_read_batches_start_beside_the_worker(layout, token_map, device, monkeypatch) -> None:
    """A host-tier batch the GPU reads itself (a decode step of the first layer) starts on
    the side stream from the planning thread, with no worker hand-off; a batch the CPU
    gathers goes to the worker, and so does any batch of a source whose earlier lookup is
    still on its worker. The rows equal the reference every time."""
    if device.type != "cuda":
        pytest.skip("worker threads and GPU reads of host memory need a CUDA device")
    import threading

    runtime = _runtime(layout, token_map, device, tier="host", gpu_reads="first")
    first = runtime.sources[0]
    first.dedup_min_rows = 100  # 4 tokens x 12 columns read by the GPU, 19 x 12 gathered
    rng = np.random.default_rng(13)

    def check(step) -> None:
        _check_step_rows(runtime, step)

    def batch(n: int) -> HashBatch:
        return HashBatch.single(rng.integers(0, token_map.vocab_size, n), device=device)

    small = runtime.plan(batch(4))
    assert small.pending[0].future is None  # beside: no thread
    assert small.pending[1].future is not None  # layer 1: the CPU's gather, on the worker
    check(small)
    large = runtime.plan(batch(19))
    assert large.pending[0].future is not None  # the CPU gathers it: on the worker
    check(large)

    # A lookup of the first layer held on its worker: the next small batch queues behind it.
    release, entered = threading.Event(), threading.Event()
    fetch = first.fetch

    def held_fetch(row_ids, out=None):
        entered.set()
        assert release.wait(30)
        return fetch(row_ids, out)

    monkeypatch.setattr(first, "fetch", held_fetch)
    held = runtime.plan(batch(19))
    assert entered.wait(30)
    monkeypatch.setattr(first, "fetch", fetch)
    behind = runtime.plan(batch(4))
    assert behind.pending[0].future is not None  # not beside: the worker is still busy
    release.set()
    check(held)
    check(behind)
    after = runtime.plan(batch(4))
    assert after.pending[0].future is None  # the worker is idle again
    check(after)
    runtime.close()


def test_lookup_overlap_is_checked(layout, token_map, device) -> None:
    with pytest.raises(
        ValidationError,
        match=r"lookup_overlap='after'; expected one of side, none, deferred, copies",
    ):
        _runtime(layout, token_map, device, lookup_overlap="after")


def test_lookup_cpus_is_checked(layout, token_map, device) -> None:
    allowed = os.sched_getaffinity(0)
    beyond = max(allowed) + 1
    for value, message in (
        ([], r"lookup_cpus is empty; expected at least one of the CPUs this process may use"),
        ([beyond], rf"lookup_cpus names CPUs {beyond}, which this process may not use"),
        (
            [beyond + 5, beyond, beyond + 2, beyond + 1],
            rf"lookup_cpus names CPUs {beyond}-{beyond + 2},{beyond + 5}, which",
        ),
        (["0"], r"lookup_cpus holds '0'; expected CPU numbers"),
        ([True], r"lookup_cpus holds True; expected CPU numbers"),
        ("0-3", r"lookup_cpus='0-3'; expected a collection of CPU numbers"),
        (3, r"lookup_cpus=3; expected a collection of CPU numbers"),
    ):
        with pytest.raises(ValidationError, match=message):
            _runtime(layout, token_map, device, lookup_cpus=value)
    runtime = _runtime(layout, token_map, device, lookup_cpus=sorted(allowed))
    assert runtime.lookup_cpus == frozenset(allowed)
    runtime.close()
    assert _runtime(layout, token_map, device).lookup_cpus is None


def test_lookup_workers_run_on_their_cpus() -> None:
    """A worker given CPUs runs there, and so does every thread it starts (a gather's
    intra-op threads); the thread that made it keeps its own; a worker given none runs on
    the process's CPUs (the control)."""
    allowed = os.sched_getaffinity(0)
    one = frozenset({min(allowed)})

    def started_thread_cpus() -> set[int]:
        seen: list[set[int]] = []
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
        return seen[0]

    def gather_thread_cpus() -> set[frozenset[int]]:
        """The CPUs of the threads a two-thread gather starts (torch's intra-op threads)."""
        before = set(os.listdir("/proc/self/task"))
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            rows = torch.zeros(4096, 33, dtype=torch.int64)
            torch.index_select(rows, 0, torch.randint(0, 4096, (1 << 20,)))
        finally:
            torch.set_num_threads(threads)
        return {_task_cpus(t) for t in set(os.listdir("/proc/self/task")) - before}

    pinned, free = lookup_worker("test-pinned", one), lookup_worker("test-free")
    try:
        assert pinned.submit(os.sched_getaffinity, 0).result() == one
        assert pinned.submit(started_thread_cpus).result() == one
        assert pinned.submit(gather_thread_cpus).result() == {one}
        assert free.submit(os.sched_getaffinity, 0).result() == allowed
        assert free.submit(started_thread_cpus).result() == allowed
        assert free.submit(gather_thread_cpus).result() == {frozenset(allowed)}
    finally:
        pinned.shutdown()
        free.shutdown()
    assert os.sched_getaffinity(0) == allowed


def _task_cpus(task: str) -> frozenset[int]:
    """CPUs thread ``task`` of this process may run on (``Cpus_allowed_list``)."""
    with open(f"/proc/self/task/{task}/status") as f:
        text = next(line for line in f if line.startswith("Cpus_allowed_list:")).split()[1]
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def test_sources_without_the_choice_ignore_gpu_reads(layout, token_map, device) -> None:
    runtime = _runtime(layout, token_map, device, tier="device", gpu_reads="all")
    assert [s.use_gpu_reads(False) for s in runtime.sources] == [False, False]
    runtime.close()


def test_abandon_forgets_planned_steps(layout, token_map, device) -> None:
    """An aborted step: abandon() drops the planned steps (the next plan is accepted and
    run gets its rows, not the abandoned ones); without it the third plan is refused."""
    from tests.layer.common import random_hidden

    heads, _ = _heads(device)
    runtime = _runtime(layout, token_map, device, heads=heads)
    plain = _runtime(layout, token_map, device)
    runtime.plan(HashBatch.single([5, 6, 7, 8], device=device))
    runtime.plan(HashBatch.single([9, 10, 11], start=4, device=device))
    with pytest.raises(ValidationError, match="planned steps have layers"):
        runtime.plan(HashBatch.single([1, 2], device=device))
    assert runtime.abandon() == 2 and runtime.pending_steps == 0
    batch = HashBatch.single([21, 22, 23], device=device)
    runtime.plan(batch)
    want = plain.plan(batch)
    hidden = random_hidden(3, seed=2, config=CFG).to(device)
    out = runtime.run(0, hidden)
    expected = heads[0](hidden, want.rows(0))
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    runtime.close()
    plain.close()


def _decode_step(token_map, device, n_req=6, seed=21):
    """One decode step (a token per request, lookback ids) on ``device`` and on the host."""
    rng = np.random.default_rng(seed)
    lookback = rng.integers(0, token_map.vocab_size, (n_req, CFG.max_ngram_size - 1))
    host = HashBatch(
        input_ids=torch.from_numpy(rng.integers(0, token_map.vocab_size, n_req)),
        positions=torch.from_numpy(rng.integers(3, 50, n_req)),
        query_start_loc=torch.arange(n_req + 1, dtype=torch.int32),
        lookback_token_ids=torch.from_numpy(lookback),
    )
    return host.to(device), host


@pytest.mark.parametrize("workers", ["per-layer", "shared"])
def test_host_mirror_gives_the_same_rows(workers, layout, token_map, device) -> None:
    """Layers whose source takes host ids hash the step's host mirror themselves; every
    layer's rows and the step's row ids are those of the device batch alone."""
    runtime = _runtime(layout, token_map, device, tier="host", lookup_workers=workers)
    assert all(s.host_ids for s in runtime.sources)
    batch, host = _decode_step(token_map, device)
    want = runtime.plan(batch)
    want_rows = [want.rows(li).clone() for li in range(2)]
    got = runtime.plan(batch.with_host(host))
    assert torch.equal(got.row_ids, want.row_ids)
    for li in range(2):
        assert torch.equal(got.rows(li).view(torch.int16), want_rows[li].view(torch.int16))
    # Negative control: a host batch of another step gives other rows.
    _, other = _decode_step(token_map, device, seed=22)
    wrong = runtime.plan(batch.with_host(other))
    assert not torch.equal(wrong.rows(0).view(torch.int16), want_rows[0].view(torch.int16))
    # The older keyword still works for a release, with a warning.
    with pytest.warns(DeprecationWarning, match=r"host_batch=host\) is deprecated"):
        old = runtime.plan(batch, host_batch=host)
    assert torch.equal(old.rows(0).view(torch.int16), want_rows[0].view(torch.int16))
    runtime.close()


def test_host_mirror_is_checked(layout, token_map, device) -> None:
    cache = SlotHashCache(32 * 4, 4, device)
    runtime = _runtime(layout, token_map, device, tier="host", history=cache)
    batch, host = _decode_step(token_map, device)
    with pytest.raises(ValidationError, match=r"host_batch has 5 tokens and 5 requests"):
        runtime.plan(batch.with_host(_decode_step(token_map, device, n_req=5)[1]))
    host.lookback_token_ids[2, 1] = -1
    with pytest.raises(ValidationError, match=r"lookback_token_ids\[2, 1\] = -1"):
        runtime.plan(batch.with_host(host))
    runtime.close()


def test_host_mirror_needs_an_id_maker_that_hashes_on_host(layout, token_map, device) -> None:
    class DeviceOnly:  # a row-id maker with no host path
        def __init__(self, hasher):
            self._hasher = hasher
            self.n_layers, self.num_cols = hasher.n_layers, hasher.num_cols
            self.device, self.out_dtype = hasher.device, hasher.out_dtype
            self.history_window = hasher.history_window

        def __call__(self, batch, history=None, out=None):
            return self._hasher(batch, history, out)

    base = _runtime(layout, token_map, device, tier="host")
    runtime = EngramRuntime(DeviceOnly(base.hasher), base.sources, max_tokens=64, max_requests=8)
    batch, host = _decode_step(token_map, device)
    with pytest.raises(ValidationError, match=r"\(DeviceOnly\) cannot make ids on the host"):
        runtime.plan(batch.with_host(host))
    runtime.close()
    base.close()


def test_deferred_gathers_take_the_threads_their_batch_can_use(
    layout, token_map, device, monkeypatch
) -> None:
    """A deferred layer's CPU gather runs on the thread that waits for its rows, which does
    nothing else meanwhile: one intra-op thread per ``ROWS_PER_WAITED_GATHER_THREAD`` rows
    (256 tokens x 12 columns = 3,072 rows: 2 threads, on a host of 16 CPUs). Control: the
    same step gathered at plan, beside the launching thread, takes one per
    ``ROWS_PER_GATHER_THREAD`` rows (1); the runtime resets the store's setting."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    threads: list[int] = []
    index_select = torch.index_select

    def counting(*args, **kwargs):
        threads.append(torch.get_num_threads())
        return index_select(*args, **kwargs)

    monkeypatch.setattr(torch, "index_select", counting)
    ids = np.random.default_rng(3).integers(0, token_map.vocab_size, 256)
    assert len(ids) * layout.config.n_cols // ROWS_PER_WAITED_GATHER_THREAD == 2
    stores = None
    for overlap, want in (("deferred", 2), ("side", 1)):
        consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
        hasher = NgramHasher(consts, token_map, device)
        if stores is None:
            stores = synthetic_stores(layout, TablePlacement("host", device), seed=3)
        runtime = EngramRuntime(
            hasher, stores, max_tokens=256, max_requests=8, lookup_overlap=overlap,
            gpu_reads="sources",
        )  # fmt: skip
        for store in stores:
            store.use_gpu_reads(False)  # every batch gathered by the CPU
        threads.clear()
        step = runtime.plan(HashBatch.single(ids, device=device))
        for li in range(len(stores)):
            step.rows(li)
        assert threads and set(threads) == {want}, (overlap, threads)
        runtime.close()


def test_deferred_lookups_run_at_their_layer(layout, token_map, device, monkeypatch) -> None:
    """``lookup_overlap="deferred"``: a host-tier layer's lookup starts nowhere at plan (no
    worker, no side stream) and runs once, on the thread that first waits for its rows; the
    rows are the reference's for steps gathered in pieces and whole, planned into both
    slots before either is waited for, and for a step with a host mirror. Control: a
    device-tier runtime defers nothing."""
    import threading

    assert not any(
        p.deferred is not None
        for p in _runtime(layout, token_map, device, lookup_overlap="deferred")
        .plan(HashBatch.single(np.arange(5), device=device))
        .pending
    )
    runtime = _runtime(layout, token_map, device, tier="host", lookup_overlap="deferred")
    calls: list[tuple[int, threading.Thread]] = []
    for li, store in enumerate(runtime.sources):
        store.chunk_rows = 48  # 19 tokens x 12 columns: gathered in five pieces

        def fetch(row_ids, out=None, li=li, inner=store.fetch):
            calls.append((li, threading.current_thread()))
            return inner(row_ids, out)

        monkeypatch.setattr(store, "fetch", fetch)
    rng = np.random.default_rng(14)

    def check(step) -> None:
        _check_step_rows(runtime, step)

    steps = [
        runtime.plan(HashBatch.single(rng.integers(0, token_map.vocab_size, n), device=device))
        for n in (19, 4)
    ]
    assert calls == [], "nothing is looked up at plan"
    assert all(p.future is None and p.deferred is not None for s in steps for p in s.pending)
    for step in steps:
        check(step)
    check(steps[0])  # a second wait does not look up again
    assert calls == [(0, threading.current_thread()), (1, threading.current_thread())] * 2
    batch, host = _decode_step(token_map, device)
    plain = runtime.plan(batch)
    want = [plain.rows(li).clone() for li in range(2)]
    got = runtime.plan(batch.with_host(host))
    for li in range(2):
        assert torch.equal(got.rows(li).view(torch.int16), want[li].view(torch.int16))
    runtime.close()


def _counting_fetches(runtime, monkeypatch) -> list[tuple[int, threading.Thread]]:
    """(layer, thread) of every ``fetch`` of ``runtime``'s sources, in call order."""
    calls: list[tuple[int, threading.Thread]] = []
    for li, store in enumerate(runtime.sources):

        def fetch(row_ids, out=None, li=li, inner=store.fetch):
            calls.append((li, threading.current_thread()))
            return inner(row_ids, out)

        monkeypatch.setattr(store, "fetch", fetch)
    return calls


@pytest.mark.parametrize("tier", ["device", "host"])
def test_layer_overlap_runs_lookups_that_wait_for_nothing_at_their_layer(
    tier, layout, token_map, device, monkeypatch
) -> None:
    """``lookup_overlap="layer"``: a lookup that makes the host wait for nothing (GPU memory,
    the host tier's GPU reads of a small batch on a GPU) starts nowhere at plan and runs
    whole on the thread that first waits for its rows; two steps planned into both slots
    before either is read get the reference's rows. A host-tier lookup that waits for the
    ids (every host lookup on a CPU device) is started at plan as before. Control: with
    ``"side"`` every lookup is started at plan."""
    rng = np.random.default_rng(31)
    for overlap in ("layer", "side"):
        runtime = _runtime(layout, token_map, device, tier=tier, lookup_overlap=overlap)
        calls = _counting_fetches(runtime, monkeypatch)
        steps = [
            runtime.plan(HashBatch.single(rng.integers(0, token_map.vocab_size, n), device=device))
            for n in (11, 3)
        ]
        waits = [runtime.sources[li].waits_on_host(steps[0].row_ids[:, li]) for li in range(2)]
        at_layer = [overlap == "layer" and not wait for wait in waits]
        if device.type == "cuda" or tier == "device":
            assert at_layer == [overlap == "layer"] * 2  # GPU memory, or a GPU read
        else:
            assert at_layer == [False, False]  # the CPU's gather waits for the ids
        for step in steps:
            assert [p.deferred is not None for p in step.pending] == at_layer, overlap
        runtime.close()  # the workers' lookups started at plan have been issued
        started = [li for li, _ in calls]
        assert started == [li for _ in steps for li in range(2) if not at_layer[li]], overlap
        calls.clear()
        for step in steps:
            _check_step_rows(runtime, step)
        assert calls == [
            (li, threading.current_thread()) for _ in steps for li in range(2) if at_layer[li]
        ], overlap


def test_layer_overlap_splits_queued_gathers_and_keeps_their_gpu_reads(
    layout, token_map, device
) -> None:
    """``lookup_overlap="layer"`` over queued host gathers splits them as ``"copies"`` does,
    but keeps the GPU reads ``gpu_reads`` asks for (layer 0's, with ``"first"``), where
    ``"copies"`` turns every split layer's off; the rows equal the reference's either way."""
    rng = np.random.default_rng(33)
    for overlap, reads in (("layer", [True, False]), ("copies", [False, False])):
        options = HostOptions(gather="queued")
        stores = synthetic_stores(layout, TablePlacement(options, device), seed=3)
        consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
        runtime = EngramRuntime(
            NgramHasher(consts, token_map, device), stores, max_tokens=64, max_requests=8,
            lookup_overlap=overlap, gpu_reads="first",
        )  # fmt: skip
        mapped = device.type == "cuda"  # rows mapped for the GPU: GPU reads can be on
        assert [s.gpu_reads for s in stores] == [r and mapped for r in reads], overlap
        steps = [
            runtime.plan(HashBatch.single(rng.integers(0, token_map.vocab_size, n), device=device))
            for n in (7, 13)
        ]
        assert all(p.deferred is not None for s in steps for p in s.pending), overlap
        for step in steps:
            _check_step_rows(runtime, step)
        runtime.close()


def test_copies_overlap_queues_transfers_at_plan_and_kernels_at_the_layer(
    layout, token_map, device, monkeypatch
) -> None:
    """``lookup_overlap="copies"`` over queued host gathers: plan queues each layer's ids'
    copy, CPU gather and rows' copy (the gathers run at plan on a CPU device, in stream
    order on a GPU) and no dequantisation; each layer's dequantisation runs when its rows
    are first waited for. Two steps planned into both slots before either is read get
    the reference's rows (the store keeps one device buffer per slot). Control: with
    ``"side"`` the same stores dequantise at plan."""
    import engramrt.lookup.tiers.host_gather as host_gather

    dequantised: list[int] = []
    lookup_rows = host_gather.lookup_rows

    def counting(*args, **kwargs):
        dequantised.append(1)
        return lookup_rows(*args, **kwargs)

    monkeypatch.setattr(host_gather, "lookup_rows", counting)
    # No GPU reads: on a GPU the control's small batches would be read, not gathered.
    options = HostOptions(gather="queued", gpu_reads=False)
    stores = synthetic_stores(layout, TablePlacement(options, device), seed=3)
    assert all(store.splits_lookup for store in stores)
    rng = np.random.default_rng(21)

    def step(runtime):
        ids = rng.integers(0, token_map.vocab_size, int(rng.integers(1, 20)))
        return runtime.plan(HashBatch.single(ids, device=device))

    for overlap, at_plan in (("copies", 0), ("side", 2)):
        consts = HashConstants.from_layout(layout, token_map.pad_id(CFG))
        hasher = NgramHasher(consts, token_map, device)
        runtime = EngramRuntime(
            hasher, stores, max_tokens=64, max_requests=8, lookup_overlap=overlap,
            gpu_reads="sources",
        )  # fmt: skip
        dequantised.clear()
        steps = [step(runtime), step(runtime)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert len(dequantised) == 2 * at_plan, overlap
        assert all((p.deferred is not None) == (overlap == "copies") for p in steps[0].pending)
        for planned in steps:
            _check_step_rows(runtime, planned)
        assert len(dequantised) == 4
        runtime.close()
