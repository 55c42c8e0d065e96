"""Python work that CUDA runs in stream order: ``cuLaunchHostFunc`` over ctypes.

A host function is queued on a stream like a kernel: it runs on a thread of the
CUDA driver once the work queued before it has finished, and the work queued
after it waits for it to return. A lookup that needs the CPU (a gather from host
memory) can then be queued whole, ids' copy to the host, the CPU's gather, the
rows' copy back and the dequantisation, without a host thread that waits for
the device, and it can be captured in a CUDA graph (the function becomes a host
node that every replay calls).

Contract (CUDA's, and the interpreter's):

- the function must make no CUDA call: it reads and writes host memory only
  (pinned buffers whose copies are queued around it);
- it runs holding the interpreter's lock; a thread that blocks on the device
  while holding that lock would wait forever for a function that needs it.
  torch's synchronising calls (``torch.cuda.synchronize``, ``Event.synchronize``,
  a device tensor's ``.cpu()``, a graph's replay) release the lock first;
- an exception cannot cross into the driver: :class:`HostFunction` keeps the
  first one and raises it at the next :meth:`HostFunction.launch` or
  :meth:`HostFunction.raise_failure`, so a failed gather is never silent.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch

from engramrt.errors import EngramError

__all__ = ["HostFunction", "HostFunctionError", "host_functions_available"]

_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DRIVER: Any = None
_DRIVER_LOCK = threading.Lock()


class HostFunctionError(EngramError, RuntimeError):
    """A host function could not be queued, or failed while it ran."""


def _driver() -> Any:
    """``libcuda``'s ``cuLaunchHostFunc``, loaded once (the driver every CUDA build of
    torch uses; the stream handles torch gives are the driver's too)."""
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as error:
                raise HostFunctionError(
                    f"host functions need the CUDA driver (libcuda.so.1), which cannot be "
                    f"loaded: {error}"
                ) from None
            launch = lib.cuLaunchHostFunc
            launch.argtypes = [ctypes.c_void_p, _CALLBACK, ctypes.c_void_p]
            launch.restype = ctypes.c_int
            _DRIVER = launch
    return _DRIVER


def host_functions_available(device: torch.device) -> bool:
    """Whether host functions can be queued on ``device`` (a CUDA device and its driver)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        _driver()
    except HostFunctionError:
        return False
    return True


class HostFunction:
    """``fn(arg)`` queued on a CUDA stream, any number of times.

    Args:
        fn: called with the int given to :meth:`launch`, on a driver thread, in
            stream order. It must make no CUDA call (see the module doc).
        name: what the function does, for error messages.
    """

    def __init__(self, fn: Callable[[int], None], *, name: str) -> None:
        self._fn = fn
        self.name = name
        self._failure: BaseException | None = None
        # The C callable must outlive every launch queued or captured with it: it is
        # held here, for the life of this object.
        self._callback = _CALLBACK(self.call_deferred)

    def call_deferred(self, arg: int | None) -> None:
        """``fn(arg)`` as CUDA's thread calls it: a failure is kept, for the next
        :meth:`raise_failure`, not raised. Every call runs, also after a failure not yet
        raised (a later call of another size must still write its own output, NaN or
        rows); the first failure is the one kept."""
        try:
            self._fn(arg or 0)
        except BaseException as error:  # nothing may cross into the driver
            if self._failure is None:
                self._failure = error

    def raise_failure(self) -> None:
        """Raise (once) the error of a call that failed since the last check."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise HostFunctionError(
                f"{self.name} failed on CUDA's host-function thread: "
                f"{type(failure).__name__}: {failure}"
            ) from failure

    def call_now(self, arg: int) -> None:
        """``fn(arg)`` on the calling thread, with the same failure handling (a device
        without streams: the CPU)."""
        self.raise_failure()
        self.call_deferred(arg)
        self.raise_failure()

    def launch(self, stream: torch.cuda.Stream, arg: int) -> None:
        """Queue ``fn(arg)`` on ``stream`` (capturable: a host node in a CUDA graph).

        ``arg`` is an int in ``[0, 2**63)``, passed by value."""
        self.raise_failure()
        status = _driver()(ctypes.c_void_p(stream.cuda_stream), self._callback, arg or None)
        if status != 0:
            raise HostFunctionError(
                f"cuLaunchHostFunc returned CUDA error {status} for {self.name} on stream "
                f"{stream.cuda_stream:#x}"
            )
