"""One registry of benchmark cases.

A case builds fresh random inputs on a device, runs each implementation
once, checks every output against the reference (a case whose check fails
is reported as failed, never timed), then times each implementation. The
runner (:mod:`engramrt.bench.runner`) reports time, rate, bandwidth and the
percent of the copy ceiling measured in the same run.

Cases live in ``engramrt/bench/cases_<op>.py``: each module decorates a
factory with :func:`register`; the factory takes ``quick`` (a short run)
and returns that operation's cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engramrt.packed import row_bytes_for

Inputs = dict[str, Any]


@dataclass
class Case:
    """One benchmark case: a shape, its implementations and their check.

    Attributes:
        name: unique name, ``"<group>/<shape>"``, e.g. ``"gate/T=8192"``; its
            first part is :attr:`group`.
        params: the shape and settings, reported next to the numbers.
        make: builds fresh random inputs on a device (never zeros).
        impls: implementation name -> callable taking the inputs.
        check: given the inputs and each implementation's output, raises
            ``AssertionError`` with the worst mismatches when one is wrong.
        bytes_moved: the fewest bytes one call must move through the memory
            that bounds it (each input read once, each output written once).
        items: how many units one call handles (rows, tokens).
        item_name: what a unit is, for the rate column.
        baseline: the name in ``impls`` every other one is compared to.
        ceiling: which measured copy ceiling bounds it: ``"d2d"`` (device
            memory, counting read + write) or ``"h2d"`` (host to device).
        graph: also time under CUDA-graph replay (for capturable impls).
        graph_impls: the implementations timed so; None: every one but the
            baseline (see :meth:`timed_in_graph`).
        requires_cuda: skip on machines without a GPU.
        tuning: the kernel settings this case chooses between, when
            ``engramrt bench --write-config`` should write its winner (see
            :class:`Tuning`).
    """

    name: str
    params: dict[str, Any]
    make: Callable[[torch.device], Inputs]
    impls: dict[str, Callable[[Inputs], Any]]
    check: Callable[[Inputs, dict[str, Any]], None]
    bytes_moved: int
    items: int
    item_name: str
    baseline: str = "torch-eager"
    ceiling: Literal["d2d", "h2d"] = "d2d"
    graph: bool = False
    graph_impls: tuple[str, ...] | None = None
    requires_cuda: bool = True
    tuning: Tuning | None = None

    @property
    def group(self) -> str:
        """The operation (``"hash"``, ``"lookup"``, ``"gate"``, ...): the name's first part."""
        return self.name.partition("/")[0]

    def timed_in_graph(self, impl: str) -> bool:
        """Whether implementation ``impl`` is also timed under CUDA-graph replay."""
        if not self.graph:
            return False
        if self.graph_impls is None:
            return impl != self.baseline
        return impl in self.graph_impls


@dataclass(frozen=True)
class Tuning:
    """What a case's timings choose: the fastest of ``configs`` becomes the entry for
    ``match`` in the kernel's file (:func:`engramrt.tuning.write_tuned_config`).

    Attributes:
        kernel: the tuned kernel (``"ngram_hash"``, ``"lookup_rows"``, ``"engram_gate"``).
        key_fields: the fields of that kernel's lookup key.
        match: the entry's key fields (``{"num_tokens": {"max": 1024}}``).
        configs: implementation name -> the config it launches with.
        metric: the timing that ranks them (``"graph_us"``, ``"graph_cold_us"``,
            ``"median_us"``; an implementation without it is ranked by ``median_us``).
        measured: where BENCHMARKS.md shows such runs.
    """

    kernel: str
    key_fields: tuple[str, ...]
    match: dict[str, Any]
    configs: dict[str, Any]
    metric: str = "graph_us"
    measured: str = "BENCHMARKS.md"


CaseFactory = Callable[[bool], Iterable[Case]]
_FACTORIES: list[CaseFactory] = []


def register(factory: CaseFactory) -> CaseFactory:
    """Decorator: ``factory(quick)`` yields the cases of one operation."""
    _FACTORIES.append(factory)
    return factory


def all_cases(quick: bool = False, groups: Iterable[str] | None = None) -> list[Case]:
    """Every registered case, optionally only those of some groups."""
    import importlib
    import pkgutil

    import engramrt.bench as pkg

    groups = list(groups) if groups is not None else None
    modules = [
        info.name for info in pkgutil.iter_modules(pkg.__path__) if info.name.startswith("cases_")
    ]
    for name in modules:
        if groups is None or name.removeprefix("cases_") in groups:
            importlib.import_module(f"engramrt.bench.{name}")
    wanted = set(groups) if groups is not None else None
    cases: list[Case] = []
    for factory in _FACTORIES:
        for case in factory(quick):
            if wanted is None or case.group in wanted:
                cases.append(case)
    return cases


def table_params(num_rows: int, E: int, cols: int) -> dict[str, Any]:
    """The ``params`` entries that describe the packed table a case reads: hash columns
    ``C``, values per row ``E`` and the table's size in GiB (``num_rows`` packed rows)."""
    return {"C": cols, "E": E, "table_GiB": round(num_rows * row_bytes_for(E) / 2**30, 2)}


def assert_same_bits(label: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """Raise ``AssertionError`` unless integer tensors ``got`` and ``expected``
    (bits viewed as int16 or uint8) are equal, naming ``label``, the count of
    elements that differ and the first eight in hex."""
    if got.shape != expected.shape:
        raise AssertionError(f"{label}: shape {tuple(got.shape)} != {tuple(expected.shape)}")
    bad = (got != expected).nonzero()
    if bad.numel() == 0:
        return
    mask = (1 << (8 * got.element_size())) - 1
    width = 2 + 2 * got.element_size()

    def hex_at(tensor: torch.Tensor, index: list[int]) -> str:
        return f"{int(tensor[tuple(index)]) & mask:#0{width}x}"

    first = ", ".join(
        f"{tuple(i)}: {hex_at(got, i)} != {hex_at(expected, i)}" for i in bad[:8].tolist()
    )
    raise AssertionError(f"{label}: {bad.shape[0]} values differ; first {first}")


def bf16_bits_check(baseline: str) -> Callable[[Inputs, dict[str, Any]], None]:
    """A case's ``check``: every implementation's bf16 output has the bits of ``baseline``'s."""

    def check(inputs: Inputs, outputs: dict[str, Any]) -> None:
        expected = outputs[baseline].view(torch.int16)
        for name, actual in outputs.items():
            if name != baseline:
                assert_same_bits(f"{name} vs {baseline}", actual.view(torch.int16), expected)

    return check
