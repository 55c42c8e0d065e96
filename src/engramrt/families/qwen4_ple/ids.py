"""PLE hash constants and row ids (docs/families.md §2-§4): the definition a kernel must match.

- :class:`PleConstants` holds, per PLE layer, the splitmix64 multipliers, the prime size
  and offset of every hash head, and the padded table rows (docs/families.md §2).
- :func:`ple_row_ids` hashes one request's raw ids from its start (docs/families.md §3);
  :class:`PleIdContext` and :func:`ple_row_ids_chunk` stream it chunk by chunk, carrying
  the last ``N - 1`` raw ids (docs/families.md §4). Both are plain numpy, written to be read:
  a walk back from each token, then wrapping int64 products, XOR and a floor modulo.
- :func:`ple_row_ids_batch_reference` is the same rule vectorised in torch over an
  engine's flat batch of several requests (token ids, ``query_start_loc`` and each
  request's carried context): what a Triton kernel must return, bit for bit. It runs
  anywhere torch runs; tests pin it to the numpy reference and both to transformers.

Integer semantics: a token value ``v`` times a multiplier is a two's-complement wrapping
int64 product (only an EOS id ``>= V`` can overflow, docs/families.md §3), the XOR is of int64 bit
patterns and the modulo is floor modulo (result in ``[0, p)``), never C truncation. Any
int64 token value therefore has one defined result; the references do not check ids
against the vocabulary (the engine-facing op does, once, at the door).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engramrt._primes import miller_rabin
from engramrt.errors import ConfigError, ValidationError
from engramrt.families.qwen4_ple.config import PleConfig

__all__ = [
    "PleConstants",
    "PleIdContext",
    "is_prime",
    "layer_multipliers",
    "ple_row_ids",
    "ple_row_ids_batch_reference",
    "ple_row_ids_chunk",
    "ple_row_ids_torch",
    "primes_from",
    "splitmix64",
]

_MASK64 = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007  # seed offset between PLE layers (the reference's _PRIME_1)


# -- hash constants (docs/families.md §2) ---------------------------------------------------------


def splitmix64(value: int) -> int:
    """One splitmix64 step on ``value mod 2**64``; returns an unsigned 64-bit int."""
    z = (value + SPLITMIX_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _SPLITMIX_M1) & _MASK64
    z = ((z ^ (z >> 27)) * _SPLITMIX_M2) & _MASK64
    return z ^ (z >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The N odd multipliers of PLE layer ``ple_index`` (``m_i`` scales the id ``i``
    tokens back).

    ``m_i = 2 * (splitmix64(u64(seed + 10007*l + G*(i+1))) % h) + 1`` with
    ``h = max(1, ((2**63 - 1) // max(V, 1)) // 2)``, so ``(V - 1) * m_i < 2**63``: an id
    below V never overflows int64. G is added twice in effect (here, then inside
    splitmix64), as the reference does.
    """
    half_bound = max(1, (_INT64_MAX // max(vocab_size, 1)) // 2)
    base_seed = seed + _LAYER_STRIDE * ple_index
    return [
        2 * (splitmix64((base_seed + SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
        for i in range(ngram_size)
    ]


def is_prime(n: int) -> bool:
    """Exact primality of ``n`` (deterministic Miller-Rabin; exact below 3.2e23, which
    covers every 64-bit integer; raises ``ValueError`` above)."""
    return miller_rabin(n)


def primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes ``>= start``, increasing."""
    found: list[int] = []
    candidate = max(start, 2)
    while len(found) < count:
        if is_prime(candidate):
            found.append(candidate)
        candidate += 1
    return found


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class PleConstants:
    """Hash constants of every PLE layer, int64, in PLE index order (docs/families.md §2).

    Attributes:
        multipliers: ``[L, N]``; order n mixes ``m_0 .. m_{n-1}``.
        head_sizes: ``[L, C]`` prime bucket count ``p_c`` of each head; head
            ``c = (n-2)*H + j``. Layer l owns primes number ``l*C+1 .. l*C+C`` of one
            increasing sequence starting at ``ngram_vocab_size_base``, so all differ.
        offsets: ``[L, C]`` first row of each head in its layer's table (running sum).
        table_rows: ``R`` per layer, the sum of its primes padded up to a multiple of
            ``make_ngram_vocab_size_divisible_by``; rows past the sum are never addressed.
        heads_per_ngram: H.
    """

    multipliers: np.ndarray
    head_sizes: np.ndarray
    offsets: np.ndarray
    table_rows: tuple[int, ...]
    heads_per_ngram: int

    @property
    def n_layers(self) -> int:
        return int(self.multipliers.shape[0])

    @property
    def ngram_size(self) -> int:
        return int(self.multipliers.shape[1])

    @property
    def n_cols(self) -> int:
        return int(self.head_sizes.shape[1])

    @property
    def addressed_rows(self) -> tuple[int, ...]:
        """``total_l = sum_c p_c`` per layer: every row id of layer l is below it."""
        return tuple(int(s) for s in self.head_sizes.sum(axis=1))

    @classmethod
    def from_config(cls, config: PleConfig) -> PleConstants:
        """The constants a config derives (PLE off gives L = 0 and empty arrays)."""
        n_layers, n_cols, ngram = config.n_layers, config.n_cols, config.ngram_size
        multipliers = np.array(
            [
                layer_multipliers(config.vocab_size, ngram, ple_index, config.seed)
                for ple_index in range(n_layers)
            ],
            dtype=np.int64,
        ).reshape(n_layers, ngram)
        primes = primes_from(config.ngram_vocab_size_base, n_layers * n_cols)
        sizes = np.array(primes, dtype=object).reshape(n_layers, n_cols)
        divisor = config.make_ngram_vocab_size_divisible_by
        table_rows = tuple(-(-int(sum(row)) // divisor) * divisor for row in sizes)
        if any(rows > _INT64_MAX for rows in table_rows):
            raise ConfigError(
                f"ngram_vocab_size_base={config.ngram_vocab_size_base} gives tables of "
                f"{max(table_rows)} rows; expected fewer than 2**63 (int64 row ids)"
            )
        offsets = np.zeros((n_layers, n_cols), dtype=np.int64)
        offsets[:, 1:] = np.cumsum(sizes[:, :-1].astype(np.int64), axis=1)
        return cls(
            multipliers=_read_only(multipliers),
            head_sizes=_read_only(sizes.astype(np.int64)),
            offsets=_read_only(offsets),
            table_rows=table_rows,
            heads_per_ngram=config.heads_per_ngram,
        )

    def packed(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[L, N + 2C]`` int64 on ``device``: multipliers | head sizes | offsets per
        layer, one tensor so a kernel takes one pointer for all constants."""
        packed = np.concatenate([self.multipliers, self.head_sizes, self.offsets], axis=1)
        return torch.from_numpy(np.ascontiguousarray(packed, dtype=np.int64).copy()).to(device)


# -- one request, numpy (docs/families.md §3, §4) -------------------------------------------------


@dataclass(frozen=True)
class PleIdContext:
    """A request's streaming state for row ids: its last ``N - 1`` raw ids, oldest first
    (``[x_{t0-N+1}, ..., x_{t0-1}]`` before a chunk at ``t0``), EOS where the position is
    before the request. The same for every PLE layer, and a function of the last ``N - 1``
    tokens only, so a prefix hit or a rollback rebuilds it with :meth:`from_history`."""

    token_ids: tuple[int, ...]

    @classmethod
    def start(cls, ngram_size: int, eos: int) -> PleIdContext:
        """The context at a request's start: ``N - 1`` EOS."""
        return cls((int(eos),) * (ngram_size - 1))

    @classmethod
    def from_history(cls, token_ids: Sequence[int], ngram_size: int, eos: int) -> PleIdContext:
        """The context after a request's tokens ``token_ids`` (from its start)."""
        return cls.start(ngram_size, eos).advance(token_ids)

    def advance(self, chunk: Sequence[int] | np.ndarray) -> PleIdContext:
        """The context after ``chunk``: the last ``N - 1`` of ``context ++ chunk``."""
        joined = (*self.token_ids, *(int(v) for v in np.asarray(chunk).reshape(-1)))
        return PleIdContext(joined[len(joined) - len(self.token_ids) :])


def _walk_back(history: np.ndarray, n_context: int, ngram_size: int, eos: int) -> np.ndarray:
    """``v [T, N]`` of the last ``T = len(history) - n_context`` positions of ``history``.

    ``v[t, 0]`` is the token itself (an EOS is hashed as itself); walking back from
    ``t - 1``, ``v[t, s]`` is the token s back until the first EOS met, and EOS from
    there on (an EOS ends its segment: the token after it sees only EOS before it).
    ``history`` starts with at least ``N - 1`` context ids, so the walk stays inside it.
    """
    n_tokens = history.shape[0] - n_context
    values = np.empty((n_tokens, ngram_size), dtype=np.int64)
    for t in range(n_tokens):
        here = n_context + t
        values[t, 0] = history[here]
        blocked = False
        for s in range(1, ngram_size):
            blocked = blocked or history[here - s] == eos
            values[t, s] = eos if blocked else history[here - s]
    return values


def _mix_rows(values: np.ndarray, consts: PleConstants) -> np.ndarray:
    """Row ids ``[T, L, C]`` of the walked-back values ``[T, N]``.

    ``mix_n = XOR_{s<n} v_s * m_s`` (wrapping int64: the product is taken in uint64, whose
    low 64 bits are the two's-complement product) and ``row = mix_n mod p_c + off_c``
    (floor modulo) for the H heads of order n.
    """
    heads = consts.heads_per_ngram
    products = (
        values.astype(np.uint64)[:, None, :] * consts.multipliers.astype(np.uint64)[None]
    ).view(np.int64)  # [T, L, N]
    rows = np.empty((values.shape[0], consts.n_layers, consts.n_cols), dtype=np.int64)
    mix = products[..., 0]  # [T, L]
    for order in range(2, consts.ngram_size + 1):
        mix = np.bitwise_xor(mix, products[..., order - 1])
        cols = slice((order - 2) * heads, (order - 1) * heads)
        rows[:, :, cols] = (
            np.mod(mix[..., None], consts.head_sizes[None, :, cols]) + consts.offsets[None, :, cols]
        )
    return rows


def _token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValidationError(f"token_ids has shape {list(ids.shape)}; expected one request [T]")
    return ids


def ple_row_ids_chunk(
    token_ids: Sequence[int] | np.ndarray,
    context: PleIdContext,
    consts: PleConstants,
    eos: int,
) -> tuple[np.ndarray, PleIdContext]:
    """Row ids ``[T, L, C]`` int64 of one chunk of a request, and the context after it.

    The chunk is hashed as the tail of ``context ++ chunk`` (context entries are ordinary
    earlier tokens: an EOS among them still blocks). Any chunking, a zero-length chunk
    (context unchanged) included, gives the rows of :func:`ple_row_ids` on the whole.

    Args:
        token_ids: ``[T]`` raw token ids of the chunk.
        context: the request's :class:`PleIdContext` before the chunk.
        consts: the hash constants (:meth:`PleConstants.from_config`).
        eos: the PLE EOS id (``PleConfig.eos``).
    """
    ids = _token_array(token_ids)
    n_context = consts.ngram_size - 1
    if len(context.token_ids) != n_context:
        raise ValidationError(
            f"context has {len(context.token_ids)} ids; expected ngram_size - 1 = {n_context}"
        )
    history = np.concatenate([np.asarray(context.token_ids, dtype=np.int64), ids])
    rows = _mix_rows(_walk_back(history, n_context, consts.ngram_size, int(eos)), consts)
    return rows, context.advance(ids)


def ple_row_ids(
    token_ids: Sequence[int] | np.ndarray, consts: PleConstants, eos: int
) -> np.ndarray:
    """Row ids ``[T, L, C]`` int64 of one whole request from its start (docs/families.md §3):
    ``rows[t, l, c]`` is the row of head c in PLE layer l's own table, offset included."""
    start = PleIdContext.start(consts.ngram_size, eos)
    return ple_row_ids_chunk(token_ids, start, consts, eos)[0]


# -- an engine step, torch (the kernel's contract) ----------------------------------------


def _check_batch(
    token_ids: torch.Tensor, query_start_loc: torch.Tensor, context_token_ids: torch.Tensor, n: int
) -> None:
    """Shapes and dtypes of :func:`ple_row_ids_batch_reference`'s inputs, and monotone
    ``query_start_loc`` from 0 to at most T (reads the host; not for a captured step)."""
    if token_ids.ndim != 1 or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValidationError(
            f"token_ids has shape {list(token_ids.shape)} dtype {token_ids.dtype}; "
            f"expected [T] int32 or int64"
        )
    if query_start_loc.ndim != 1 or query_start_loc.numel() < 1:
        raise ValidationError(
            f"query_start_loc has shape {list(query_start_loc.shape)}; expected [R + 1]"
        )
    n_req = query_start_loc.numel() - 1
    if tuple(context_token_ids.shape) != (n_req, n - 1):
        raise ValidationError(
            f"context_token_ids has shape {list(context_token_ids.shape)}; "
            f"expected [R, N - 1] = [{n_req}, {n - 1}]"
        )
    bounds = query_start_loc.tolist()
    steps_back = any(b < a for a, b in itertools.pairwise(bounds))
    if bounds[0] != 0 or steps_back or bounds[-1] > token_ids.numel():
        raise ValidationError(
            f"query_start_loc={bounds}; expected non-decreasing from 0 to at most "
            f"T={token_ids.numel()}"
        )


def _gather_raw_values(
    token_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_token_ids: torch.Tensor,
    ngram_size: int,
    eos: int,
) -> torch.Tensor:
    """``raw [T, N]``: the id ``s`` back from each token, from its chunk or else from
    its request's context (column ``N - 1 + local - s``); a padding token (after
    ``query_start_loc[-1]``) reads an EOS context of its own, like a request start."""
    n_tokens, n_req = token_ids.shape[0], query_start_loc.shape[0] - 1
    index = torch.arange(n_tokens, dtype=torch.int64, device=token_ids.device)
    request = torch.searchsorted(query_start_loc[1:], index, right=True)  # [T]; R = padding
    local = index - query_start_loc[request.clamp(max=n_req)]  # position in its chunk
    local = torch.where(request >= n_req, 0, local)
    eos_row = context_token_ids.new_full((1, ngram_size - 1), eos)
    contexts = torch.cat([context_token_ids, eos_row])  # [R + 1, N - 1], row R for padding
    raw = torch.empty((n_tokens, ngram_size), dtype=torch.int64, device=token_ids.device)
    for s in range(ngram_size):
        from_chunk = token_ids[(index - s).clamp(min=0)]
        column = (ngram_size - 1 + local - s).clamp(0, ngram_size - 2)  # only read if local < s
        from_context = contexts[request, column]
        raw[:, s] = torch.where(local - s >= 0, from_chunk, from_context)
    return raw


def _next_contexts(
    token_ids: torch.Tensor, query_start_loc: torch.Tensor, context_token_ids: torch.Tensor
) -> torch.Tensor:
    """``[R, N - 1]``: the last ``N - 1`` of each request's ``context ++ chunk``."""
    n_context = context_token_ids.shape[1]
    starts, lengths = query_start_loc[:-1], query_start_loc[1:] - query_start_loc[:-1]
    columns = torch.arange(n_context, dtype=torch.int64, device=token_ids.device)
    joined_at = lengths[:, None] + columns[None, :]  # position in context ++ chunk, [R, N-1]
    in_chunk = joined_at >= n_context
    chunk_index = (starts[:, None] + joined_at - n_context).clamp(min=0)
    readable = torch.cat([token_ids, token_ids.new_zeros(1)])  # index T is a dummy read
    from_chunk = readable[chunk_index.clamp(max=token_ids.shape[0])]
    from_context = context_token_ids.gather(1, joined_at.clamp(max=n_context - 1))
    return torch.where(in_chunk, from_chunk, from_context)


def ple_row_ids_torch(
    token_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_token_ids: torch.Tensor,
    packed_constants: torch.Tensor,
    heads_per_ngram: int,
    eos: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ple_row_ids_batch_reference` without its checks, on the inputs' device.

    Plain torch operations on int64 tensors (no host reads): what the reference computes,
    for a caller that has already validated the step (``packed_constants`` is
    :meth:`PleConstants.packed` on the same device).
    """
    n = (packed_constants.shape[1] + 2 * heads_per_ngram) // (2 * heads_per_ngram + 1)
    n_layers, c = packed_constants.shape[0], (n - 1) * heads_per_ngram
    ids, qsl, contexts = token_ids.long(), query_start_loc.long(), context_token_ids.long()
    raw = _gather_raw_values(ids, qsl, contexts, n, int(eos))  # [T, N]
    # v_s is EOS once any of v_1..v_s is EOS (a running OR along the shifts).
    blocked = torch.cummax((raw[:, 1:] == eos).to(torch.int8), dim=1).values.bool()
    values = raw.clone()
    values[:, 1:] = torch.where(blocked, eos, raw[:, 1:])

    multipliers = packed_constants[:, :n]
    sizes, offsets = packed_constants[:, n : n + c], packed_constants[:, n + c :]
    products = values[:, None, :] * multipliers[None]  # [T, L, N], int64 wrapping
    rows = torch.empty((ids.shape[0], n_layers, c), dtype=torch.int64, device=ids.device)
    mix = products[..., 0]
    for order in range(2, n + 1):
        mix = torch.bitwise_xor(mix, products[..., order - 1])
        cols = slice((order - 2) * heads_per_ngram, (order - 1) * heads_per_ngram)
        rows[:, :, cols] = (
            torch.remainder(mix[..., None], sizes[None, :, cols]) + offsets[None, :, cols]
        )
    return rows, _next_contexts(ids, qsl, contexts)


def ple_row_ids_batch_reference(
    token_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_token_ids: torch.Tensor,
    consts: PleConstants,
    eos: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ids of one engine step over a flat batch of requests, and their next contexts.

    Request r owns tokens ``query_start_loc[r] .. query_start_loc[r+1] - 1`` (a chunk,
    possibly empty) and carried ``context_token_ids[r]`` (its :class:`PleIdContext`,
    oldest first; ``N - 1`` EOS at a request's start). Tokens past
    ``query_start_loc[-1]`` are padding (CUDA-graph rows): each hashes as the first
    token of a request. Equal, request by request, to :func:`ple_row_ids_chunk`.
    Checks its inputs on the host, then computes on the CPU.

    Args:
        token_ids: ``[T]`` int32/int64 raw ids.
        query_start_loc: ``[R + 1]`` int, non-decreasing from 0.
        context_token_ids: ``[R, N - 1]`` int64.
        consts: hash constants; eos: the PLE EOS id.

    Returns:
        ``rows [T, L, C]`` int64 (offsets included) and ``next_context [R, N - 1]``
        int64, both on ``token_ids``' device.
    """
    n = consts.ngram_size
    _check_batch(token_ids, query_start_loc, context_token_ids, n)
    rows, contexts = ple_row_ids_torch(
        token_ids.cpu(),
        query_start_loc.cpu(),
        context_token_ids.cpu(),
        consts.packed(),
        consts.heads_per_ngram,
        eos,
    )
    return rows.to(token_ids.device), contexts.to(token_ids.device)
