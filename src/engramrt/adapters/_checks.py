"""Checks shared by the engine adapters' validation.

They look at what the host already holds: tensor types, shapes, dtypes,
devices and plain ints. Values are read only from tensors that live on the
CPU (engines keep host mirrors of their step metadata); a device tensor's
values are never read, so validating never synchronises with a device.
"""

from __future__ import annotations

import numpy as np
import torch

from engramrt.errors import ValidationError
from engramrt.hashing.history import SlotHashCache
from engramrt.hashing.types import HashConstants

__all__ = [
    "check_cache",
    "check_count",
    "check_dead_and_lookback",
    "check_input_ids",
    "check_request_counts",
    "check_tensor",
    "history_window_of",
    "host_values",
    "resolve_history_window",
]

INT_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    x: object,
    *,
    dims: int,
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] = INT_DTYPES,
) -> torch.Tensor:
    """``x`` as a tensor of ``dims`` dimensions, one of ``dtypes``, on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise ValidationError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dim() != dims:
        raise ValidationError(f"{name} has shape {list(x.shape)}; expected {dims} dimension(s)")
    if x.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValidationError(f"{name} has dtype {x.dtype}; expected {names}")
    if x.device != device:
        raise ValidationError(f"{name} is on {x.device}; expected {device} like input_ids")
    return x


def check_input_ids(input_ids: object) -> tuple[torch.device, int]:
    """The device and token count ``T`` of a step's ``input_ids [T]``, which every other
    field is checked against."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValidationError(f"input_ids must be a torch.Tensor; got {type(input_ids).__name__}")
    check_tensor("input_ids", input_ids, dims=1, device=input_ids.device)
    return input_ids.device, int(input_ids.shape[0])


def check_request_counts(
    num_reqs: object,
    num_actual_tokens: object,
    *,
    num_requests: int,
    num_tokens: int,
    names: tuple[str, str] = ("num_reqs", "num_actual_tokens"),
) -> int:
    """The real requests of a step: ``num_reqs`` in ``[0, num_requests]`` (None: all of
    them); ``num_actual_tokens``, when given, in ``[0, num_tokens]``. ``names`` are the
    caller's names of the two counts, for the errors."""
    n_real = num_requests if num_reqs is None else check_count(names[0], num_reqs, 0, num_requests)
    if num_actual_tokens is not None:
        check_count(names[1], num_actual_tokens, 0, num_tokens)
    return n_real


def check_cache(
    cache: SlotHashCache | None, *, block_size: int, device: torch.device, why: str
) -> None:
    """With ``cache``: bound with ``block_size`` and on ``device``. ``why`` is the error for
    another block size, a format string of ``{found}`` (the cache's) and ``{expected}``."""
    if cache is None:
        return
    if cache.block_size != block_size:
        raise ValidationError(why.format(found=cache.block_size, expected=block_size))
    if cache.device != device:
        raise ValidationError(f"the SlotHashCache is on {cache.device}; expected {device}")


def check_count(name: str, value: object, low: int, high: int) -> int:
    """``value`` as a Python int in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name}={value!r} must be a Python int (a host value)")
    if not low <= value <= high:
        raise ValidationError(f"{name}={value} must be in [{low}, {high}]")
    return value


def history_window_of(value: object, name: str = "history_window") -> int:
    """Tokens before a chunk that the step's ids depend on (``N - 1``), from ``value``: an
    int, or anything that declares it (a :class:`~engramrt.protocols.RowIdMaker` such as
    an ``NgramHasher`` or a ``PleRowIdMaker``, a memory family), or an Engram
    :class:`HashConstants`.

    Adapters take the window of the id maker the batch will be hashed with (or the
    maker itself), so the window they check is the model's and cannot drift from it.
    """
    if isinstance(value, HashConstants):
        return int(value.max_ngram_size) - 1
    # A bare int only under its own name: given as ``hasher=`` it could be N or N-1.
    window = getattr(value, "history_window", value if name == "history_window" else None)
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValidationError(
            f"{name}={value!r} ({type(value).__name__}); expected the NgramHasher the batch "
            f"will be hashed with (or any id maker with a history_window, or its "
            f"HashConstants)"
            + (", or its history window N-1 (an int >= 0)" if name == "history_window" else "")
        )
    return int(window)


def resolve_history_window(history_window: object, hasher: object, *, required: bool) -> int | None:
    """The window of ``history_window``, or of ``hasher`` (the parameter's older name, which
    takes the same values); None when neither is given and it is not ``required``."""
    if history_window is not None and hasher is not None:
        raise ValidationError(
            "history_window and hasher are both given; expected one (hasher is the older name)"
        )
    if history_window is None and hasher is None:
        if required:
            raise ValidationError(
                "history_window is missing; expected the id maker the batch will be hashed "
                "with (e.g. an NgramHasher) or its history window N-1"
            )
        return None
    if history_window is None:
        return history_window_of(hasher, "hasher")
    return history_window_of(history_window)


def host_values(x: torch.Tensor | None) -> np.ndarray | None:
    """``x`` as int64 numpy when it lives on the CPU; None for a device tensor (never read)."""
    if x is None or x.device.type != "cpu":
        return None
    return x.detach().numpy().astype(np.int64)


def check_dead_and_lookback(
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    *,
    num_tokens: int,
    num_requests: int,
    width: int | None,
    device: torch.device,
) -> None:
    """The optional dead mask ``[T]`` (bool, as the hasher takes it) and lookback ids /
    dead flags ``[R, N-1]`` of a step (``width=None``: only the rows are checked)."""
    if dead_mask is not None:
        check_tensor("dead_mask", dead_mask, dims=1, device=device, dtypes=(torch.bool,))
        if dead_mask.shape[0] != num_tokens:
            raise ValidationError(
                f"dead_mask has shape {list(dead_mask.shape)}; expected [{num_tokens}] like "
                f"input_ids"
            )
    for name, lookback, dtypes in (
        ("lookback_token_ids", lookback_token_ids, INT_DTYPES),
        ("lookback_dead", lookback_dead, (torch.bool,)),
    ):
        if lookback is None:
            continue
        check_tensor(name, lookback, dims=2, device=device, dtypes=dtypes)
        if lookback.shape[0] != num_requests or (width is not None and lookback.shape[1] != width):
            expected = (
                f"[{num_requests}, {width}]" if width is not None else f"[{num_requests}, N-1]"
            )
            raise ValidationError(
                f"{name} has shape {list(lookback.shape)}; expected {expected} (one row per "
                f"request of the step)"
            )
