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
checkpoint loader and the shared-table stores to find, beside its settings
(a frozen :class:`~engramrt.lookup.tiers.options.TierOptions` subclass,
:attr:`RowStore.options_type`, whose ``tier`` names the same tier).

Rows come in any :class:`~engramrt.family.RowFormat` (``row_format``, DeepSeek's
fp8 + ue8m0 by default): what a tier stores and moves (:meth:`RowStore.write_rows`,
:meth:`RowStore.gather_packed`) is ``row_bytes`` opaque bytes per row, copied
bit for bit whatever they encode. :meth:`RowStore.lookup` dequantises, and so
serves fp8 rows only; a store of another format refuses it and is read through
:meth:`RowStore.gather_packed`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, TypeVar

import torch

from engramrt._device import resolve_device
from engramrt.errors import ValidationError
from engramrt.family import FP8_UE8M0, ROW_FORMATS, RowFormat
from engramrt.lookup import check_lookup_args, check_row_ids_in_shard
from engramrt.lookup.mapped import MappedHostRows, lookup_mapped_rows
from engramrt.lookup.settings import check_kernel_config, tuned_lookup_config
from engramrt.lookup.tiers.host_rows import HostRows, PrivateHostRows
from engramrt.lookup.tiers.options import KernelTierOptions, TierOptions
from engramrt.quant import check_row_width
from engramrt.source import RowSource

__all__ = [
    "TIERS",
    "KernelRowStore",
    "RowStore",
    "register_tier",
    "row_bytes_of",
    "tier_class",
]

TIERS: dict[str, type[RowStore]] = {}
"""Every registered tier, by name (see :func:`register_tier`)."""

_Store = TypeVar("_Store", bound="type[RowStore]")


def register_tier(cls: _Store) -> _Store:
    """Class decorator: register a :class:`RowStore` subclass under its ``tier`` name,
    beside its options class (``options_type``, which must name the same tier)."""
    name = cls.__dict__.get("tier")
    if not isinstance(name, str) or not name or name == "auto":
        raise ValidationError(
            f"{cls.__name__}.tier = {name!r}; expected the tier's own name (not 'auto')"
        )
    options_type = cls.__dict__.get("options_type")
    if not (isinstance(options_type, type) and issubclass(options_type, TierOptions)) or (
        options_type.__dict__.get("tier") != name
    ):
        raise ValidationError(
            f"{cls.__name__}.options_type = {options_type!r}; expected its own TierOptions "
            f"subclass whose tier is {name!r}"
        )
    if TIERS.get(name, cls) is not cls:
        raise ValidationError(
            f"tier {name!r} of {cls.__name__} is already registered by {TIERS[name].__name__}; "
            f"expected a new name"
        )
    TIERS[name] = cls
    return cls


def tier_class(name: str) -> type[RowStore]:
    """The registered class of tier ``name`` (its settings: ``tier_class(name).options_type``);
    the error lists the tiers there are."""
    cls = TIERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValidationError(
            f"tier = {name!r}; expected 'auto' or one of {', '.join(sorted(TIERS))}"
        )
    return cls


def row_bytes_of(row_format: RowFormat, E: int) -> int:
    """Bytes of one stored row of ``E`` values in ``row_format``, both checked (the one
    place a store's row size comes from)."""
    if not isinstance(row_format, RowFormat):
        raise ValidationError(
            f"row_format = {row_format!r}; expected a RowFormat (one of {', '.join(ROW_FORMATS)})"
        )
    if row_format == FP8_UE8M0:
        check_row_width("E", E)  # the message every fp8 table has given
    return row_format.row_bytes(E)


class RowStore(RowSource):
    """Table rows in one kind of memory, served through :meth:`lookup` (fp8 rows) and
    :meth:`gather_packed` (any format).

    Args:
        num_rows, E: rows held and values per row.
        options: the tier's settings, an instance of :attr:`options_type`
            (None: its defaults).
        device: where :meth:`lookup` writes its output (the compute device;
            default: the current CUDA device, else the CPU).
        row_begin, col_begin, col_end: the shard (see the attributes).
        host_rows: rows that already live in host memory, served without a
            copy (a :class:`~engramrt.lookup.tiers.host_rows.HostRows`); only
            for tiers that take them (:attr:`takes_host_rows`; default: their
            own allocation).
        row_format: how a row is stored (:data:`~engramrt.family.FP8_UE8M0`,
            DeepSeek Engram's, or :data:`~engramrt.family.BF16`); a tier of
            :attr:`row_formats` only.

    Attributes:
        tier: the tier's name (``"device"``, ``"uva"``, ``"host"``, ``"disk"``).
        options: the tier's settings, as given.
        num_rows: rows held (``row_end - row_begin``).
        E: values per row.
        row_format: how a row is stored; ``row_bytes = row_format.row_bytes(E)``
            bytes per row (``E + E/32`` for fp8, ``2 * E`` for bf16).
        row_begin, row_end: the global row ids held, ``[row_begin, row_end)``.
        col_begin, col_end: the hash columns served; ``col_end=None`` means
            "up to the last column of each batch". Other columns read as 0.
        device: the compute device.
        validate, check_ids: see :class:`~engramrt.lookup.tiers.options.TierOptions`
            (read at every lookup).
    """

    tier: ClassVar[str]
    options_type: ClassVar[type[TierOptions]] = TierOptions
    """The tier's settings class (its ``tier`` is this tier's name)."""
    takes_host_rows: ClassVar[bool] = False
    """Whether the constructor takes ``host_rows=``: rows that already live in host
    memory, served without a copy (the shared-table stores)."""
    row_formats: ClassVar[tuple[RowFormat, ...] | None] = None
    """The row formats the tier can hold; None: any (its rows are bytes it moves)."""

    def __init__(
        self,
        num_rows: int,
        E: int,
        options: TierOptions | None = None,
        *,
        device: torch.device | str | None = None,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        host_rows: HostRows | None = None,
        row_format: RowFormat = FP8_UE8M0,
    ) -> None:
        row_bytes = row_bytes_of(row_format, E)
        if self.row_formats is not None and row_format not in self.row_formats:
            held = ", ".join(f.name for f in self.row_formats)
            raise ValidationError(
                f"row_format = {row_format.name!r} for tier={self.tier!r}; expected one it "
                f"can hold ({held})"
            )
        if host_rows is not None and not self.takes_host_rows:
            takers = ", ".join(sorted(name for name, cls in TIERS.items() if cls.takes_host_rows))
            raise ValidationError(
                f"host_rows = {host_rows!r} for tier={self.tier!r}; expected a tier that serves "
                f"rows it does not allocate ({takers})"
            )
        self.host_rows = host_rows or self._own_host_rows()
        if options is None:
            options = self.options_type()
        elif type(options) is not self.options_type:
            raise ValidationError(
                f"options = {options!r} for {type(self).__name__}; expected "
                f"{self.options_type.__name__} (tier={self.tier!r})"
            )
        if num_rows < 0:
            raise ValidationError(f"num_rows = {num_rows}; expected >= 0")
        if row_begin < 0:
            raise ValidationError(f"row_begin = {row_begin}; expected >= 0")
        if col_begin < 0 or (col_end is not None and col_end < col_begin):
            raise ValidationError(
                f"columns [col_begin, col_end) = [{col_begin}, {col_end}); expected "
                f"0 <= col_begin <= col_end"
            )
        self.options = options
        self.num_rows = int(num_rows)
        self.E = int(E)
        self.row_format = row_format
        self.row_bytes = row_bytes
        self._dequantises = row_format == FP8_UE8M0  # what lookup()'s kernels read
        self.row_begin = int(row_begin)
        self.col_begin = int(col_begin)
        self.col_end = None if col_end is None else int(col_end)
        self.device = resolve_device(device)
        self.validate = options.validate
        self.check_ids = options.check_ids
        self._setup()

    def _setup(self) -> None:
        """The tier's own construction, once the common attributes are set (allocate, map)."""

    def _own_host_rows(self) -> HostRows:
        """Where a host-memory tier's rows live when none are injected: a private allocation
        of exactly the rows' bytes (a file-backed tier maps its file)."""
        return PrivateHostRows()

    @classmethod
    def build(
        cls,
        num_rows: int | None,
        E: int,
        options: TierOptions,
        *,
        path: Any = None,
        new_file: bool = False,
        device: torch.device,
        row_begin: int = 0,
        col_begin: int = 0,
        col_end: int | None = None,
        row_format: RowFormat = FP8_UE8M0,
    ) -> RowStore:
        """The store ``make_store`` asks for: ``num_rows`` rows of ``E`` values in
        ``row_format`` on ``device``, serving the shard ``row_begin``, ``col_begin``,
        ``col_end``. ``path`` and ``new_file`` concern tiers that keep rows in a file (their
        :meth:`_build` takes them); the others ignore them."""
        shard = {
            "device": device,
            "row_begin": row_begin,
            "col_begin": col_begin,
            "col_end": col_end,
            "row_format": row_format,
        }
        return cls._build(num_rows, E, options, path, new_file, shard)

    @classmethod
    def _build(
        cls,
        num_rows: int | None,
        E: int,
        options: TierOptions,
        path: Any,
        new_file: bool,
        shard: dict[str, Any],
    ) -> RowStore:
        """The tier's part of :meth:`build`: its constructor, given the shard's keywords
        (``device``, ``row_begin``, ``col_begin``, ``col_end``) and ``row_format``. A tier
        whose constructor takes more (a file) overrides this."""
        if num_rows is None:
            raise ValidationError(
                f"num_rows = None for tier={cls.tier!r}; expected the rows to hold"
            )
        return cls(num_rows, E, options, **shard)

    def flush(self) -> None:
        """Make written rows durable (a file-backed tier); nothing to do elsewhere."""

    @property
    def row_end(self) -> int:
        return self.row_begin + self.num_rows

    @property
    def nbytes(self) -> int:
        """Bytes of rows held (``num_rows * row_bytes``)."""
        return self.num_rows * self.row_bytes

    def lookup(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, C]`` int32/int64 global row ids -> ``[T, C, E]`` bf16 on :attr:`device`.

        Columns outside ``[col_begin, col_end)`` are zeros. ``out``, when
        given, is a contiguous ``[T, C, E]`` bf16 tensor on :attr:`device`.
        The one place a store checks its inputs (:attr:`validate`,
        :attr:`check_ids`); the tier's work below does not check again.
        Rows are dequantised from fp8: a store of another :attr:`row_format`
        refuses (whatever :attr:`validate` says) and is read with
        :meth:`gather_packed`.
        """
        if not self._dequantises:
            raise ValidationError(
                f"lookup() on {type(self).__name__} (tier={self.tier!r}) of "
                f"{self.row_format.describe(self.E)}; the lookup kernel dequantises "
                f"{FP8_UE8M0.name} rows: expected a store of row_format=FP8_UE8M0, or read "
                f"these rows with gather_packed()"
            )
        col_end = self._checked(row_ids, out)
        return self._lookup(row_ids, col_end, out)

    def _checked(self, row_ids: torch.Tensor, out: torch.Tensor | None) -> int:
        """The end of the hash columns served, after the checks :attr:`validate` and
        :attr:`check_ids` ask for (the one place a store checks its inputs)."""
        if self.validate:
            col_end = check_lookup_args(
                row_ids, self.col_begin, self.col_end, E=self.E, device=self.device, out=out
            )
        else:
            col_end = row_ids.shape[1] if self.col_end is None else self.col_end
        if self.check_ids:
            check_row_ids_in_shard(row_ids, self.col_begin, col_end, self.row_begin, self.row_end)
        return col_end

    @abstractmethod
    def _lookup(
        self, row_ids: torch.Tensor, col_end: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The tier's lookup, arguments already checked."""

    def served_columns(self, num_cols: int) -> tuple[int, int]:
        return self.col_begin, num_cols if self.col_end is None else min(self.col_end, num_cols)

    def fetch(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A store's rows for a step (the :class:`RowSource` contract): its :meth:`lookup`
        for fp8 rows; bf16 rows, which need no dequantising, gathered as they are stored
        (:meth:`gather_packed`). The same arguments and checks as :meth:`lookup`."""
        if self._dequantises:
            return self.lookup(row_ids, out)
        col_end = self._checked(row_ids, out)
        num_tokens, num_cols = row_ids.shape
        if out is None:
            out = torch.empty(
                (num_tokens, num_cols, self.E), dtype=torch.bfloat16, device=self.device
            )
        served = slice(self.col_begin, col_end)
        local = row_ids[:, served].to(self.device, torch.int64, non_blocking=True) - self.row_begin
        rows = self.gather_packed(local.reshape(-1)).view(torch.bfloat16)
        if (self.col_begin, col_end) != (0, num_cols):
            out.zero_()  # columns this store does not serve
        out[:, served] = rows.view(num_tokens, col_end - self.col_begin, self.E)
        return out

    def device_rows(self) -> Any:
        """The stored rows ``[num_rows, row_bytes]`` as the compute device's kernels can read
        them in place (local row ``i`` at byte ``i * row_bytes``): a device tensor, or host
        memory mapped for the device (an object with ``data_ptr()`` and ``dtype`` uint8).
        None when kernels cannot read them (the CPU gathers them, or there are none)."""
        return None

    def gather_packed(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[U, row_bytes]`` uint8 on :attr:`device` of local ids ``[U]`` int64.

        Local ids are ``row_id - row_begin``, each in ``[0, num_rows)``. The
        bytes as written, in any :attr:`row_format`: for consumers that keep or
        move rows themselves (a row cache), and the way to read rows that
        :meth:`lookup` does not dequantise (bf16). One trip per row.
        """
        raise ValidationError(
            f"{type(self).__name__} (tier={self.tier!r}) offers no packed rows; expected a "
            f"tier that stores them"
        )

    @abstractmethod
    def _write(self, start: int, packed: torch.Tensor) -> None:
        """Copy ``packed [n, row_bytes]`` (CPU or device) into local rows ``[start, start + n)``."""

    def write_rows(self, start: int, packed: torch.Tensor) -> None:
        """Fill local rows ``[start, start + n)`` from stored rows ``[n, row_bytes]`` uint8
        (fp8 rows packed, bf16 rows viewed as bytes: ``rows.view(torch.uint8)``).

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
            raise ValidationError(
                f"packed is {found}; expected uint8 [n, {self.row_bytes}] "
                f"({self.row_format.describe(self.E)})"
            )
        if not 0 <= start <= start + packed.shape[0] <= self.num_rows:
            raise ValidationError(
                f"rows [{start}, {start + packed.shape[0]}) to write; expected a range inside "
                f"[0, {self.num_rows}) (local rows of this store)"
            )
        self._write(start, packed)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tier={self.tier!r}, rows=[{self.row_begin}, {self.row_end}), "
            f"cols=[{self.col_begin}, {self.col_end}), E={self.E}, "
            f"row_format={self.row_format.name!r}, nbytes={self.nbytes}, "
            f"device={self.device})"
        )


class KernelRowStore(RowStore):
    """A store whose lookups run the lookup kernel (or its reference) over its rows.

    Its options are a :class:`~engramrt.lookup.tiers.options.KernelTierOptions`
    (``backend``; ``kernel``, None: the tier's tuned settings on the store's
    device, :func:`~engramrt.lookup.settings.tuned_lookup_config`). The
    attributes :attr:`backend` and :attr:`kernel` are read at every lookup.
    """

    options_type: ClassVar[type[TierOptions]] = KernelTierOptions

    def _setup(self) -> None:
        options = self.options
        assert isinstance(options, KernelTierOptions)
        self.backend = options.backend
        kernel = options.kernel
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
