"""The one interface every storage tier implements.

A :class:`RowStore` holds the packed rows ``[row_begin, row_end)`` of one
layer's table (a whole table, or a tensor-parallel rank's shard serving the
hash columns ``[col_begin, col_end)``) in some memory, and answers
``lookup(row_ids [T, C]) -> [T, C, E]`` bf16 on its compute device with the
bytes of :func:`engramrt.lookup.reference.lookup_rows_reference`.
Where the rows live, and how they reach the device, is the tier's business;
a new tier is a new file, not an ``if`` in every caller: a :class:`RowStore`
subclass decorated with :func:`register_tier`, which puts it in
:data:`TIERS` under its :attr:`RowStore.tier` name for ``make_store``, the
checkpoint loader and the shared-table stores to find.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from typing import Any, ClassVar, TypeVar

import torch

from engramrt._device import resolve_device
from engramrt.errors import ValidationError
from engramrt.lookup import check_lookup_args, check_row_ids_in_shard
from engramrt.lookup.mapped import MappedHostRows, lookup_mapped_rows
from engramrt.lookup.settings import LookupKernelConfig, check_kernel_config, tuned_lookup_config
from engramrt.packed import row_bytes_for
from engramrt.quant import check_row_width
from engramrt.source import RowSource

__all__ = [
    "TIERS",
    "KernelRowStore",
    "RowStore",
    "register_tier",
    "tier_class",
]

TIERS: dict[str, type[RowStore]] = {}
"""Every registered tier, by name (see :func:`register_tier`)."""

_Store = TypeVar("_Store", bound="type[RowStore]")


def register_tier(cls: _Store) -> _Store:
    """Class decorator: register a :class:`RowStore` subclass under its ``tier`` name."""
    name = cls.__dict__.get("tier")
    if not isinstance(name, str) or not name or name == "auto":
        raise ValidationError(
            f"{cls.__name__}.tier = {name!r}; expected the tier's own name (not 'auto')"
        )
    if TIERS.get(name, cls) is not cls:
        raise ValidationError(
            f"tier {name!r} of {cls.__name__} is already registered by {TIERS[name].__name__}; "
            f"expected a new name"
        )
    TIERS[name] = cls
    return cls


def tier_class(name: str) -> type[RowStore]:
    """The registered class of tier ``name``; the error lists the tiers there are."""
    cls = TIERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValidationError(
            f"tier = {name!r}; expected 'auto' or one of {', '.join(sorted(TIERS))}"
        )
    return cls


class RowStore(RowSource):
    """Packed table rows in one kind of memory, served through :meth:`lookup`.

    Attributes:
        tier: the tier's name (``"device"``, ``"uva"``, ``"host"``, ``"disk"``).
        num_rows: rows held (``row_end - row_begin``).
        E: values per row; ``row_bytes = E + E/32`` bytes per packed row.
        row_begin, row_end: the global row ids held, ``[row_begin, row_end)``.
        col_begin, col_end: the hash columns served; ``col_end=None`` means
            "up to the last column of each batch". Other columns read as 0.
        device: where :meth:`lookup` writes its output (the compute device).
        validate: check every batch's shapes, dtypes and devices on the host
            (never synchronises; on by default).
        check_ids: check every batch's owned ids against the shard (one host
            synchronisation per call); off on the hot path, where an id
            outside the shard reads as a row of zeros on the kernel tiers.

    A subclass's constructor takes ``(num_rows, E, *, <its options>,
    **common)`` and passes ``common`` (the arguments above) on unchanged.
    """

    tier: ClassVar[str]
    set_options: ClassVar[frozenset[str]] = frozenset()
    """Options of a base class that a subclass sets itself (not the caller's)."""

    def __init__(
        self,
        num_rows: int,
        E: int,
        *,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        validate: bool = True,
        check_ids: bool = False,
    ) -> None:
        check_row_width("E", E)
        if num_rows < 0:
            raise ValidationError(f"num_rows = {num_rows}; expected >= 0")
        if row_begin < 0:
            raise ValidationError(f"row_begin = {row_begin}; expected >= 0")
        if col_begin < 0 or (col_end is not None and col_end < col_begin):
            raise ValidationError(
                f"columns [col_begin, col_end) = [{col_begin}, {col_end}); expected "
                f"0 <= col_begin <= col_end"
            )
        self.num_rows = int(num_rows)
        self.E = int(E)
        self.row_bytes = row_bytes_for(self.E)
        self.row_begin = int(row_begin)
        self.col_begin = int(col_begin)
        self.col_end = None if col_end is None else int(col_end)
        self.device = resolve_device(device)
        self.validate = bool(validate)
        self.check_ids = bool(check_ids)

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The keyword arguments this tier's constructor accepts (its own and the
        base classes' it passes on), in order."""
        names: list[str] = []
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            parameters = inspect.signature(init).parameters.values()
            names += [
                p.name
                for p in parameters
                if p.kind == p.KEYWORD_ONLY
                and p.name not in names
                and p.name not in cls.set_options
            ]
            if not any(p.kind == p.VAR_KEYWORD for p in parameters):
                break
        return tuple(names)

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Raise :class:`ValidationError` naming the options this tier does not take."""
        accepted = cls.options()
        unknown = [name for name in options if name not in accepted]
        if unknown:
            raise ValidationError(
                f"option(s) {', '.join(unknown)} for tier={cls.tier!r}; expected some of "
                f"{', '.join(accepted)}"
            )

    @classmethod
    def build(
        cls,
        num_rows: int | None,
        E: int,
        *,
        path: Any = None,
        new_file: bool = False,
        **options: Any,
    ) -> RowStore:
        """The store ``make_store`` asks for: ``num_rows`` rows of ``E`` values, options
        checked against :meth:`options`. ``path`` and ``new_file`` concern tiers that keep
        rows in a file (see :meth:`_create`); the others ignore them."""
        cls.check_options(options)
        return cls._create(num_rows, E, path, new_file, options)

    @classmethod
    def _create(
        cls, num_rows: int | None, E: int, path: Any, new_file: bool, options: dict[str, Any]
    ) -> RowStore:
        """Construct from :meth:`build`'s checked arguments (a file-backed tier overrides)."""
        if num_rows is None:
            raise ValidationError(
                f"num_rows = None for tier={cls.tier!r}; expected the rows to hold"
            )
        return cls(num_rows, E, **options)

    def flush(self) -> None:
        """Make written rows durable (a file-backed tier); nothing to do elsewhere."""

    @property
    def row_end(self) -> int:
        return self.row_begin + self.num_rows

    @property
    def nbytes(self) -> int:
        """Bytes of packed rows held (``num_rows * row_bytes``)."""
        return self.num_rows * self.row_bytes

    def lookup(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, C]`` int32/int64 global row ids -> ``[T, C, E]`` bf16 on :attr:`device`.

        Columns outside ``[col_begin, col_end)`` are zeros. ``out``, when
        given, is a contiguous ``[T, C, E]`` bf16 tensor on :attr:`device`.
        The one place a store checks its inputs (:attr:`validate`,
        :attr:`check_ids`); the tier's work below does not check again.
        """
        if self.validate:
            col_end = check_lookup_args(
                row_ids, self.col_begin, self.col_end, E=self.E, device=self.device, out=out
            )
        else:
            col_end = row_ids.shape[1] if self.col_end is None else self.col_end
        if self.check_ids:
            check_row_ids_in_shard(row_ids, self.col_begin, col_end, self.row_begin, self.row_end)
        return self._lookup(row_ids, col_end, out)

    @abstractmethod
    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The tier's lookup, arguments already checked."""

    def served_columns(self, num_cols: int) -> tuple[int, int]:
        return self.col_begin, num_cols if self.col_end is None else min(self.col_end, num_cols)

    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A store's rows for a step are its :meth:`lookup` (the :class:`RowSource` contract)."""
        return self.lookup(row_ids, out)

    def device_rows(self) -> Any:
        """The packed rows ``[num_rows, row_bytes]`` as the compute device's kernels can read
        them in place (local row ``i`` at byte ``i * row_bytes``): a device tensor, or host
        memory mapped for the device (an object with ``data_ptr()`` and ``dtype`` uint8).
        None when kernels cannot read them (the CPU gathers them, or there are none)."""
        return None

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Packed rows ``[U, row_bytes]`` uint8 on :attr:`device` of local ids ``[U]`` int64.

        Local ids are ``row_id - row_begin``. For consumers that keep or
        move rows themselves (a row cache): one trip per row, no dequantise.
        """
        raise ValidationError(
            f"{type(self).__name__} (tier={self.tier!r}) offers no packed rows; expected a "
            f"tier that stores them"
        )

    @abstractmethod
    def _write(self, start: int, packed: torch.Tensor) -> None:
        """Copy ``packed [n, row_bytes]`` (CPU or device) into local rows ``[start, start + n)``."""

    def write_rows(self, start: int, packed: torch.Tensor) -> None:
        """Fill local rows ``[start, start + n)`` from packed rows ``[n, row_bytes]`` uint8.

        Rows are written in pieces so a checkpoint can stream in without
        holding a whole table twice.
        """
        if (
            not isinstance(packed, torch.Tensor)
            or packed.dtype != torch.uint8
            or packed.dim() != 2
            or packed.shape[1] != self.row_bytes
        ):
            found = (
                f"{packed.dtype} {tuple(packed.shape)}"
                if isinstance(packed, torch.Tensor)
                else type(packed).__name__
            )
            raise ValidationError(f"packed is {found}; expected uint8 [n, {self.row_bytes}]")
        if not 0 <= start <= start + packed.shape[0] <= self.num_rows:
            raise ValidationError(
                f"rows [{start}, {start + packed.shape[0]}) to write; expected a range inside "
                f"[0, {self.num_rows}) (local rows of this store)"
            )
        self._write(start, packed)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tier={self.tier!r}, rows=[{self.row_begin}, {self.row_end}), "
            f"cols=[{self.col_begin}, {self.col_end}), E={self.E}, nbytes={self.nbytes}, "
            f"device={self.device})"
        )


class KernelRowStore(RowStore):
    """A store whose lookups run the lookup kernel (or its reference) over its rows.

    Args:
        num_rows, E: see :class:`RowStore`.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        kernel: the lookup kernel's settings (see :class:`LookupKernelConfig`);
            None: the tier's tuned settings on the store's device
            (:func:`~engramrt.lookup.settings.tuned_lookup_config`). The attribute
            :attr:`kernel` is read at every lookup.
        common: ``device``, ``row_begin``, ``col_begin``, ``col_end``,
            ``validate``, ``check_ids`` (see :class:`RowStore`).
    """

    def __init__(
        self,
        num_rows: int,
        E: int,
        *,
        backend: str = "auto",
        kernel: LookupKernelConfig | None = None,
        **common: Any,
    ) -> None:
        super().__init__(num_rows, E, **common)
        self.backend = backend
        if kernel is None:
            kernel = tuned_lookup_config(self.tier, self.device)
        self.kernel = check_kernel_config(kernel)

    def _read_mapped(
        self, mapped: MappedHostRows, row_ids: torch.Tensor, col_end: int, out: Any
    ) -> torch.Tensor:
        """The lookup kernel over this store's rows in host memory mapped for the device."""
        return lookup_mapped_rows(
            row_ids,
            mapped,
            out,
            E=self.E,
            device=self.device,
            col_begin=self.col_begin,
            col_end=col_end,
            row_begin=self.row_begin,
            kernel=self.kernel,
        )
