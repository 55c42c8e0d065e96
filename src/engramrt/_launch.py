"""A low-overhead launcher for Triton kernels called every engine step.

``kernel[grid](...)`` binds and specialises every argument in Python on each
call, which costs tens of microseconds for a kernel with ~30 arguments — more
than the kernel itself for a decode step. :class:`CachedLauncher` goes
through ``kernel[grid]`` once per specialisation, keeps the compiled kernel,
and afterwards calls its launcher directly.

A specialisation is keyed by the device, the constexpr values and, for each
argument, what Triton specialises on: a tensor's dtype (and its 16-byte
alignment unless the kernel lists it in ``do_not_specialize_on_alignment``),
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

__all__ = ["CachedLauncher"]


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
        self._layout: tuple[list[str], list[int], list[int]] | None = None
        self._knobs: Any = None

    def _signature(self, n_args: int) -> tuple[list[str], list[int], list[int]]:
        """(constexpr names, args keyed on alignment, ints keyed on value)."""
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
            aligned = [
                i for i, p in enumerate(params[:n_args]) if not p.do_not_specialize_on_alignment
            ]
            valued = [i for i, p in enumerate(params[:n_args]) if not p.do_not_specialize]
            self._layout = (names, aligned, valued)
        return self._layout

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        if interpreter_enabled():
            self.kernel[grid](*args, **constexprs)
            return
        names, aligned, valued = self._signature(len(args))
        first = args[0]
        device = first.device if isinstance(first, torch.Tensor) else _first_device(args)
        index = device.index if device.index is not None else torch.cuda.current_device()
        # Tensors go to the compiled launcher as raw addresses (it accepts
        # ints), so each data_ptr() is read once, here.
        values: list[Any] = list(args)
        types: list[Any] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                types.append(a.dtype)
                values[i] = a.data_ptr()
            else:
                types.append(-(2**31) <= a < 2**31)
        key = (
            index,
            tuple(constexprs.values()),
            tuple(types),
            tuple([values[i] % 16 == 0 for i in aligned if isinstance(args[i], torch.Tensor)]),
            tuple([(args[i] == 1, args[i] % 16 == 0) for i in valued if isinstance(args[i], int)]),
        )
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
        if enter or leave:  # profiler hooks see the tensors themselves
            metadata = compiled.launch_metadata(grid, stream, *args, *tail)
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


def _first_device(args: tuple[Any, ...]) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))
