"""An SGLang-style forward batch as a :class:`HashBatch` (SPEC §5).

SGLang describes a step per request, not per token:

- ``input_ids [T]``: the step's tokens, request by request (CUDA-graph
  padded past ``num_actual_tokens``);
- ``req_pool_indices [R]``: each request's row in the request-to-token pool;
- ``seq_lens [R]``: a request's length after a decode step;
- ``extend_prefix_lens [R]``, ``extend_seq_lens [R]`` (extend, mixed and
  chain-draft verify steps): tokens already in the KV cache and tokens of
  this step;
- ``req_to_token [max_reqs, max_context]``: the KV slot of every (pool row,
  position): a block table with one slot per block.

History lives in a :class:`SlotHashCache` of ``block_size`` 1 keyed by those
KV slots. The batch's block table holds only the few slots hashing can read
(the N-1 positions before each chunk, plus the chunk start), not whole pool
rows: positions are rebased per request so that this window starts at
column 0 (see :func:`from_sglang_batch`). Hash ids depend only on distances
between positions and on which ones are negative, so rebasing leaves them
unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from engramrt.adapters._checks import (
    check_cache,
    check_count,
    check_dead_and_lookback,
    check_input_ids,
    check_request_counts,
    check_tensor,
    history_window_of,
    host_values,
    resolve_history_window,
)
from engramrt.errors import ValidationError
from engramrt.hashing.history import RequestHistory, SlotHashCache
from engramrt.hashing.types import HashBatch

__all__ = [
    "MM_PAD_SHIFT_VALUE",
    "from_sglang_batch",
    "sglang_request_history",
    "sglang_slot_cache",
]

MM_PAD_SHIFT_VALUE = 1_000_000
"""SGLang's multimodal pad ids: image tokens in ``ForwardBatch.input_ids`` hold values at
or above it (``sglang.srt.managers.schedule_batch.MM_PAD_SHIFT_VALUE``)."""

# The error for a SlotHashCache of another block size ({found}: its, {expected}: ours).
_CACHE_BLOCK_SIZE = (
    "the SlotHashCache has block_size={found}; expected {expected} (req_to_token names one "
    "slot per position)"
)


def sglang_slot_cache(num_kv_slots: int, device: torch.device | str = "cpu") -> SlotHashCache:
    """The history for an SGLang KV pool of ``num_kv_slots`` token slots.

    ``num_kv_slots`` counts every slot ``req_to_token`` may name, the
    reserved padding slot included (``size + page_size`` rows in SGLang's
    token-to-KV pools).
    """
    return SlotHashCache(num_kv_slots, 1, device)


def sglang_request_history(
    num_pool_rows: int,
    history_window: object,
    max_draft_tokens: int = 16,
    device: torch.device | str = "cpu",
) -> RequestHistory:
    """SGLang's own history design: one row per ``req_to_token`` row, for batches of
    ``from_sglang_batch(..., history="rows")``.

    ``num_pool_rows`` counts every row ``req_pool_indices`` may name, the reserved
    padding row 0 included (``ReqToTokenPool.size + 1``). Each row remembers the last
    N-1 + ``max_draft_tokens`` positions, so a verify step's rejected drafts never
    overwrite accepted history and need no commit (entries are tagged with their
    position); call ``reset(row)`` when a row is given to a new request and pass
    ``lookback_token_ids`` in a request's first step when its chunk does not start
    at 0 (radix-cache hits, KV from elsewhere). ``history_window``: the hasher the
    batches will be hashed with (any :class:`~engramrt.protocols.RowIdMaker`), or its
    window N-1.
    """
    n = history_window_of(history_window) + 1
    return RequestHistory(num_pool_rows, n, n - 1 + max_draft_tokens, device)


def from_sglang_batch(
    *,
    input_ids: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    history_window: object = None,
    seq_lens: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    extend_prefix_lens: torch.Tensor | None = None,
    extend_seq_lens: torch.Tensor | None = None,
    num_reqs: int | None = None,
    num_actual_tokens: int | None = None,
    dead_mask: torch.Tensor | None = None,
    lookback_token_ids: torch.Tensor | None = None,
    lookback_dead: torch.Tensor | None = None,
    cache: SlotHashCache | None = None,
    mm_pad_shift: int | None = MM_PAD_SHIFT_VALUE,
    history: str = "slots",
    validate: bool = True,
    hasher: object = None,
) -> HashBatch:
    """The :class:`HashBatch` of one forward batch, for :func:`sglang_slot_cache`.

    Request r's chunk is ``extend_seq_lens[r]`` tokens (extend and verify
    steps; one in decode steps: leave both extend fields None) starting at
    ``positions[query_start_loc[r]]`` (``ForwardBatch.positions``, right in
    every mode), else at ``extend_prefix_lens[r]`` or ``seq_lens[r] - 1``
    (decode): in a verify step ``seq_lens`` counts the drafts too. Ids at or
    above ``mm_pad_shift`` (image pads) become dead positions with id 0.

    Never synchronises with the device: a binary search of each token's
    request, gathers and ``torch.where``, all of shapes known from tensor
    metadata and host ints, so it can sit inside a captured CUDA graph.
    ``validate=True`` reads host metadata only (and values of CPU tensors).

    Args:
        input_ids: ``[T]`` token ids; rows past ``num_actual_tokens`` are padding.
        req_pool_indices: ``[R]`` pool row of each request.
        req_to_token: ``[max_reqs, max_context]`` KV slot of each (pool row, position).
        history_window: the id maker the batch will be hashed with (any
            :class:`~engramrt.protocols.RowIdMaker`, or HashConstants) or its window
            N-1: the positions before each chunk the batch carries. Required.
        seq_lens: ``[R]`` lengths after this step (decode, no ``positions``).
        positions: ``[T]`` position of each token (``ForwardBatch.positions``).
        extend_prefix_lens, extend_seq_lens: ``[R]`` each (extend steps).
        num_reqs: real requests (CUDA-graph padding adds requests after them,
            which become empty); default R.
        num_actual_tokens: real tokens; default the sum of the real chunks.
        dead_mask: ``[T]`` bool, passed through.
        lookback_token_ids, lookback_dead: ``[R, N-1]``, passed through; only
            the first step of a request whose KV came from elsewhere needs them.
        cache: the :class:`SlotHashCache` the batch will be hashed with; only
            used by validation (block size 1, slots in range, device).
        mm_pad_shift: SGLang's ``MM_PAD_SHIFT_VALUE`` (None: ids pass through).
        history: ``"slots"``, for :func:`sglang_slot_cache` (fields below), or
            ``"rows"``: SGLang's own design, one history row per pool row, for
            :func:`sglang_request_history` (true positions, ``request_slots =
            req_pool_indices``, no slots).
        validate: check the batch first (see Raises); False skips every check but
            those the conversion needs: the history window, a decode step's
            ``seq_lens``, an ``extend_seq_lens`` with its ``extend_prefix_lens``.
        hasher: the older name of ``history_window`` (the same values).

    Returns:
        A batch whose fields are:

        - ``query_start_loc [R+1]``: 0, then the running sum of the real
          chunks' lengths (padded requests add 0);
        - ``positions [T]``: ``position - base[r]`` of each token of request
          r, with ``base[r] = max(0, chunk_start[r] - (N-1))``; 0 on padding rows;
        - ``slot_mapping [T]``: ``req_to_token[req_pool_indices[r], position]``;
          -1 on padding rows (never written);
        - ``block_table [R, N]``: ``req_to_token[req_pool_indices[r], base[r] + j]``
          (column index clamped to the pool's width; columns past the chunk
          start are never read).

    Raises:
        ValidationError: with ``validate``, naming the first field of the batch
            that is wrong. Shapes, dtypes, devices and host ints are checked
            always; values only for tensors on the CPU (never read back from a
            device): lengths, pool rows (distinct among the real requests: two
            requests sharing a row would read and write each other's history),
            a pool row wide enough for every position, the token count, and
            slots inside the cache.
    """
    max_ngram_size = 1 + (resolve_history_window(history_window, hasher, required=True) or 0)
    if validate:
        _check_sglang_batch(
            input_ids=input_ids,
            req_pool_indices=req_pool_indices,
            req_to_token=req_to_token,
            max_ngram_size=max_ngram_size,
            seq_lens=seq_lens,
            positions=positions,
            extend_prefix_lens=extend_prefix_lens,
            extend_seq_lens=extend_seq_lens,
            num_reqs=num_reqs,
            num_actual_tokens=num_actual_tokens,
            dead_mask=dead_mask,
            lookback_token_ids=lookback_token_ids,
            lookback_dead=lookback_dead,
            cache=cache,
            mm_pad_shift=mm_pad_shift,
            history=history,
        )
    device = input_ids.device
    t_len = int(input_ids.shape[0])
    n_req = int(req_pool_indices.shape[0])
    n_real = n_req if num_reqs is None else num_reqs

    if mm_pad_shift is not None:
        input_ids, dead_mask = _mm_pads_dead(input_ids, dead_mask, mm_pad_shift)
    if mm_pad_shift is not None and lookback_token_ids is not None:
        lookback_token_ids, lookback_dead = _mm_pads_dead(
            lookback_token_ids, lookback_dead, mm_pad_shift
        )
    live = torch.arange(n_req, device=device) < n_real  # [R]
    qsl, chunk_start = _sglang_chunks(
        live,
        t_len=t_len,
        seq_lens=seq_lens,
        positions=positions,
        extend_prefix_lens=extend_prefix_lens,
        extend_seq_lens=extend_seq_lens,
        num_actual_tokens=num_actual_tokens,
    )
    pool_rows = torch.where(live, req_pool_indices.to(torch.int64), 0)  # [R]
    position, batch_positions, slot_mapping, block_table = _sglang_slots(
        req_to_token, qsl, chunk_start, pool_rows, window=max_ngram_size, t_len=t_len
    )
    if history == "rows":  # a RequestHistory row per pool row: true positions, no slots
        return HashBatch(
            input_ids=input_ids,
            positions=position,
            query_start_loc=qsl,
            dead_mask=dead_mask,
            lookback_token_ids=lookback_token_ids,
            lookback_dead=lookback_dead,
            request_slots=pool_rows,
        )
    return HashBatch(
        input_ids=input_ids,
        positions=batch_positions,
        query_start_loc=qsl,
        dead_mask=dead_mask,
        lookback_token_ids=lookback_token_ids,
        lookback_dead=lookback_dead,
        slot_mapping=slot_mapping,
        block_table=block_table,
    )


def _sglang_slots(
    req_to_token: torch.Tensor,
    qsl: torch.Tensor,
    chunk_start: torch.Tensor,
    pool_rows: torch.Tensor,
    *,
    window: int,
    t_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's position (0 on padding rows), its window-relative position, its
    slot (-1 on padding rows) and the ``[R, N]`` window of pool columns of
    :func:`from_sglang_batch`."""
    device, n_req = qsl.device, int(pool_rows.shape[0])
    max_context = int(req_to_token.shape[1])
    base = (chunk_start - (window - 1)).clamp(min=0)  # [R]
    token = torch.arange(t_len, device=device)
    owner = torch.searchsorted(qsl[1:].contiguous(), token, right=True)  # [T]; R: padding
    padding_row = owner >= n_req
    if n_req == 0:
        zeros = torch.zeros(t_len, dtype=torch.int64, device=device)
        slot_mapping = torch.full((t_len,), -1, dtype=torch.int64, device=device)
        return zeros, zeros, slot_mapping, req_to_token[:0, :window]
    owner = owner.clamp(max=n_req - 1)
    position = chunk_start[owner] + (token - qsl[owner])  # [T] in the request
    column = position.clamp(0, max_context - 1)
    slot = req_to_token[pool_rows[owner], column].to(torch.int64)
    batch_positions = torch.where(padding_row, 0, position - base[owner])
    slot_mapping = torch.where(padding_row, -1, slot)
    columns = (base[:, None] + torch.arange(window, device=device)).clamp(max=max_context - 1)
    block_table = req_to_token[pool_rows[:, None], columns]  # [R, N]
    return torch.where(padding_row, 0, position), batch_positions, slot_mapping, block_table


def _sglang_chunks(
    live: torch.Tensor,
    *,
    t_len: int,
    seq_lens: torch.Tensor | None,
    positions: torch.Tensor | None,
    extend_prefix_lens: torch.Tensor | None,
    extend_seq_lens: torch.Tensor | None,
    num_actual_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query_start_loc [R+1]`` and each request's chunk start ``[R]`` (0 for padded
    requests) of :func:`from_sglang_batch`, on the device of ``live [R]``."""
    device = live.device
    if extend_seq_lens is None:  # decode: one token per request, at seq_lens - 1
        chunk_len = live.to(torch.int64)
        if positions is None:
            if seq_lens is None:  # checked even without validate: it costs nothing
                raise ValidationError("seq_lens is None in a decode step; expected [R] lengths")
            chunk_start = seq_lens.to(torch.int64) - 1
    else:
        chunk_len = torch.where(live, extend_seq_lens.to(torch.int64), 0)
        if positions is None:
            if extend_prefix_lens is None:
                raise ValidationError(
                    "extend_seq_lens was given alone; expected extend_prefix_lens or positions"
                )
            chunk_start = extend_prefix_lens.to(torch.int64)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), chunk_len.cumsum(0)])
    if num_actual_tokens is not None:
        qsl = qsl.clamp(max=num_actual_tokens)
    if positions is not None:  # each chunk starts at its first token's position
        first = qsl[:-1].clamp(max=max(t_len - 1, 0))
        chunk_start = positions.to(torch.int64)[first] if t_len else torch.zeros_like(first)
        chunk_start = torch.where(qsl[1:] > qsl[:-1], chunk_start, 0)
    chunk_start = torch.where(live, chunk_start, 0)
    return qsl, chunk_start


def _mm_pads_dead(
    ids: torch.Tensor, dead: torch.Tensor | None, mm_pad_shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` with every multimodal pad id (``>= mm_pad_shift``) replaced by 0, and
    ``dead`` with those positions set: device ops of fixed shapes, no host read."""
    pad = ids >= mm_pad_shift
    return torch.where(pad, 0, ids), pad if dead is None else dead | pad


def _check_sglang_batch(
    *,
    input_ids: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    max_ngram_size: int,
    seq_lens: torch.Tensor | None,
    positions: torch.Tensor | None,
    extend_prefix_lens: torch.Tensor | None,
    extend_seq_lens: torch.Tensor | None,
    num_reqs: int | None,
    num_actual_tokens: int | None,
    dead_mask: torch.Tensor | None,
    lookback_token_ids: torch.Tensor | None,
    lookback_dead: torch.Tensor | None,
    cache: SlotHashCache | None,
    mm_pad_shift: int | None,
    history: str,
) -> None:
    """The checks of :func:`from_sglang_batch` (its Raises says which)."""
    device, t_len = check_input_ids(input_ids)
    check_tensor("req_pool_indices", req_pool_indices, dims=1, device=device)
    n_req = int(req_pool_indices.shape[0])
    check_tensor("req_to_token", req_to_token, dims=2, device=device)
    if req_to_token.shape[1] < 1:
        raise ValidationError(
            f"req_to_token has shape {list(req_to_token.shape)}; expected [max_reqs, max_context >= 1]"
        )
    n_real = check_request_counts(num_reqs, num_actual_tokens, num_requests=n_req, num_tokens=t_len)
    _check_sglang_options(
        positions,
        history=history,
        cache=cache,
        mm_pad_shift=mm_pad_shift,
        device=device,
        t_len=t_len,
    )
    if extend_prefix_lens is not None and extend_seq_lens is None:
        raise ValidationError(
            "extend_prefix_lens was given alone; expected extend_prefix_lens and "
            "extend_seq_lens together (extend steps) or neither (decode steps)"
        )
    if extend_seq_lens is not None and extend_prefix_lens is None and positions is None:
        raise ValidationError(
            "extend_seq_lens was given alone; expected extend_prefix_lens or positions "
            "with it (extend steps)"
        )
    decode = extend_seq_lens is None
    if decode and seq_lens is None and positions is None:
        raise ValidationError(
            "seq_lens and positions are None in a decode step (no extend_seq_lens); "
            "expected positions [T] or seq_lens [R]"
        )
    for name, lengths in (
        ("seq_lens", seq_lens),
        ("extend_prefix_lens", extend_prefix_lens),
        ("extend_seq_lens", extend_seq_lens),
    ):
        if lengths is None:
            continue
        check_tensor(name, lengths, dims=1, device=device)
        if lengths.shape[0] != n_req:
            raise ValidationError(
                f"{name} has shape {list(lengths.shape)}; expected [{n_req}] like req_pool_indices"
            )
    if decode and t_len < n_real:
        raise ValidationError(
            f"input_ids has {t_len} rows in a decode step of num_reqs={n_real}; expected "
            f"at least one token per request"
        )
    if decode and num_actual_tokens is not None and num_actual_tokens != n_real:
        raise ValidationError(
            f"num_actual_tokens={num_actual_tokens} in a decode step; expected "
            f"num_reqs={n_real} (one token per request)"
        )
    check_dead_and_lookback(
        dead_mask,
        lookback_token_ids,
        lookback_dead,
        num_tokens=t_len,
        num_requests=n_req,
        width=max_ngram_size - 1,
        device=device,
    )
    check_cache(cache, block_size=1, device=device, why=_CACHE_BLOCK_SIZE)

    if positions is not None:
        pos = host_values(positions)
        extend = np.ones(n_real, np.int64) if decode else host_values(extend_seq_lens)
        if pos is None or extend is None:
            return
        if n_real and int(extend[:n_real].min()) < 0:
            r = int(extend[:n_real].argmin())
            raise ValidationError(f"extend_seq_lens[{r}]={int(extend[r])}; expected >= 0")
        counts = extend[:n_real].tolist()
        first = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(np.int64)
        if int(sum(counts)) > t_len:
            raise ValidationError(
                f"extend_seq_lens of the {n_real} real requests add up to {int(sum(counts))}; "
                f"input_ids has {t_len} rows"
            )
        starts = np.where(np.asarray(counts) > 0, pos[np.minimum(first, max(t_len - 1, 0))], 0)
        if n_real and int(starts.min()) < 0:
            r = int(starts.argmin())
            raise ValidationError(
                f"positions[{int(first[r])}]={int(starts[r])} starts request {r}; expected >= 0"
            )
    elif decode:
        seq = host_values(seq_lens)
        if seq is None:
            return
        starts, counts = seq[:n_real] - 1, [1] * n_real
        bad = [r for r in range(n_real) if seq[r] < 1]
        if bad:
            r = bad[0]
            raise ValidationError(f"seq_lens[{r}]={int(seq[r])} in a decode step; expected >= 1")
    else:
        prefix, extend = host_values(extend_prefix_lens), host_values(extend_seq_lens)
        if prefix is None or extend is None:
            return
        for name, host in (("extend_prefix_lens", prefix), ("extend_seq_lens", extend)):
            if n_real and int(host[:n_real].min()) < 0:
                r = int(host[:n_real].argmin())
                raise ValidationError(f"{name}[{r}]={int(host[r])}; expected >= 0")
        starts, counts = prefix[:n_real], extend[:n_real].tolist()
        total = int(sum(counts))
        if total > t_len:
            raise ValidationError(
                f"extend_seq_lens of the {n_real} real requests add up to {total}; "
                f"input_ids has {t_len} rows"
            )
        if num_actual_tokens is not None and total != num_actual_tokens:
            raise ValidationError(
                f"extend_seq_lens of the {n_real} real requests add up to {total}; "
                f"expected num_actual_tokens={num_actual_tokens}"
            )
    _check_sglang_rows(
        req_pool_indices,
        req_to_token,
        starts,
        counts,
        n_real=n_real,
        max_ngram_size=max_ngram_size,
        cache=cache,
    )


def _check_sglang_options(
    positions: torch.Tensor | None,
    *,
    history: str,
    cache: SlotHashCache | None,
    mm_pad_shift: int | None,
    device: torch.device,
    t_len: int,
) -> None:
    """The checks of :func:`from_sglang_batch`'s ``history``, ``mm_pad_shift`` and
    ``positions [T]``."""
    if history not in ("slots", "rows"):
        raise ValidationError(f"history={history!r}; expected 'slots' or 'rows'")
    if history == "rows" and cache is not None:
        raise ValidationError(
            "cache is a SlotHashCache with history='rows'; expected None (the batch is "
            "hashed with a RequestHistory)"
        )
    if mm_pad_shift is not None:
        check_count("mm_pad_shift", mm_pad_shift, 1, 2**31 - 1)
    if positions is not None:
        check_tensor("positions", positions, dims=1, device=device)
        if positions.shape[0] != t_len:
            raise ValidationError(
                f"positions has shape {list(positions.shape)}; expected [{t_len}] like input_ids"
            )


def _check_sglang_rows(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    starts: np.ndarray,
    counts: list[int],
    *,
    n_real: int,
    max_ngram_size: int,
    cache: SlotHashCache | None,
) -> None:
    """The pool-row checks of :func:`from_sglang_batch`: each real request's chunk fits
    its row, rows are distinct and inside ``req_to_token``, slots inside the cache."""
    rows = host_values(req_pool_indices)
    max_context = int(req_to_token.shape[1])
    for r in range(n_real):
        end = int(starts[r]) + int(counts[r])
        if end > max_context:
            raise ValidationError(
                f"request {r} reaches position {end - 1}; req_to_token has only "
                f"{max_context} positions per row"
            )
    if rows is None:
        return
    n_rows = int(req_to_token.shape[0])
    first_request: dict[int, int] = {}
    for r in range(n_real):
        if not 0 <= int(rows[r]) < n_rows:
            raise ValidationError(
                f"req_pool_indices[{r}]={int(rows[r])}; expected a row of req_to_token in "
                f"[0, {n_rows})"
            )
        other = first_request.setdefault(int(rows[r]), r)
        if other != r:
            raise ValidationError(
                f"req_pool_indices[{r}]={int(rows[r])} is also req_pool_indices[{other}]; "
                f"expected a distinct pool row per real request (num_reqs={n_real})"
            )
    table = host_values(req_to_token)
    if cache is None or table is None:
        return
    for r in range(n_real):
        first = max(0, int(starts[r]) - (max_ngram_size - 1))
        used = table[int(rows[r]), first : int(starts[r]) + int(counts[r])]
        if used.size and (int(used.min()) < 0 or int(used.max()) >= cache.num_slots):
            raise ValidationError(
                f"req_to_token[{int(rows[r])}] names slots {int(used.min())}..{int(used.max())} "
                f"for request {r}; the SlotHashCache has {cache.num_slots} slots"
            )
