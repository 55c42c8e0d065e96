"""The host tiers' queued gather (``gather="queued"``): every lookup queued in stream
order, bit for bit the reference, at fixed addresses, failures never silent."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tests.helpers import CUDA, DEVICE, assert_same_bits, random_packed_table
from tests.lookup.stores import store_of

from engramrt.errors import ValidationError
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.host_function import (
    HostFunction,
    HostFunctionError,
    host_functions_available,
)
from engramrt.lookup.tiers import HostGatherRowStore, tier_class
from engramrt.runtime.runtime import worker_plan


def build(tier: str, table: torch.Tensor, tmp_path: Path, **kwargs: object) -> HostGatherRowStore:
    options = {k: v for k, v in kwargs.items() if k not in ("row_begin", "col_begin", "col_end")}
    options_type = tier_class(tier).options_type
    if "gpu_reads" in {f.name for f in dataclasses.fields(options_type)}:
        # On a GPU, small batches would otherwise be read by the GPU, not gathered.
        options.setdefault("gpu_reads", False)
    store = store_of(
        options_type(gather="queued", **options),  # type: ignore[arg-type]
        table,
        device=DEVICE,
        row_begin=int(kwargs.get("row_begin", 0)),  # type: ignore[call-overload]
        col_begin=int(kwargs.get("col_begin", 0)),  # type: ignore[call-overload]
        col_end=kwargs.get("col_end"),  # type: ignore[arg-type]
        path=tmp_path / f"{tier}.rows",
    )
    assert isinstance(store, HostGatherRowStore)
    return store


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize(
    ("T", "C", "cols", "row_begin", "id_dtype"),
    [
        (11, 5, (0, None), 0, torch.int64),
        (7, 24, (8, 16), 1_000_003, torch.int32),  # a tensor-parallel rank's shard
        (1, 3, (2, 3), 2**33, torch.int64),  # one decode token, ids past int32
    ],
)
def test_queued_gather_matches_the_reference(
    tier: str,
    T: int,
    C: int,
    cols: tuple[int, int | None],
    row_begin: int,
    id_dtype: torch.dtype,
    tmp_path: Path,
) -> None:
    E, num_rows = 64, 200
    table = random_packed_table(num_rows, E, seed=T * C)
    col_begin, col_end = cols
    store = build(tier, table, tmp_path, row_begin=row_begin, col_begin=col_begin, col_end=col_end)
    assert store.queued and not store.host_sync
    g = torch.Generator().manual_seed(T + C)
    row_ids = torch.randint(row_begin, row_begin + num_rows, (T, C), generator=g)
    row_ids[0, col_begin] = row_begin + num_rows - 1  # the shard's last row
    row_ids[:, :col_begin] = -7  # other shards' columns hold anything
    if col_end is not None:
        row_ids[:, col_end:] = 2**40
    if id_dtype == torch.int32:
        row_ids = row_ids.clamp(-(2**31), 2**31 - 1)
    row_ids = row_ids.to(id_dtype)
    expected = lookup_rows_reference(row_ids, table, E, col_begin, col_end, row_begin)
    assert not store.waits_on_host(row_ids.to(DEVICE))
    out = torch.full((T, C, E), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = store.lookup(row_ids.to(DEVICE), out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_same_bits(got, expected)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_ids_outside_the_shard_read_as_zeros(tier: str, tmp_path: Path) -> None:
    table = random_packed_table(10, 32, seed=3)
    store = build(tier, table, tmp_path, row_begin=100, check_ids=False)
    g = torch.Generator().manual_seed(4)
    for bad in (99, 110, -1, -(2**62), 2**62):
        row_ids = torch.randint(100, 110, (3, 5), generator=g)
        row_ids[2, 1] = bad
        row_ids[0, 4] = bad
        found = store.lookup(row_ids.to(DEVICE)).cpu()
        expected = lookup_rows_reference(row_ids.clamp(100, 109) - 100, table, 32)
        expected[2, 1] = 0
        expected[0, 4] = 0
        assert_same_bits(found, expected)
        # Negative control: the masked slots really differ from the clamped rows.
        assert not torch.equal(
            lookup_rows_reference(row_ids.clamp(100, 109) - 100, table, 32)[2, 1],
            expected[2, 1],
        )


def test_buffers_sit_at_fixed_addresses_and_grow_for_a_larger_batch(tmp_path: Path) -> None:
    table = random_packed_table(50, 32, seed=5)
    store = build("host", table, tmp_path, queued_rows=12)

    def buffers() -> tuple[int, int, int]:
        assert store.queued_buffers is not None
        staging, rows = store.queued_buffers
        assert staging.shape == rows.shape and staging.device.type == "cpu"
        return staging.shape[0], staging.data_ptr(), rows.data_ptr()

    capacity, *addresses = buffers()
    assert capacity == 12
    g = torch.Generator().manual_seed(6)
    for T in (1, 4, 2, 4):  # at most 12 rows: the buffers stay where they are
        ids = torch.randint(0, 50, (T, 3), generator=g)
        assert_same_bits(store.lookup(ids.to(DEVICE)), lookup_rows_reference(ids, table, 32))
        assert buffers() == (12, *addresses)
    ids = torch.randint(0, 50, (9, 3), generator=g)  # 27 rows: grown once
    assert_same_bits(store.lookup(ids.to(DEVICE)), lookup_rows_reference(ids, table, 32))
    assert buffers()[0] == 27


def test_a_failed_gather_gives_nan_rows_and_raises_at_the_next_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = random_packed_table(20, 32, seed=7)
    store = build("host", table, tmp_path)
    ids = torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(8))
    assert_same_bits(store.lookup(ids.to(DEVICE)), lookup_rows_reference(ids, table, 32))
    index_select = torch.index_select

    def failing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the host's gather failed")

    monkeypatch.setattr(torch, "index_select", failing)
    if CUDA:  # queued: the step's rows are NaN, and the next lookup raises
        rows = store.lookup(ids.to(DEVICE)).cpu()
        assert torch.isnan(rows.float()).all()
        monkeypatch.setattr(torch, "index_select", index_select)
        with pytest.raises(HostFunctionError, match="gather failed on CUDA's host-function"):
            store.lookup(ids.to(DEVICE))
    else:  # no stream: the same function runs at once and its lookup raises
        with pytest.raises(HostFunctionError, match="gather failed on CUDA's host-function"):
            store.lookup(ids.to(DEVICE))
        assert store.queued_buffers is not None
        staging, _ = store.queued_buffers
        assert bool((staging[:12] == 255).all())  # NaN bytes, never stale rows
        monkeypatch.setattr(torch, "index_select", index_select)
    # Reported once; the store serves again afterwards.
    assert_same_bits(store.lookup(ids.to(DEVICE)), lookup_rows_reference(ids, table, 32))


def test_a_queued_store_runs_on_the_side_stream_not_a_worker(tmp_path: Path) -> None:
    table = random_packed_table(20, 32, seed=9)
    queued = build("host", table, tmp_path)
    threaded = store_of("host", table, device=DEVICE)
    assert threaded.host_sync and not queued.host_sync
    assert worker_plan([queued, threaded]) == {1: 1}
    assert worker_plan([queued, queued]) == {}


def test_options_are_checked() -> None:
    options = tier_class("host").options_type
    with pytest.raises(ValidationError, match="gather"):
        options(gather="later")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="queued_rows"):
        options(gather="queued", queued_rows=0)  # type: ignore[call-arg]


def test_host_function_keeps_the_first_failure_and_raises_it_once() -> None:
    seen: list[int] = []

    def record(arg: int) -> None:
        if arg == 3:
            raise KeyError(arg)
        seen.append(arg)

    function = HostFunction(record, name="recording")
    function.call_now(1)
    with pytest.raises(HostFunctionError, match=r"recording failed .* KeyError: 3"):
        function.call_now(3)
    function.call_now(2)
    assert seen == [1, 2]


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without a GPU")
def test_no_host_functions_without_a_gpu() -> None:
    assert not host_functions_available(torch.device("cpu"))


def test_calls_queued_after_a_failure_still_run() -> None:
    """Calls the driver makes before the host sees a failure (steps queued ahead, graph
    replays) still run, so each writes its own output; the first failure is the one raised."""
    seen: list[int] = []

    def record(arg: int) -> None:
        if arg in (3, 4):
            raise KeyError(arg)
        seen.append(arg)

    function = HostFunction(record, name="recording")
    for arg in (3, 1, 4, 2):  # as the driver's thread calls them, in stream order
        function.call_deferred(arg)
    assert seen == [1, 2]
    with pytest.raises(HostFunctionError, match="KeyError: 3"):
        function.raise_failure()
    function.raise_failure()  # raised once


@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("cols", [(0, None), (2, 5)])
def test_a_layer_view_of_the_step_ids_is_read_where_it_lies(
    T: int, cols: tuple[int, int | None], tmp_path: Path
) -> None:
    """A runtime hands each layer a strided view of the step's ``[T, layers, C]`` ids; the
    queued gather copies the span that holds the owned columns as it lies and reads the
    layer's ids out of it on the host. The other layer holds other valid ids, so a span
    read at the wrong offset or stride would gather other rows, not fail."""
    E, num_rows, C = 32, 300, 6
    table = random_packed_table(num_rows, E, seed=T)
    col_begin, col_end = cols
    store = build("host", table, tmp_path, col_begin=col_begin, col_end=col_end)
    step_ids = torch.randint(0, num_rows, (T, 2, C), generator=torch.Generator().manual_seed(T))
    for layer in (0, 1):
        ids = step_ids.to(DEVICE)[:, layer]
        assert not ids.is_contiguous() or T == 1
        expected = lookup_rows_reference(step_ids[:, layer], table, E, col_begin, col_end)
        assert_same_bits(store.lookup(ids), expected)
    # Control: the two layers' rows differ, so reading the wrong layer would show.
    assert not torch.equal(
        lookup_rows_reference(step_ids[:, 0], table, E, col_begin, col_end),
        lookup_rows_reference(step_ids[:, 1], table, E, col_begin, col_end),
    )


def test_queue_copies_keeps_the_rows_of_each_lookup_in_flight(tmp_path: Path) -> None:
    """``queue_copies``: the transfers now, the dequantisation when the returned function
    is called; with ``in_flight=2`` two lookups queued before either is finished each
    read their own rows. Negative control: with one buffer (``in_flight=1``) the second
    lookup's rows land where the first one's are still unread, and the first returns the
    second's rows."""
    table = random_packed_table(80, 32, seed=11)
    g = torch.Generator().manual_seed(12)
    first, second = (torch.randint(0, 80, (5, 4), generator=g) for _ in range(2))
    want = [lookup_rows_reference(ids, table, 32) for ids in (first, second)]
    store = build("host", table, tmp_path)
    assert store.splits_lookup
    finish = [store.queue_copies(ids.to(DEVICE), in_flight=2) for ids in (first, second)]
    assert_same_bits(finish[1](), want[1])
    assert_same_bits(finish[0](), want[0])

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValidationError, match=rf"in_flight={bad!r}; expected an int >= 1"):
            store.queue_copies(first.to(DEVICE), in_flight=bad)  # type: ignore[arg-type]

    single = build("host", table, tmp_path / "single")
    finish = [single.queue_copies(ids.to(DEVICE), in_flight=1) for ids in (first, second)]
    finish[1]()
    assert_same_bits(finish[0](), want[1])  # the first lookup read the second's rows


def test_queue_copies_of_a_store_that_cannot_split_runs_the_whole_lookup(tmp_path: Path) -> None:
    table = random_packed_table(40, 32, seed=13)
    threaded = store_of("host", table, device=DEVICE)
    assert not threaded.splits_lookup
    ids = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(14))
    calls: list[int] = []
    lookup = threaded.lookup

    def counting(row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(1)
        return lookup(row_ids, out)

    threaded.lookup = counting  # type: ignore[method-assign]
    finish = threaded.queue_copies(ids.to(DEVICE))
    assert calls == []  # nothing queued: the lookup runs when the function is called
    assert_same_bits(finish(), lookup_rows_reference(ids, table, 32))
    assert calls == [1]
