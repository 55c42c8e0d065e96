"""A low-overhead launcher for Triton kernels called every engine step.

``kernel[grid](...)`` binds and specialises every argument in Python on each
call, which costs tens of microseconds for a kernel with ~30 arguments — more
than the kernel itself for a decode step. :class:`CachedLauncher` goes
through ``kernel[grid]`` once per specialisation, keeps the compiled kernel,
and afterwards calls its launcher directly.

A specialisation is keyed by the device, the constexpr values and, for each
argument, what Triton specialises on: a tensor's dtype (and its 16-byte
alignment unless the kernel lists it in ``do_not_specialize_on_alignment``;
likewise any object with ``data_ptr()`` and ``dtype``, such as host memory
mapped for the device, which is passed on as the object),
an integer's width (and the value 1 / divisibility by 16 unless listed in
``do_not_specialize``). A call whose arguments would compile differently
compiles its own. Kernels on hot paths list all their runtime arguments as
unspecialised, so the key is cheap. Under ``TRITON_INTERPRET=1`` this simply
calls ``kernel[grid]``.
"""

from __future__ import annotations

from typing import Any

import torch

from engramrt._backend import interpreter_enabled

__all__ = ["CachedLauncher", "next_pow2"]


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (2 for ``n`` = 0): a Triton block size
    covering ``n`` elements."""
    return 1 << max(0, (n - 1).bit_length())


def _raw_stream(device_index: int) -> int:
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return int(getter(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


class CachedLauncher:
    """Launch ``kernel`` with positional runtime args and keyword constexprs.

    Runtime arguments must come before the constexprs in the kernel's
    signature and be passed positionally, constexprs by keyword.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[Any, Any] = {}
        self._layout: tuple[list[str], list[tuple[bool, bool]]] | None = None
        self._knobs: Any = None

    def _signature(self, n_args: int) -> tuple[list[str], list[tuple[bool, bool]]]:
        """(constexpr names, per runtime arg: keyed on alignment, keyed on value)."""
        if self._layout is None:
            params = self.kernel.params
            if any(p.is_constexpr for p in params[:n_args]) or not all(
                p.is_constexpr for p in params[n_args:]
            ):
                raise TypeError(
                    f"{self.kernel.__name__}: CachedLauncher needs every runtime argument "
                    "before the constexprs, passed positionally"
                )
            names = [p.name for p in params[n_args:]]
            flags = [
                (not p.do_not_specialize_on_alignment, not p.do_not_specialize)
                for p in params[:n_args]
            ]
            self._layout = (names, flags)
        return self._layout

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        if interpreter_enabled():
            self.kernel[grid](*args, **constexprs)
            return
        names, flags = self._signature(len(args))
        first = args[0]
        device = first.device if isinstance(first, torch.Tensor) else _first_device(args)
        index = device.index if device.index is not None else torch.cuda.current_device()
        # One pass builds the specialisation key and the launcher's values;
        # tensors go to the compiled launcher as raw addresses (it accepts
        # ints), so each data_ptr() is read once, here.
        values: list[Any] = []
        key_parts: list[Any] = [index, *constexprs.values()]
        for a, (by_alignment, by_value) in zip(args, flags, strict=True):
            if isinstance(a, torch.Tensor):
                ptr = a.data_ptr()
                values.append(ptr)
                key_parts.append(a.dtype)
                if by_alignment:
                    key_parts.append(ptr % 16 == 0)
            elif hasattr(a, "data_ptr"):
                # A pointer object (host memory mapped for the device): the
                # compiled launcher resolves its device address itself.
                values.append(a)
                key_parts.append(a.dtype)
                if by_alignment:
                    key_parts.append(a.data_ptr() % 16 == 0)
            else:
                values.append(a)
                key_parts.append(-(2**31) <= a < 2**31)
                if by_value:
                    key_parts.append((a == 1, a % 16 == 0))
        key = tuple(key_parts)
        compiled = self._compiled.get(key)
        if compiled is None:
            with torch.cuda.device(index):
                self._compiled[key] = self.kernel[grid](*args, **constexprs)
            return
        knobs = self._knobs
        if knobs is None:
            from triton import knobs as triton_knobs

            knobs = self._knobs = triton_knobs
        stream = _raw_stream(index)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        # All parameters in declaration order; the compiled launcher skips constexprs.
        tail = [constexprs[name] for name in names]
        values.extend(tail)
        metadata = None
        if _hooked(enter) or _hooked(leave):  # profiler hooks see the tensors themselves
            metadata = compiled.launch_metadata(grid, stream, *args, *tail)
        else:  # Triton always installs (empty) hook chains: skip two Python calls
            enter = leave = None
        compiled.run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            metadata,
            enter,
            leave,
            *values,
        )


def _hooked(hook: Any) -> bool:
    """True for a launch hook that would do something (not None, not an empty chain)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _first_device(args: tuple[Any, ...]) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))
