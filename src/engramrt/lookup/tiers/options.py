"""Each tier's settings as one frozen value, checked when it is made.

A tier's options class names the tier it configures (its ``tier``
attribute, torchao's config-per-method): :class:`~.host_gather.HostOptions`
configures tier ``"host"``, and passing one where a placement is asked for
says both which tier and how. The store class of a tier names its options
class (``RowStore.options_type``) and :func:`~.base.register_tier` checks
that the two agree, so the registry holds each tier beside its settings.

The classes here are the settings every tier shares; each tier's own class
lives in the tier's module.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from engramrt.errors import ValidationError
from engramrt.lookup.settings import LookupKernelConfig, check_kernel_config

__all__ = ["BACKENDS", "KernelTierOptions", "TierOptions"]

BACKENDS = ("auto", "triton", "reference")
"""The lookup backends a tier may be asked for."""


def _field_error(options: object, name: str, value: Any, expected: str) -> ValidationError:
    return ValidationError(f"{type(options).__name__}.{name} = {value!r}; expected {expected}")


@dataclass(frozen=True)
class TierOptions:
    """Settings every tier takes: the checks a store runs on each lookup.

    Attributes:
        validate: check every batch's shapes, dtypes and devices on the host
            (never synchronises; on by default).
        check_ids: check every batch's owned ids against the shard (one host
            synchronisation per call); off on the hot path, where an id
            outside the shard reads as a row of zeros on the kernel tiers.
    """

    tier: ClassVar[str] = ""
    """The tier these options configure (set by each tier's own class)."""

    validate: bool = True
    check_ids: bool = False

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.type in ("bool", bool) and not isinstance(value, bool):
                raise _field_error(self, item.name, value, "True or False")
        self._check()

    def _check(self) -> None:
        """A tier's own checks of its fields (each error names field, value, expectation)."""

    def error(self, name: str, expected: str) -> ValidationError:
        """The error for field ``name``: its value and what was ``expected``."""
        return _field_error(self, name, getattr(self, name), expected)


@dataclass(frozen=True)
class KernelTierOptions(TierOptions):
    """Settings of the tiers whose lookups run the lookup kernel (or its reference).

    Attributes:
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        kernel: the lookup kernel's settings (see :class:`LookupKernelConfig`);
            None: the tier's tuned settings on the store's device.
    """

    backends: ClassVar[tuple[str, ...]] = BACKENDS
    backend: str = "auto"
    kernel: LookupKernelConfig | None = None

    def _check(self) -> None:
        if self.backend not in self.backends:
            raise self.error("backend", " or ".join(repr(b) for b in self.backends))
        if self.kernel is not None:
            check_kernel_config(self.kernel)


def check_int(options: TierOptions, name: str, minimum: int, *, optional: bool = False) -> None:
    """Refuse field ``name`` unless it is an int >= ``minimum`` (or None when ``optional``)."""
    value = getattr(options, name)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise options.error(name, f"an int >= {minimum}" + (" or None" if optional else ""))
