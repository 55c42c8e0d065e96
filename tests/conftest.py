"""Test set-up shared by every test module.

Kernels run through Triton's CPU interpreter on machines without a GPU.
Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set
here, before any test module imports a kernel.
"""

from __future__ import annotations

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Several pytest workers share the cores: one torch thread each (and in the
    # processes the tests start), since a second thread waits for a core that
    # another worker holds and small ops then run several times slower
    # (BENCHMARKS.md, "The demo and the tests on a 2-core CPU").
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

QUICK_MODULES = (
    "tests/test_config.py",
    "tests/test_layout.py",
    "tests/test_io.py",
    "tests/test_source.py",
    "tests/test_lean_import.py",
    "tests/cli/test_errors.py",
    "tests/quant/",
    "tests/checkpoint/test_names.py",
    "tests/checkpoint/test_format.py",
    "tests/cache/test_policy.py",
    "tests/lookup/test_registry.py",
    "tests/lookup/test_masking.py",
)
"""The modules of ``scripts/test --quick`` (``-m quick``): unit tests that run in seconds
each, chosen by their ``--durations`` on a 2-core CPU (BENCHMARKS.md, "The demo and the
tests on a 2-core CPU"); the token map's and ``inspect``'s tests, which rebuild maps and
start processes, are left to the full run."""


SHARED_FOLDERS = ("tests/models/",)
"""Folders whose tests share session fixtures worth building once (the tiny model trained
in ``tests/models/conftest.py``): under pytest-xdist each runs on one worker."""

SPREAD = (
    "tests/test_docs.py",
    "tests/test_bench_scripts.py",
    "tests/test_bench_full_size.py",
    "tests/cli/test_demo_synthetic.py",
    "tests/checkpoint/test_conversion_set.py",
    "tests/cache/test_concurrency.py",
    "tests/hashing/test_hash_kernel_configs.py",
)
"""Long modules whose tests share no costly module-scoped fixture: under pytest-xdist
their tests go to the workers one by one. Every other module runs whole on one worker,
so that its module-scoped fixtures are built once."""

SLOW_FIRST = (
    "tests/cli/test_demo_model.py",
    "tests/models/",
    "tests/test_docs.py",
    "tests/test_bench_scripts.py",
    "tests/test_bench_full_size.py",
    "tests/cli/test_demo_synthetic.py",
    "tests/test_custom_ops.py",
    "tests/adapters/test_replay.py",
    "tests/test_examples.py",
    "tests/checkpoint/test_conversion_set.py",
    "tests/cache/test_concurrency.py",
)
"""The modules with the longest runs, started first so that under pytest-xdist no worker
is left with one of them at the end (``--durations`` on a 2-core CPU, BENCHMARKS.md)."""


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs together: a folder of :data:`SHARED_FOLDERS`, a
    test of :data:`SPREAD` alone, else a whole module."""
    path = nodeid.split("::", 1)[0]
    folder = next((f for f in SHARED_FOLDERS if path.startswith(f)), None)
    if folder is not None:
        return folder
    return nodeid if path in SPREAD else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    paths = {}
    for item in items:
        path = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        paths[item.nodeid] = path
        if path.startswith(QUICK_MODULES):
            item.add_marker(pytest.mark.quick)

    def rank(item: pytest.Item) -> int:
        path = paths[item.nodeid]
        return next(
            (i for i, slow in enumerate(SLOW_FIRST) if path.startswith(slow)), len(SLOW_FIRST)
        )

    items.sort(key=rank)  # stable: the collection order within each rank


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pragma: no cover - pytest-xdist is in the dev extra
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class _WorkUnitScheduling(LoadScopeScheduling):
        """pytest-xdist's scope scheduling over :func:`work_unit`, in collection order
        (the slowest first), each worker asking for more as it runs out."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    def pytest_xdist_make_scheduler(
        config: pytest.Config, log: object
    ) -> _WorkUnitScheduling | None:
        if config.getvalue("dist") != "load":
            return None  # an explicit --dist keeps pytest-xdist's own scheduler
        config.option.loadscopereorder = False  # keep SLOW_FIRST's order
        return _WorkUnitScheduling(config, log)


@pytest.fixture(scope="session")
def token_map(tmp_path_factory: pytest.TempPathFactory):
    """The DeepSeek-V4 token map, built once per test session in a fresh cache dir."""
    from engramrt.tokenmap import TokenMap

    return TokenMap.from_tokenizer_file(cache_dir=tmp_path_factory.mktemp("tokenmap-cache"))


@pytest.fixture(scope="session")
def device():
    """Where kernel tests run: ``ENGRAMRT_TEST_DEVICE`` (e.g. ``cuda`` on a GPU machine), else CPU."""
    import torch

    return torch.device(os.environ.get("ENGRAMRT_TEST_DEVICE", "cpu"))


def _world_of_one(tmp_path, backend: str, timeout_s: float, **options):
    """A process group of this process alone (file:// rendezvous), destroyed afterwards."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        backend,
        init_method=f"file://{tmp_path / 'init'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
        **options,
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of this process alone (10 s timeout)."""
    yield from _world_of_one(tmp_path, "gloo", 10)


@pytest.fixture
def nccl_world_of_one(tmp_path):
    """An NCCL process group of this process alone, on the current GPU (60 s timeout)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    yield from _world_of_one(tmp_path, "nccl", 60, device_id=device)
