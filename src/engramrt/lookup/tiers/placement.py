"""Where a rank's Engram tables live, as one value: :class:`TablePlacement`.

Every loader (``make_store``, the checkpoint loaders, the engine-style
``EngramWeightLoader``, the shared host tables, the synthetic stores, the
tiny model) takes one placement whole: the tier and its settings, the
compute device, the tensor-parallel rank whose hash columns the tables
serve, and the directory of file-backed tiers. ``tier="auto"`` is resolved
here, in :meth:`TablePlacement.tier_options`, and nowhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engramrt import memory
from engramrt._device import check_device, resolve_device
from engramrt.errors import CapacityError, ValidationError
from engramrt.layout import ColumnShard, EngramLayout
from engramrt.lookup.tiers.base import tier_class
from engramrt.lookup.tiers.options import TierOptions

__all__ = ["AUTO_DEVICE_HEADROOM_BYTES", "TablePlacement", "check_placement", "choose_tier"]

AUTO_DEVICE_HEADROOM_BYTES = 8 * 2**30
"""Device memory ``tier="auto"`` leaves free for weights and activations."""


def choose_tier(nbytes: int, device: torch.device, path: str | os.PathLike[str] | None) -> str:
    """The tier ``"auto"`` resolves to for a table of ``nbytes`` served on ``device``.

    Device memory when it fits with :data:`AUTO_DEVICE_HEADROOM_BYTES` to
    spare (on a CPU device: when host memory fits), then host memory, then
    the file at ``path``. UVA is never chosen: its random PCIe reads were
    measured slower than the host tier's gather + bulk copy.
    """
    host = memory.host_available_bytes()
    if device.type == "cuda":
        free = memory.device_free_bytes(device)
        if nbytes + AUTO_DEVICE_HEADROOM_BYTES <= free:
            return "device"
        if nbytes <= host:
            return "host"
    elif nbytes <= host:
        return "device"
    if path is not None:
        return "disk"
    device_note = (
        f"{device} has {memory.format_bytes(memory.device_free_bytes(device))} free "
        f"(keeping {memory.format_bytes(AUTO_DEVICE_HEADROOM_BYTES)} spare), "
        if device.type == "cuda"
        else ""
    )
    raise CapacityError(
        f"tier='auto' needs {memory.format_bytes(nbytes)} for the table but {device_note}host "
        f"memory has {memory.format_bytes(host)} available and no path was given for tier='disk'"
    )


@dataclass(frozen=True)
class TablePlacement:
    """Where a rank's Engram tables live and how they are served.

    Attributes:
        tier: ``"auto"`` (see :func:`choose_tier`), a tier's name (its default
            settings) or a tier's settings, e.g. ``HostOptions(chunk_rows=4096)``
            (the settings say which tier they configure).
        device: the compute device lookups write to: ``cpu``, ``cuda`` or
            ``cuda:N`` that this process can see (None: the current CUDA device
            when there is one, else the CPU); anything else (``"tpu"``,
            ``"meta"``, ``5``, a GPU this machine lacks) is refused when the
            placement is made (:func:`engramrt._device.check_device`).
        tp, rank: the tensor-parallel rank whose hash columns the tables serve
            (SPEC §7); each layer's rows are :meth:`shard`. ``tp=1``: whole tables.
        disk_dir: where a file-backed tier (``"disk"``, or ``"auto"`` falling
            back to it) writes each layer's packed rows, one file per layer
            and rank (:meth:`disk_path`). A directory the file system refuses
            (read-only, no permission, a file in the way, full) is one
            ``ValidationError`` (``CapacityError`` when full) naming the file,
            raised by the load.

    Example::

        TablePlacement(HostOptions(num_threads=8), device="cuda:0", tp=4, rank=1)
    """

    tier: str | TierOptions = "auto"
    device: torch.device | str | None = None
    tp: int = 1
    rank: int = 0
    disk_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tier, str):
            if self.tier != "auto":
                tier_class(self.tier)  # the error lists the tiers there are
        elif not isinstance(self.tier, TierOptions) or not self.tier.tier:
            raise ValidationError(
                f"TablePlacement.tier = {self.tier!r}; expected 'auto', a tier's name or a "
                f"tier's options (e.g. HostOptions())"
            )
        if self.device is not None:
            object.__setattr__(self, "device", check_device("TablePlacement.device", self.device))
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValidationError(f"TablePlacement.tp = {self.tp!r}; expected an int >= 1")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValidationError(f"TablePlacement.rank = {self.rank!r}; expected an int")
        if not 0 <= self.rank < self.tp:
            raise ValidationError(
                f"TablePlacement.rank = {self.rank}; expected 0 <= rank < tp = {self.tp}"
            )
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)) or self.disk_dir == "":
                raise ValidationError(
                    f"TablePlacement.disk_dir = {self.disk_dir!r}; expected None or a "
                    f"directory path (str or os.PathLike)"
                )
            object.__setattr__(self, "disk_dir", Path(self.disk_dir))

    @property
    def tier_name(self) -> str:
        """``"auto"`` or the tier's name."""
        return self.tier if isinstance(self.tier, str) else self.tier.tier

    @property
    def compute_device(self) -> torch.device:
        """:attr:`device` with an index (``"cuda"`` is the current CUDA device), or the
        default compute device when it is None (:func:`engramrt._device.resolve_device`)."""
        return resolve_device(self.device)

    def tier_options(
        self, nbytes: int | None, path: str | os.PathLike[str] | None = None
    ) -> TierOptions:
        """The settings of the tier that holds a table of ``nbytes`` (``"auto"`` resolved:
        the one place it is). ``nbytes=None`` (a size only the file knows) resolves
        ``"auto"`` to the file at ``path``."""
        if isinstance(self.tier, TierOptions):
            return self.tier
        name = self.tier
        if name == "auto":
            name = "disk" if nbytes is None else choose_tier(nbytes, self.compute_device, path)
        return tier_class(name).options_type()

    def shard(self, layout: EngramLayout, layer_index: int) -> ColumnShard:
        """This rank's columns and rows of layer ``layer_index`` (see
        :meth:`EngramLayout.column_shard`)."""
        return layout.column_shard(layer_index, self.tp, self.rank)

    def disk_path(self, layer_id: int) -> Path | None:
        """``<disk_dir>/engram-layer<id>-rank<r>-of-<tp>.rows``, or None without a directory."""
        if self.disk_dir is None:
            return None
        return Path(self.disk_dir) / f"engram-layer{layer_id}-rank{self.rank}-of-{self.tp}.rows"

    def check_shard(self, shard: ColumnShard) -> None:
        """Refuse a shard of another rank than this placement's."""
        if (shard.tp, shard.rank) != (self.tp, self.rank):
            raise ValidationError(
                f"shard is rank {shard.rank} of tp={shard.tp}; expected the placement's rank "
                f"{self.rank} of tp={self.tp}"
            )


def check_placement(placement: object, example: str) -> TablePlacement:
    """``placement`` when it is a :class:`TablePlacement` (None: the default one); else the
    error naming what was given and showing ``example``, a call that passes one."""
    if placement is None:
        return TablePlacement()
    if not isinstance(placement, TablePlacement):
        raise ValidationError(
            f"placement = {placement!r}; expected a TablePlacement, e.g. {example}"
        )
    return placement
