"""A low-overhead launcher for Triton kernels called every engine step.

``kernel[grid](...)`` binds and specialises every argument in Python on each
call, which costs tens of microseconds for a kernel with ~30 arguments — more
than the kernel itself for a decode step. :class:`CachedLauncher` goes
through ``kernel[grid]`` once per specialisation, keeps the compiled kernel,
and afterwards calls its launcher directly.

A specialisation is keyed by the constexpr values, the dtype and 16-byte
alignment of every tensor argument, and, for integer arguments that Triton
specialises (the value 1, divisibility by 16), those properties: a later
call whose arguments would have compiled differently compiles its own.
Under ``TRITON_INTERPRET=1`` it simply calls ``kernel[grid]``.
"""

from __future__ import annotations

from typing import Any

import torch

from engramrt._backend import interpreter_enabled

__all__ = ["CachedLauncher"]


def _arg_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value == 1, value % 16 == 0, -(2**31) <= value < 2**31)
    return ("o", type(value))


class CachedLauncher:
    """Launch ``kernel`` with positional runtime args and keyword constexprs."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[Any, Any] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        if interpreter_enabled():
            self.kernel[grid](*args, **constexprs)
            return
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        key = (device.index, tuple(sorted(constexprs.items())), tuple(_arg_key(a) for a in args))
        compiled = self._compiled.get(key)
        if compiled is None:
            with torch.cuda.device(device):
                compiled = self.kernel[grid](*args, **constexprs)
            self._compiled[key] = compiled
            return
        from triton import knobs

        stream = torch.cuda.current_stream(device).cuda_stream
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        # All parameters in declaration order: runtime args, then constexprs
        # (the compiled launcher skips the constexprs).
        values = [*args, *(constexprs[name] for name in self._constexpr_names(len(args)))]
        metadata = compiled.launch_metadata(grid, stream, *values) if enter or leave else None
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0],
            grid_y,
            grid_z,
            stream,
            compiled.function,
            compiled.packed_metadata,
            metadata,
            enter,
            leave,
            *values,
        )

    def _constexpr_names(self, n_args: int) -> list[str]:
        names = getattr(self, "_names", None)
        if names is None:
            params = self.kernel.params
            if not all(p.is_constexpr for p in params[n_args:]) or any(
                p.is_constexpr for p in params[:n_args]
            ):
                raise TypeError(
                    f"{self.kernel.__name__}: CachedLauncher needs every runtime argument before "
                    "the constexprs, passed positionally"
                )
            names = [p.name for p in params[n_args:]]
            self._names = names
        return names
