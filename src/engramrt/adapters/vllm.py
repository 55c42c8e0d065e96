"""A vLLM-style V1 model runner's step as a :class:`HashBatch` (SPEC §5).

The runner keeps persistent, CUDA-graph-padded buffers for a step:

- ``input_ids [T_pad]``, ``positions [T_pad]``: the first
  ``num_tokens_unpadded`` rows are the scheduled tokens, request by request;
  the rest are padding up to a captured graph size (stale values);
- ``query_start_loc [R_pad + 1]``: request r (its row in the persistent
  batch) owns tokens ``qsl[r] .. qsl[r+1]-1``; ``num_reqs_unpadded``
  requests are real, the rest are padded requests;
- ``slot_mapping [>= num_tokens_unpadded]``: the KV slot each scheduled
  token is written to, ``block_table[r, pos // bs] * bs + pos % bs``;
  padding entries hold the pad slot (-1 in vLLM);
- ``block_table [>= num_reqs_unpadded, max_blocks]``: the KV blocks of each
  request (one KV-cache group's table, with that group's ``block_size``).

vLLM's ``CommonAttentionMetadata.num_reqs`` and ``.num_actual_tokens`` are
the padded counts (``R_pad``, ``T_pad``); the unpadded ones are the
runner's ``num_reqs`` and ``num_scheduled_tokens`` before padding.

History lives in a :class:`SlotHashCache` bound to the same KV cache
(``num_blocks * block_size`` slots): prefix-cache hits and rejected drafts
then need nothing from the engine (see docs/adapters.md).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from engramrt.adapters._checks import (
    check_cache,
    check_count,
    check_dead_and_lookback,
    check_input_ids,
    check_request_counts,
    check_tensor,
    host_values,
    resolve_history_window,
)
from engramrt.errors import ValidationError
from engramrt.hashing.history import SlotHashCache
from engramrt.hashing.types import HashBatch

__all__ = ["from_vllm_step", "vllm_slot_cache"]

# The error for a SlotHashCache of another block size ({found}: its, {expected}: ours).
_CACHE_BLOCK_SIZE = (
    "block_size={expected} but the SlotHashCache was bound with block_size={found}; bind it "
    "to this KV-cache group's geometry"
)


def vllm_slot_cache(
    num_blocks: int, block_size: int, device: torch.device | str = "cpu"
) -> SlotHashCache:
    """The history for a vLLM KV-cache group of ``num_blocks`` blocks of ``block_size``.

    Bind it (or call ``bind`` again) wherever the runner binds its KV cache:
    vLLM first allocates a small cache to profile memory, then the real one.
    """
    return SlotHashCache(num_blocks * block_size, block_size, device)


def from_vllm_step(
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens_unpadded: int | None = None,
    num_reqs_unpadded: int | None = None,
    pad_slot_id: int = -1,
    dead_mask: torch.Tensor | None = None,
    lookback_token_ids: torch.Tensor | None = None,
    lookback_dead: torch.Tensor | None = None,
    image_token_id: int | None = None,
    req_idx: np.ndarray | None = None,
    dcp_world_size: int = 1,
    cache: SlotHashCache | None = None,
    history_window: object = None,
    validate: bool = True,
    hasher: object = None,
    num_actual_tokens: int | None = None,
    num_reqs: int | None = None,
) -> HashBatch:
    """The :class:`HashBatch` of one V1 runner step, for a :class:`SlotHashCache`.

    Never synchronises with the device: only views, ``torch.where``,
    ``arange`` and (when a buffer is shorter than the padded step) ``cat``,
    with shapes taken from tensor metadata and host ints. The call can sit
    inside a captured CUDA graph; ``validate=True`` only reads host
    metadata (and values of CPU tensors), so it never synchronises either.

    Args:
        input_ids: ``[T_pad]`` token ids of the padded step.
        positions: ``[T_pad]`` position of each token in its request.
        query_start_loc: ``[R_pad + 1]`` request boundaries. Entries after
            ``num_reqs_unpadded`` are rewritten to repeat its boundary (padded
            requests own no tokens) and every entry is clamped to
            ``num_tokens_unpadded``, so rows past it are padding rows (SPEC §5).
        slot_mapping: ``[>= T_pad]`` KV slot of each token (``[>=
            num_tokens_unpadded]`` when that is given). Rows at or past the
            real tokens and entries equal to ``pad_slot_id`` become -1 (never
            written); a buffer shorter than ``T_pad`` is extended with -1.
        block_table: ``[>= num_reqs_unpadded, max_blocks]`` block ids per
            request; rows past ``R_pad`` are dropped, missing padded rows are
            zeros (a padded request owns no token, so its row is never read).
        block_size: tokens per KV block of this table (the cache's block size).
        num_tokens_unpadded: scheduled tokens before CUDA-graph padding;
            default ``qsl[num_reqs_unpadded]``. Not vLLM's
            ``CommonAttentionMetadata.num_actual_tokens``, which is padded.
        num_reqs_unpadded: scheduled requests before padding; default
            ``R_pad``. Not ``CommonAttentionMetadata.num_reqs`` (padded).
        pad_slot_id: the runner's slot for padding tokens (-1 in vLLM).
        dead_mask, lookback_token_ids, lookback_dead: ``[T_pad]`` and
            ``[>= R_pad, N-1]``; lookback rows past ``R_pad`` are dropped
            (vLLM's buffer has ``max_num_reqs`` rows). Lookback ids are
            needed only in the first step of a request whose KV came from
            elsewhere.
        image_token_id: the id every image-span position carries in
            ``input_ids`` (vLLM's DeepSeek-V4.1 vision model: 129264, inside
            the vocabulary, so nothing else can tell it from text). Tokens
            and lookback ids equal to it become dead, on the device, added
            to ``dead_mask`` / ``lookback_dead``. None: no placeholder.
        req_idx: ``[>= num_reqs_unpadded]`` host array of each row's request
            (``CommonAttentionMetadata.req_idx``). Validation refuses a step
            in which two rows belong to one request (prefill context
            parallel chunks): the later row's history lies in tokens of the
            same step, which the slot cache holds only after the step.
        dcp_world_size: decode context parallel ranks of the KV cache. Only 1
            is supported; more is refused even with ``validate=False``.
        cache: the :class:`SlotHashCache` the batch will be hashed with; only
            used by validation (geometry, device, and that every block the
            step's history window reads lies inside it).
        history_window: the id maker the batch will be hashed with (any
            :class:`~engramrt.protocols.RowIdMaker`, or HashConstants) or its window
            N-1; only used by validation: the positions before each chunk checked
            against ``cache`` (None: every position from 0).
        validate: check the step first (see Raises); False skips every check
            but the ``dcp_world_size`` one.
        num_actual_tokens, num_reqs: deprecated names of
            ``num_tokens_unpadded`` / ``num_reqs_unpadded`` (a
            ``DeprecationWarning``): vLLM's fields of these names are padded.
        hasher: the older name of ``history_window`` (the same values).

    Returns:
        A batch with ``input_ids``, ``positions`` and ``block_table`` as views
        of the runner's tensors and rebuilt ``query_start_loc``/``slot_mapping``.

    Raises:
        ValidationError: with ``validate``, naming the first field of the step
            that is wrong. Shapes, dtypes, devices and host ints are checked
            always; values only for tensors on the CPU (never read back from a
            device): boundaries, a block table wide enough for every position,
            slot mapping entries that agree with the block table and
            ``block_size`` (-1 or ``pad_slot_id`` for a token not written; no
            other negative slot), and, with ``cache``, slots and the blocks of
            the history window (the N-1 positions before each chunk, from
            ``history_window``; every position from 0 without it) inside the cache.
            The id maker's own validation checks the rest of the batch contract.
    """
    num_tokens_unpadded = _renamed(
        "num_actual_tokens", num_actual_tokens, "num_tokens_unpadded", num_tokens_unpadded
    )
    num_reqs_unpadded = _renamed("num_reqs", num_reqs, "num_reqs_unpadded", num_reqs_unpadded)
    if dcp_world_size != 1:
        raise ValidationError(
            f"dcp_world_size={dcp_world_size!r}; only 1 is supported. Under decode context "
            f"parallelism vLLM's slot mapping addresses virtual blocks of block_size * "
            f"dcp_world_size positions and holds -1 for the tokens another rank stores, so a "
            f"rank's slot cache would hold only some of each request's history"
        )
    if validate:
        _check_step(
            input_ids,
            positions,
            query_start_loc,
            slot_mapping,
            block_table,
            block_size=block_size,
            num_tokens_unpadded=num_tokens_unpadded,
            num_reqs_unpadded=num_reqs_unpadded,
            pad_slot_id=pad_slot_id,
            dead_mask=dead_mask,
            lookback_token_ids=lookback_token_ids,
            lookback_dead=lookback_dead,
            image_token_id=image_token_id,
            req_idx=req_idx,
            cache=cache,
            history_window=resolve_history_window(history_window, hasher, required=False),
        )
    device, t_len = input_ids.device, int(input_ids.shape[0])
    r_pad = int(query_start_loc.shape[0]) - 1
    qsl, end = _boundaries(query_start_loc, num_reqs_unpadded, num_tokens_unpadded, device)
    lookback_token_ids = _rows(lookback_token_ids, r_pad)
    lookback_dead = _rows(lookback_dead, r_pad)
    if image_token_id is not None:
        dead_mask = _with_placeholder(input_ids, dead_mask, image_token_id)
        if lookback_token_ids is not None:
            lookback_dead = _with_placeholder(lookback_token_ids, lookback_dead, image_token_id)
    return HashBatch(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=qsl,
        dead_mask=dead_mask,
        lookback_token_ids=lookback_token_ids,
        lookback_dead=lookback_dead,
        slot_mapping=_written_slots(slot_mapping, t_len, end, pad_slot_id, device),
        block_table=_request_rows(block_table, r_pad, device),
    )


def _check_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    num_tokens_unpadded: int | None,
    num_reqs_unpadded: int | None,
    pad_slot_id: int,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    image_token_id: int | None,
    req_idx: np.ndarray | None,
    cache: SlotHashCache | None,
    history_window: int | None,
) -> None:
    """The checks of :func:`from_vllm_step` (its ``validate=True``)."""
    device, t_len = check_input_ids(input_ids)
    check_tensor("positions", positions, dims=1, device=device)
    if positions.shape[0] != t_len:
        raise ValidationError(
            f"positions has shape {list(positions.shape)}; expected [{t_len}] like input_ids"
        )
    check_tensor("query_start_loc", query_start_loc, dims=1, device=device)
    if query_start_loc.shape[0] < 1:
        raise ValidationError("query_start_loc has shape [0]; expected [R_pad + 1] boundaries")
    r_pad = int(query_start_loc.shape[0]) - 1
    n_real = check_request_counts(
        num_reqs_unpadded,
        num_tokens_unpadded,
        num_requests=r_pad,
        num_tokens=t_len,
        names=("num_reqs_unpadded", "num_tokens_unpadded"),
    )
    check_tensor("slot_mapping", slot_mapping, dims=1, device=device)
    _check_slot_mapping_length(slot_mapping, t_len, num_tokens_unpadded)
    check_tensor("block_table", block_table, dims=2, device=device)
    if block_table.shape[0] < n_real:
        label = (
            f"num_reqs_unpadded={n_real}"
            if num_reqs_unpadded is not None
            else f"R_pad={n_real} (no num_reqs_unpadded)"
        )
        raise ValidationError(
            f"block_table has {block_table.shape[0]} rows; expected at least {label}"
        )
    check_count("block_size", block_size, 1, 2**31 - 1)
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise ValidationError(f"pad_slot_id={pad_slot_id!r} must be a Python int")
    if image_token_id is not None:
        check_count("image_token_id", image_token_id, 0, 2**31 - 1)
    _check_lookback_rows(lookback_token_ids, lookback_dead, r_pad)
    check_dead_and_lookback(
        dead_mask,
        _rows(lookback_token_ids, r_pad),
        _rows(lookback_dead, r_pad),
        num_tokens=t_len,
        num_requests=r_pad,
        width=None,
        device=device,
    )
    _check_one_row_per_request(req_idx, n_real)
    check_cache(cache, block_size=block_size, device=device, why=_CACHE_BLOCK_SIZE)
    _check_vllm_values(
        query_start_loc,
        positions,
        slot_mapping,
        block_table,
        t_len=t_len,
        n_real=n_real,
        block_size=block_size,
        num_actual_tokens=num_tokens_unpadded,
        pad_slot_id=pad_slot_id,
        cache=cache,
        history_window=history_window,
    )


def _renamed(old: str, old_value: int | None, new: str, new_value: int | None) -> int | None:
    """``new_value``, or ``old_value`` passed under the deprecated name ``old``."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ValidationError(f"{old}={old_value!r} and {new}={new_value!r}: pass only {new}")
    warnings.warn(
        f"from_vllm_step({old}=...) is deprecated: vLLM's CommonAttentionMetadata.{old} is a "
        f"padded count, this argument an unpadded one; pass {new}=",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_value


def _check_slot_mapping_length(
    slot_mapping: torch.Tensor, t_len: int, num_tokens_unpadded: int | None
) -> None:
    """A slot for every token the step may write: ``T_pad`` of them unless the host says
    how many are real (a device ``qsl`` cannot be read to find out)."""
    need = t_len if num_tokens_unpadded is None else num_tokens_unpadded
    if slot_mapping.shape[0] < need:
        why = (
            f"num_tokens_unpadded={need}"
            if num_tokens_unpadded is not None
            else f"the {t_len} rows of input_ids (pass num_tokens_unpadded for a slot mapping "
            f"of the real tokens only)"
        )
        raise ValidationError(
            f"slot_mapping has {slot_mapping.shape[0]} entries; expected at least {why}"
        )


def _check_lookback_rows(
    lookback_token_ids: torch.Tensor | None, lookback_dead: torch.Tensor | None, r_pad: int
) -> None:
    """Lookback buffers hold a row for every request of the step (more are dropped)."""
    for name, lookback in (
        ("lookback_token_ids", lookback_token_ids),
        ("lookback_dead", lookback_dead),
    ):
        if isinstance(lookback, torch.Tensor) and lookback.dim() == 2 and lookback.shape[0] < r_pad:
            raise ValidationError(
                f"{name} has shape {list(lookback.shape)}; expected at least {r_pad} "
                f"rows (one per request of the step, R_pad={r_pad})"
            )


def _check_one_row_per_request(req_idx: np.ndarray | None, n_real: int) -> None:
    """No request in two rows of the step (``req_idx`` is a host array)."""
    if req_idx is None:
        return
    rows = np.asarray(req_idx)
    if rows.ndim != 1 or rows.shape[0] < n_real:
        raise ValidationError(
            f"req_idx has shape {list(rows.shape)}; expected [>= {n_real}] (one request "
            f"index per row)"
        )
    rows = rows[:n_real]
    _, first, counts = np.unique(rows, return_index=True, return_counts=True)
    if (counts > 1).any():
        request = int(rows[first[counts > 1][0]])
        both = np.flatnonzero(rows == request)[:2].tolist()
        raise ValidationError(
            f"req_idx: rows {both[0]} and {both[1]} both belong to request {request} "
            f"(context-parallel prefill chunks); the later row's history lies in tokens of "
            f"this same step, which the slot cache holds only after the step, so its ids "
            f"would be wrong. Run Engram on one row per request"
        )


def _rows(lookback: torch.Tensor | None, r_pad: int) -> torch.Tensor | None:
    """The first ``r_pad`` rows of a lookback buffer (a view)."""
    if lookback is None or lookback.dim() != 2:
        return lookback
    return lookback[:r_pad]


def _with_placeholder(
    ids: torch.Tensor, dead: torch.Tensor | None, placeholder: int
) -> torch.Tensor:
    """``dead`` (None: nothing dead) with every entry of ``ids`` equal to ``placeholder``
    dead too: one elementwise op on the device, no host read."""
    is_placeholder = ids == placeholder
    return is_placeholder if dead is None else dead | is_placeholder


def _boundaries(
    query_start_loc: torch.Tensor,
    num_reqs_unpadded: int | None,
    num_tokens_unpadded: int | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """``query_start_loc`` with padded requests repeating the last real boundary and
    nothing reaching past the real tokens, and that end (a host int when given)."""
    r_pad = int(query_start_loc.shape[0]) - 1
    n_real = r_pad if num_reqs_unpadded is None else num_reqs_unpadded
    request_index = torch.arange(r_pad + 1, device=device)
    qsl = torch.where(request_index > n_real, query_start_loc[n_real], query_start_loc)
    if num_tokens_unpadded is None:
        return qsl, qsl[n_real]
    return qsl.clamp(max=num_tokens_unpadded), num_tokens_unpadded


def _written_slots(
    slot_mapping: torch.Tensor,
    t_len: int,
    end: torch.Tensor | int,
    pad_slot_id: int,
    device: torch.device,
) -> torch.Tensor:
    """``[T_pad]`` slots of the tokens before ``end`` that are not ``pad_slot_id``; -1 on
    every other row (a buffer shorter than ``t_len`` is extended with -1)."""
    slots = slot_mapping[:t_len]
    if slots.shape[0] < t_len:
        fill = torch.full((t_len - slots.shape[0],), -1, dtype=slots.dtype, device=device)
        slots = torch.cat([slots, fill])
    real_token = torch.arange(t_len, device=device) < end  # [T_pad]
    if pad_slot_id != -1:
        real_token = real_token & (slots != pad_slot_id)
    return torch.where(real_token, slots, torch.full_like(slots, -1))


def _request_rows(block_table: torch.Tensor, r_pad: int, device: torch.device) -> torch.Tensor:
    """``[R_pad, max_blocks]``: the table's first ``r_pad`` rows, zeros for missing ones."""
    table = block_table[:r_pad]
    if table.shape[0] < r_pad:
        zeros = torch.zeros(
            (r_pad - table.shape[0], table.shape[1]), dtype=table.dtype, device=device
        )
        table = torch.cat([table, zeros])
    return table


def _check_vllm_values(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    *,
    t_len: int,
    n_real: int,
    block_size: int,
    num_actual_tokens: int | None,
    pad_slot_id: int,
    cache: SlotHashCache | None,
    history_window: int | None,
) -> None:
    """The value checks of :func:`from_vllm_step`, on the tensors that live on the CPU."""
    qsl = host_values(query_start_loc)
    if qsl is None:
        return
    if qsl[0] != 0:
        raise ValidationError(f"query_start_loc[0]={int(qsl[0])}; expected 0")
    for r in range(n_real):
        if qsl[r + 1] < qsl[r]:
            raise ValidationError(
                f"query_start_loc is not non-decreasing: [{r}]={int(qsl[r])} > "
                f"[{r + 1}]={int(qsl[r + 1])}"
            )
    end = int(qsl[n_real])
    if num_actual_tokens is not None and end != num_actual_tokens:
        raise ValidationError(
            f"query_start_loc[num_reqs_unpadded={n_real}]={end}; expected "
            f"num_tokens_unpadded={num_actual_tokens}"
        )
    if end > t_len:
        raise ValidationError(
            f"query_start_loc[num_reqs_unpadded={n_real}]={end} exceeds the {t_len} rows of "
            f"input_ids"
        )
    pos = host_values(positions)
    table = host_values(block_table)
    slots = host_values(slot_mapping)
    if pos is None or table is None:
        return
    width = table.shape[1]
    for r in range(n_real):
        a, b = int(qsl[r]), int(qsl[r + 1])
        if a == b:
            continue
        last = int(pos[a:b].max())
        if int(pos[a:b].min()) < 0:
            raise ValidationError(f"positions of request {r} hold {int(pos[a:b].min())} < 0")
        if last // block_size >= width:
            raise ValidationError(
                f"block_table row {r} has {width} blocks of {block_size}; position {last} "
                f"needs block {last // block_size}"
            )
        if cache is not None:
            first = 0 if history_window is None else max(0, int(pos[a]) - history_window)
            blocks = table[r, first // block_size : last // block_size + 1]
            outside = (blocks < 0) | (blocks >= cache.num_slots // block_size)
            if outside.any():
                j = first // block_size + int(outside.argmax())
                raise ValidationError(
                    f"block_table[{r}, {j}]={int(table[r, j])}: request {r} reads positions "
                    f"{first}..{last} (its history window and chunk), and the SlotHashCache has "
                    f"{cache.num_slots // block_size} blocks; expected block ids in "
                    f"[0, {cache.num_slots // block_size})"
                )
        if slots is not None:
            _check_request_slots(r, a, b, pos, table, slots, block_size, pad_slot_id, cache)


def _check_request_slots(
    r: int,
    a: int,
    b: int,
    pos: np.ndarray,
    table: np.ndarray,
    slots: np.ndarray,
    block_size: int,
    pad_slot_id: int,
    cache: SlotHashCache | None,
) -> None:
    """Request ``r``'s slot mapping (tokens ``a..b-1``) agrees with its block table."""
    want = table[r, pos[a:b] // block_size] * block_size + pos[a:b] % block_size
    got = np.full(b - a, -1, dtype=np.int64)  # the adapter extends a short buffer with -1
    got[: max(0, min(b, slots.shape[0]) - a)] = slots[a:b]
    unwritten = (got == -1) | (got == pad_slot_id)
    if (got[~unwritten] < 0).any():
        i = a + int(np.flatnonzero(~unwritten & (got < 0))[0])
        raise ValidationError(
            f"slot_mapping[{i}]={int(slots[i])}; expected -1 (or pad_slot_id="
            f"{pad_slot_id}) for a token not written, or a slot >= 0"
        )
    wrong = (got != want) & ~unwritten
    if wrong.any():
        i = a + int(wrong.argmax())
        raise ValidationError(
            f"slot_mapping[{i}]={int(slots[i])} but block_table[{r}] with "
            f"block_size={block_size} puts position {int(pos[i])} at slot "
            f"{int(want[i - a])}; the table, slot mapping and block size must "
            f"come from one KV-cache group"
        )
    if cache is not None and int(got.max()) >= cache.num_slots:
        raise ValidationError(
            f"slot_mapping holds slot {int(got.max())} in request {r}; the SlotHashCache "
            f"has {cache.num_slots} slots"
        )
