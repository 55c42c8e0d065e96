"""The Qwen4-Exp PLE layer in plain PyTorch: the definition a fused kernel must meet.

docs/families.md §6. Per token, from the hidden streams ``h [hc*D]`` and the token's table rows
``e [E]`` (the C heads' rows concatenated, head c in columns ``c*d .. c*d+d-1``)::

    k = RMS_key(key_proj(e))  [hc, D]      v = value_proj(e)  [D]      q = RMS_query(h)  [hc, D]
    s = sum_D(k * q) / sqrt(D)             g = sign(s) * sqrt(max(|s|, 1e-6))      (sign(0) = 0)
    a = sigmoid(g)[:, None] * v[None, :]   b = RMS_conv(a)                         ([hc*D] each)
    a, b = 0 at masked tokens
    c_t = SiLU(sum_j conv1d[:, 0, j] * b_{t-(K-1-j)*N})     (depthwise, dilation N, causal)
    out = a + c                                              (the decoder adds it to h)

``RMS_w(y)``: per stream of D, ``y * rsqrt(mean(y^2) + eps) * (1 + w)`` in fp32.

Rounding (what makes bf16 and fp32 bit-exact against transformers 5.23.0 on CPU): every
step is computed in fp32 and its result rounded to the model dtype: each projection once
(fp32 accumulation), each norm once (``1 + w`` inside), ``k * q`` per element, then the
D-sum, ``/ sqrt(D)``, ``|s|``, the clamp, the square root, ``* sign``, the sigmoid, ``* v``;
the conv's K taps are accumulated in fp32 from a zero accumulator in tap order ``j = 0 ..
K-1``, each a fused multiply-add (one rounding per tap), the sum rounded once to the model
dtype, then SiLU; then ``a + c``. For 16-bit inputs the conv's products are exact in fp32,
so this is docs/families.md's "K products summed in fp32 and rounded once"; for fp32 inputs the
fusing is what the oracle's ``F.conv1d`` does (a separate multiply and add changes about a
sixth of the fp32 outputs, reversed taps about a fifth; both stay within
:func:`ple_layer_tolerance`).
The projections are ``torch.nn.functional.linear`` in the model dtype: on CPU that is the
same GEMM as the oracle (fp32 accumulation, one rounding, the same bits for any number of
tokens); an fp32 GEMM rounded afterwards differs in about one bf16 output in 10^4. Masking
multiplies by the mask, as the oracle does (``x * 0`` keeps the sign of a zero). A float64
model computes everything in float64 (the oracle's norms would still use fp32):
:func:`ple_layer_tolerance` uses it as the exact value. On a GPU the same code runs; its
GEMMs and reductions sum in other orders, so it meets the oracle within the tolerance, not
bit for bit.

Conv streaming state, per sequence: the last ``S = (K-1)*N`` rows of ``b`` as ``[S, hc*D]``
(oldest first; zeros at a sequence's start). A chunk convolves ``state ++ b_chunk`` and keeps
the last S rows, so any chunking gives the one-shot result bit for bit. (The oracle keeps
the same rows as ``DynamicCache`` conv state 1, ``[B, hc*D, S]``.)

Public names:

- :class:`PleLayerWeights`: the six parameters of one PLE layer, checked once, read from a
  state dict by their checkpoint names.
- :func:`ple_layer_reference`: one sequence chunk with its conv state.
- :func:`ple_layer_reference_varlen`: a flat batch of sequence chunks (``query_start_loc``),
  one state per sequence, built from the one-sequence computation.
- :func:`ple_gate_reference`: step 4 and the sigmoid, ``[.., hc]``.
- :func:`ple_gate_norm_reference`: steps 2-7 from the projections, ``(a, b)``.
- :func:`ple_layer_tolerance`: the per-element bound on two fp32 implementations' difference
  (derivation in the comment above it).
- :func:`ple_layer_enclosure`: for bf16 and fp16, an interval per value that holds every
  implementation rounding at the reference's steps (derivation in the comment above it);
  :func:`assert_within_enclosure` checks an implementation's values against it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from engramrt.errors import CheckpointError, ValidationError, describe_tensor

__all__ = [
    "MIN_ABS_SCORE",
    "PLE_CHECKPOINT_PREFIXES",
    "PleLayerEnclosure",
    "PleLayerWeights",
    "assert_within_enclosure",
    "ple_conv_state_len",
    "ple_gate_norm_reference",
    "ple_gate_reference",
    "ple_layer_enclosure",
    "ple_layer_reference",
    "ple_layer_reference_varlen",
    "ple_layer_tolerance",
]

MIN_ABS_SCORE = 1e-6
"""The floor under ``|s|`` before the square root (docs/families.md §6 step 4)."""

PLE_CHECKPOINT_PREFIXES = ("model.language_model.", "model.")
"""``<P>`` of docs/families.md §5: a composite (``qwen4_exp``) checkpoint, then a text-only one."""

_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

_CHECKPOINT_SUFFIXES = {
    "key_proj": "key_proj.weight",
    "value_proj": "value_proj.weight",
    "norm_key": "norm_key.weight",
    "norm_query": "norm_query.weight",
    "norm_conv": "norm_conv.weight",
    "conv1d": "conv1d.weight",
}
"""Field of :class:`PleLayerWeights` -> name under ``<P>layers.<i>.ple.``."""


def ple_conv_state_len(conv_kernel_size: int, ngram_size: int) -> int:
    """``S = (K - 1) * N``: the rows of ``b`` a sequence's conv state keeps."""
    return (conv_kernel_size - 1) * ngram_size


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit model dtypes; the model dtype itself for fp32 and float64."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True, eq=False)
class PleLayerWeights:
    """The parameters of one PLE layer (docs/families.md §6), one dtype (the model dtype) and one device.

    Attributes:
        key_proj: ``[hc*D, E]`` (``nn.Linear`` layout ``[out, in]``, no bias).
        value_proj: ``[D, E]``.
        norm_key, norm_query, norm_conv: ``[hc*D]``; the norms multiply by ``1 + w``.
        conv1d: ``[hc*D, 1, K]`` depthwise taps, ``[:, 0, K-1]`` the current token's.

    The sizes follow from the shapes (``D`` from ``value_proj``, ``hc`` from ``key_proj``);
    construction checks that the six agree and raises :class:`ValidationError` naming the
    parameter, what it is and what was expected.
    """

    key_proj: torch.Tensor
    value_proj: torch.Tensor
    norm_key: torch.Tensor
    norm_query: torch.Tensor
    norm_conv: torch.Tensor
    conv1d: torch.Tensor

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, torch.Tensor):
                raise ValidationError(
                    f"{field.name} is a {type(value).__name__}; expected a tensor"
                )
        dtype, device = self.value_proj.dtype, self.value_proj.device
        if dtype not in _MODEL_DTYPES:
            raise ValidationError(
                f"value_proj has {describe_tensor(self.value_proj)}; expected a model dtype "
                f"(one of {', '.join(str(d) for d in _MODEL_DTYPES)})"
            )
        if self.value_proj.dim() != 2 or 0 in self.value_proj.shape:
            raise ValidationError(
                f"value_proj has {describe_tensor(self.value_proj)}; expected a non-empty "
                f"[D, E] (hidden_size, ple_embed_dim)"
            )
        hidden_size, embed_dim = self.value_proj.shape
        key_rows = self.key_proj.shape[0] if self.key_proj.dim() == 2 else 0
        if (
            self.key_proj.dim() != 2
            or self.key_proj.shape[1] != embed_dim
            or key_rows == 0
            or (key_rows % hidden_size)
        ):
            raise ValidationError(
                f"key_proj has {describe_tensor(self.key_proj)}; expected [hc*D, E] with "
                f"D={hidden_size}, E={embed_dim} (value_proj's [D, E]) and hc >= 1"
            )
        width = key_rows
        for name in ("norm_key", "norm_query", "norm_conv"):
            norm = getattr(self, name)
            if list(norm.shape) != [width]:
                raise ValidationError(
                    f"{name} has {describe_tensor(norm)}; expected shape [{width}] ([hc*D], "
                    f"key_proj's rows)"
                )
        if (
            self.conv1d.dim() != 3
            or list(self.conv1d.shape[:2]) != [width, 1]
            or (self.conv1d.shape[2] < 1)
        ):
            raise ValidationError(
                f"conv1d has {describe_tensor(self.conv1d)}; expected [{width}, 1, K] "
                f"([hc*D, 1, ple_conv_kernel_size], K >= 1)"
            )
        for field in fields(self):
            value = getattr(self, field.name)
            if value.dtype != dtype:
                raise ValidationError(
                    f"{field.name} has {describe_tensor(value)}; expected value_proj's dtype "
                    f"{dtype} (every PLE parameter is in the model dtype)"
                )
            if value.device != device:
                raise ValidationError(
                    f"{field.name} is on {value.device}; expected value_proj's device {device}"
                )

    @property
    def hidden_size(self) -> int:
        """``D``."""
        return int(self.value_proj.shape[0])

    @property
    def hc_count(self) -> int:
        """``hc``: hidden streams."""
        return int(self.key_proj.shape[0]) // self.hidden_size

    @property
    def embed_dim(self) -> int:
        """``E``: the width of a token's concatenated rows."""
        return int(self.value_proj.shape[1])

    @property
    def conv_kernel_size(self) -> int:
        """``K``."""
        return int(self.conv1d.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype."""
        return self.value_proj.dtype

    @property
    def device(self) -> torch.device:
        return self.value_proj.device

    def to(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> PleLayerWeights:
        """A copy in ``dtype`` on ``device`` (each left as is when None)."""
        return PleLayerWeights(
            **{f.name: getattr(self, f.name).to(device=device, dtype=dtype) for f in fields(self)}
        )

    @staticmethod
    def checkpoint_names(decoder_layer: int, prefix: str) -> dict[str, str]:
        """``{field: checkpoint name}`` for decoder layer ``decoder_layer`` (0-based, ``i =
        ple_layer_id - 1``), e.g. ``model.layers.1.ple.key_proj.weight``."""
        return {
            field: f"{prefix}layers.{decoder_layer}.ple.{suffix}"
            for field, suffix in _CHECKPOINT_SUFFIXES.items()
        }

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        decoder_layer: int,
        *,
        hidden_size: int,
        hc_count: int,
        embed_dim: int,
        conv_kernel_size: int,
        prefix: str | None = None,
    ) -> PleLayerWeights:
        """The weights of the PLE layer in decoder layer ``decoder_layer`` (0-based), read by
        their checkpoint names (docs/families.md §5/§6) and checked against the sizes given.

        Args:
            state_dict: checkpoint name -> tensor (other names are ignored).
            decoder_layer: ``i = ple_layer_id - 1``.
            hidden_size, hc_count, embed_dim, conv_kernel_size: ``D``, ``hc``, ``E``, ``K``.
            prefix: ``"model.language_model."`` (composite) or ``"model."`` (text-only);
                None finds the one of :data:`PLE_CHECKPOINT_PREFIXES` the layer's names use.

        Raises:
            CheckpointError: a name is missing, both prefixes are present, or a tensor has the
                wrong shape or dtype (the message names the checkpoint name).
        """
        if prefix is None:
            found = [
                p
                for p in PLE_CHECKPOINT_PREFIXES
                if cls.checkpoint_names(decoder_layer, p)["key_proj"] in state_dict
            ]
            if len(found) != 1:
                # Two prefixes: found holds both or neither.
                candidates = [
                    cls.checkpoint_names(decoder_layer, p)["key_proj"]
                    for p in PLE_CHECKPOINT_PREFIXES
                ]
                what = "both" if found else "neither"
                raise CheckpointError(
                    f"the state dict holds {what} of {' and '.join(candidates)}; expected exactly "
                    f"one (pass prefix= to choose)"
                )
            prefix = found[0]
        names = cls.checkpoint_names(decoder_layer, prefix)
        missing = [name for name in names.values() if name not in state_dict]
        if missing:
            raise CheckpointError(
                f"PLE layer {decoder_layer}: {', '.join(missing)} missing from the state dict; "
                f"expected all of {', '.join(names.values())}"
            )
        try:
            weights = cls(**{field: state_dict[name] for field, name in names.items()})
        except ValidationError as exc:
            raise CheckpointError(f"{prefix}layers.{decoder_layer}.ple.*: {exc}") from exc
        expected = {
            "hidden_size": hidden_size,
            "hc_count": hc_count,
            "embed_dim": embed_dim,
            "conv_kernel_size": conv_kernel_size,
        }
        for size, value in expected.items():
            if getattr(weights, size) != value:
                raise CheckpointError(
                    f"{prefix}layers.{decoder_layer}.ple.*: the tensors give {size}="
                    f"{getattr(weights, size)} (key_proj {list(weights.key_proj.shape)}, "
                    f"value_proj {list(weights.value_proj.shape)}, conv1d "
                    f"{list(weights.conv1d.shape)}); expected {size}={value}"
                )
        return weights


# --------------------------------------------------------------------------
# The computation. Private functions take checked inputs; the public ones check once.
# --------------------------------------------------------------------------


def _group_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """``RMS_w``: per ``group`` columns ``x * rsqrt(mean(x^2) + eps)``, times ``1 + w``,
    in the compute dtype, rounded once to ``x``'s dtype. ``[.., n*group]`` -> same."""
    acc = accumulate_dtype(x.dtype)
    grouped = x.to(acc).unflatten(-1, (-1, group))  # [.., n, group]
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.flatten(-2) * (1.0 + weight.to(acc))).to(x.dtype)


def ple_gate_reference(key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``sigmoid(g)`` of docs/families.md §6 step 4, each step rounded to the inputs' dtype.

    Args:
        key, query: ``[.., hc, D]`` the normed key and query, one dtype.

    Returns:
        ``[.., hc]`` in that dtype. ``s = 0`` gives ``g = 0`` (``torch.sign(0) = 0``), so a
        gate of exactly 0.5; a ``copysign`` port gives ``g = +-sqrt(1e-6)`` there, which
        bf16 then hides (``sigmoid(1e-3)`` rounds to 0.5) but fp32 does not.
    """
    dtype = key.dtype
    acc = accumulate_dtype(dtype)
    dim = key.shape[-1]
    products = (key.to(acc) * query.to(acc)).to(dtype)  # [.., hc, D], k*q per element
    score = products.to(acc).sum(dim=-1).to(dtype)  # [.., hc]
    score = (score.to(acc) / math.sqrt(dim)).to(dtype)
    magnitude = score.to(acc).abs().to(dtype)
    magnitude = magnitude.to(acc).clamp_min(MIN_ABS_SCORE).to(dtype)
    root = magnitude.to(acc).sqrt().to(dtype)
    logit = (root.to(acc) * torch.sign(score.to(acc))).to(dtype)
    return torch.sigmoid(logit.to(acc)).to(dtype)


def ple_gate_norm_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    weights: PleLayerWeights,
    eps: float,
    token_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-7: ``(a, b)``, each ``[T, hc*D]``, from the projections ``key [T, hc*D]``
    and ``value [T, D]`` (model dtype): the reference's own functions, step by step.
    Unchecked (the layer's public functions check once); the reference of
    :func:`~engramrt.families.qwen4_ple.module.ple_gate_norm`."""
    dtype, acc = weights.dtype, accumulate_dtype(weights.dtype)
    hc, dim = weights.hc_count, weights.hidden_size
    num_tokens = hidden.shape[0]
    key = _group_rms_norm(key, weights.norm_key, dim, eps)
    query = _group_rms_norm(hidden, weights.norm_query, dim, eps)
    gate = ple_gate_reference(key.view(num_tokens, hc, dim), query.view(num_tokens, hc, dim))
    gated = (gate.to(acc).unsqueeze(-1) * value.to(acc).unsqueeze(-2)).to(dtype)  # [T, hc, D]
    gated = gated.flatten(-2)  # a, [T, hc*D]
    gated_normed = _group_rms_norm(gated, weights.norm_conv, dim, eps)  # b
    if token_mask is not None:
        # A multiply, as the oracle's apply_mask_to_padding_states: the zeros keep a's signs.
        keep = token_mask.to(dtype).unsqueeze(-1)
        gated, gated_normed = gated * keep, gated_normed * keep
    return gated, gated_normed


def _short_conv(
    gated_normed: torch.Tensor, conv_state: torch.Tensor, conv1d: torch.Tensor, ngram_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 8 for one sequence chunk: ``(SiLU(conv) [T, hc*D], new state [S, hc*D])``.

    ``window = state ++ b`` (``[S+T, hc*D]``); token t sits at window row ``S + t`` and tap
    j reads ``b_{t-(K-1-j)N}``, window row ``t + j*N``.
    """
    dtype, acc = gated_normed.dtype, accumulate_dtype(gated_normed.dtype)
    num_tokens = gated_normed.shape[0]
    state_len = conv_state.shape[0]
    window = torch.cat([conv_state, gated_normed])  # [S+T, hc*D]
    # A fused multiply-add per tap: float64 holds the product of two fp32 values exactly, so
    # one float64 add then a rounding to fp32 is the fused result (barring a double rounding,
    # which needs the float64 sum on an fp32 midpoint). Products of 16-bit values are exact
    # in fp32 already.
    wide = torch.float64 if acc == torch.float32 else acc
    total = torch.zeros(gated_normed.shape, dtype=acc, device=gated_normed.device)
    for tap in range(conv1d.shape[2]):
        start = tap * ngram_size
        product = conv1d[:, 0, tap].to(wide) * window[start : start + num_tokens].to(wide)
        total = (total.to(wide) + product).to(acc)
    mixed = F.silu(total.to(dtype).to(acc)).to(dtype)
    return mixed, window[window.shape[0] - state_len :]


def _ple_chunk(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    weights: PleLayerWeights,
    ngram_size: int,
    eps: float,
    conv_state: torch.Tensor,
    token_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-9 for one checked sequence chunk."""
    acc = accumulate_dtype(weights.dtype)
    # Steps 1-7 need no neighbours: the projections, then (a, b), each [T, hc*D].
    key = F.linear(rows, weights.key_proj)  # [T, hc*D]
    value = F.linear(rows, weights.value_proj)  # [T, D]
    gated, gated_normed = ple_gate_norm_reference(key, value, hidden, weights, eps, token_mask)
    mixed, new_state = _short_conv(gated_normed, conv_state, weights.conv1d, ngram_size)
    return (gated.to(acc) + mixed.to(acc)).to(weights.dtype), new_state


def _check_tokens(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    weights: PleLayerWeights,
    ngram_size: int,
    eps: float,
    token_mask: torch.Tensor | None,
) -> None:
    """The per-token inputs of both public forms (their states are checked by each)."""
    if not isinstance(ngram_size, int) or isinstance(ngram_size, bool) or ngram_size < 1:
        raise ValidationError(f"ngram_size={ngram_size!r}; expected a positive integer (N)")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValidationError(f"eps={eps!r}; expected a positive float (rms_norm_eps)")
    width = weights.hc_count * weights.hidden_size
    for name, tensor, columns in (("hidden", hidden, width), ("rows", rows, weights.embed_dim)):
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(f"{name} is a {type(tensor).__name__}; expected a tensor")
        if tensor.dim() != 2 or tensor.shape[1] != columns or tensor.shape[0] != hidden.shape[0]:
            raise ValidationError(
                f"{name} has {describe_tensor(tensor)}; expected [T, {columns}] with "
                f"T={hidden.shape[0]} ({'[T, hc*D]' if name == 'hidden' else '[T, E]'})"
            )
        if tensor.dtype != weights.dtype or tensor.device != weights.device:
            raise ValidationError(
                f"{name} has {describe_tensor(tensor, device=True)}; expected the weights' "
                f"dtype {weights.dtype} on {weights.device}"
            )
    if token_mask is not None and (
        not isinstance(token_mask, torch.Tensor)
        or token_mask.dtype != torch.bool
        or list(token_mask.shape) != [hidden.shape[0]]
        or token_mask.device != weights.device
    ):
        found = (
            describe_tensor(token_mask, device=True)
            if isinstance(token_mask, torch.Tensor)
            else type(token_mask).__name__
        )
        raise ValidationError(
            f"token_mask has {found}; expected None or torch.bool [{hidden.shape[0]}] on "
            f"{weights.device}"
        )


def _check_state(
    name: str, state: torch.Tensor, shape: list[int], weights: PleLayerWeights
) -> None:
    if not isinstance(state, torch.Tensor):
        raise ValidationError(f"{name} is a {type(state).__name__}; expected a tensor or None")
    if (
        list(state.shape) != shape
        or state.dtype != weights.dtype
        or state.device != (weights.device)
    ):
        raise ValidationError(
            f"{name} has {describe_tensor(state, device=True)}; expected {weights.dtype} "
            f"{shape} on {weights.device} (S = (K-1)*N rows of b per sequence)"
        )


def _check_starts(query_start_loc: torch.Tensor, num_tokens: int) -> list[int]:
    """``query_start_loc`` read on the host: an integer ``[B+1]`` from 0 to ``num_tokens``."""
    if (
        not isinstance(query_start_loc, torch.Tensor)
        or query_start_loc.dim() != 1
        or (query_start_loc.dtype.is_floating_point or query_start_loc.dtype == torch.bool)
    ):
        found = (
            describe_tensor(query_start_loc)
            if isinstance(query_start_loc, torch.Tensor)
            else type(query_start_loc).__name__
        )
        raise ValidationError(f"query_start_loc has {found}; expected an integer [B+1]")
    starts = [int(v) for v in query_start_loc.tolist()]
    if (
        not starts
        or starts[0] != 0
        or starts[-1] != num_tokens
        or any(later < earlier for earlier, later in itertools.pairwise(starts))
    ):
        raise ValidationError(
            f"query_start_loc={starts}; expected non-decreasing values from 0 to T={num_tokens}"
        )
    return starts


def _varlen_states(
    conv_states: torch.Tensor | None,
    num_seqs: int,
    hidden: torch.Tensor,
    weights: PleLayerWeights,
    ngram_size: int,
) -> torch.Tensor:
    """``conv_states [B, S, hc*D]`` checked, or zeros for B fresh sequences."""
    width = weights.hc_count * weights.hidden_size
    state_len = ple_conv_state_len(weights.conv_kernel_size, ngram_size)
    if conv_states is None:
        return hidden.new_zeros(num_seqs, state_len, width)
    _check_state("conv_states", conv_states, [num_seqs, state_len, width], weights)
    return conv_states


def ple_layer_reference(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    weights: PleLayerWeights,
    *,
    ngram_size: int,
    eps: float,
    conv_state: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PLE layer's increment for one sequence chunk (docs/families.md §6 steps 1-9).

    Args:
        hidden: ``[T, hc*D]`` the decoder layer's input streams, model dtype.
        rows: ``[T, E]`` each token's C table rows concatenated, model dtype.
        weights: the layer's parameters (their dtype is the model dtype).
        ngram_size: ``N``, the conv's dilation.
        eps: ``rms_norm_eps``.
        conv_state: ``[S, hc*D]`` the last ``S = (K-1)*N`` rows of ``b`` before this chunk
            (oldest first), model dtype; None at a sequence's start (zeros).
        token_mask: optional bool ``[T]``; False (padding) zeroes the token's ``a`` and
            ``b``, as the oracle's ``conv_mask`` (the caller also hashes its id as EOS,
            docs/families.md §3). The model passes none for a one-token step.

    Returns:
        ``(out [T, hc*D], new_conv_state [S, hc*D])`` in the model dtype; the decoder
        layer adds ``out`` to ``hidden``. A chunk of ``T = 0`` returns the state unchanged.

    Raises:
        ValidationError: naming the input, what it is and what was expected.
    """
    _check_tokens(hidden, rows, weights, ngram_size, eps, token_mask)
    width = weights.hc_count * weights.hidden_size
    state_len = ple_conv_state_len(weights.conv_kernel_size, ngram_size)
    if conv_state is None:
        conv_state = hidden.new_zeros(state_len, width)
    else:
        _check_state("conv_state", conv_state, [state_len, width], weights)
    return _ple_chunk(hidden, rows, weights, ngram_size, eps, conv_state, token_mask)


def ple_layer_reference_varlen(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    weights: PleLayerWeights,
    *,
    query_start_loc: torch.Tensor,
    ngram_size: int,
    eps: float,
    conv_states: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ple_layer_reference` over a flat batch: sequence ``i``'s chunk is tokens
    ``query_start_loc[i] .. query_start_loc[i+1]-1`` and carries ``conv_states[i]``.

    Args:
        hidden, rows, token_mask: as :func:`ple_layer_reference`, over all ``T`` tokens.
        query_start_loc: int ``[B+1]``, non-decreasing, from 0 to T (a sequence may have no
            tokens this step; its state is returned unchanged).
        conv_states: ``[B, S, hc*D]``, or None for B fresh sequences.

    Returns:
        ``(out [T, hc*D], new_conv_states [B, S, hc*D])``; each sequence's part equals
        :func:`ple_layer_reference` on its chunk alone, bit for bit.
    """
    _check_tokens(hidden, rows, weights, ngram_size, eps, token_mask)
    starts = _check_starts(query_start_loc, hidden.shape[0])
    conv_states = _varlen_states(conv_states, len(starts) - 1, hidden, weights, ngram_size)
    outs, states = [], []
    for seq, (start, stop) in enumerate(itertools.pairwise(starts)):
        mask = None if token_mask is None else token_mask[start:stop]
        out, state = _ple_chunk(
            hidden[start:stop], rows[start:stop], weights, ngram_size, eps, conv_states[seq], mask
        )
        outs.append(out)
        states.append(state)
    width = weights.hc_count * weights.hidden_size
    out = torch.cat(outs) if outs else hidden.new_empty(0, width)
    return out, torch.stack(states) if states else conv_states.clone()


# --------------------------------------------------------------------------
# How far two fp32 implementations of the layer may be apart.
#
# Both start from the same fp32 inputs (hidden, rows, weights, state) and compute in fp32
# (unit roundoff u = 2^-24, round to nearest, no TF32) in any order: any GEMM blocking or
# split-K, any reduction tree, FMA or not, rsqrt / sqrt / exp within 2 ulp (4u relative,
# GPU approximations included). Each is bounded against the exact result, computed here
# in float64 (its own error is ~D 2^-53 relative, far below u), by a running bound B
# propagated step by step to first order, second-order terms kept where they are cheap:
#
#  2. y = W e (E terms): |dy| <= (E + 1) u sum|W||e| (Higham's gamma_E; products rounded).
#  RMS_w(x) with input error dx, per stream of D (all three norms):
#     m = mean(x^2) + eps: |dm| <= (2 sum|x||dx| + sum dx^2) / D + (D + 3) u m
#     r = rsqrt(m): |dr| / r <= |dm| / (2 (m - |dm|)) + 4u
#     y = x r (1 + w): |dy| <= |1 + w| r (|dx| + |x| |dr| / r) + 3u |y|
#  4. p = k q: |dp| <= |dk||q| + |k||dq| + |dk||dq| + u|kq|;
#     s = sum_D p / sqrt(D): |ds| <= (sum|dp| + (D + 2) u sum|kq|) / sqrt(D).
#     g = sign(s) sqrt(max(|s|, 1e-6)):
#       ds = 0: s is exact on both sides (every product exact, e.g. a zero stream), so g
#         and the gate are exact too: a copysign port, whose gate moves by 2.5e-4 at s = 0,
#         is caught;
#       |s| > ds: the signs agree; sqrt's slope on [|s| - ds, inf) is at most
#         1 / (2 sqrt(max(|s| - ds, 1e-6))), so |dg| <= that * ds + 4u |g|;
#       else the signs may differ: |dg| <= 2 sqrt(max(|s| + ds, 1e-6)) (1 + 4u).
#     sigmoid: slope <= 1/4; evaluating 1 / (1 + exp(-g)) costs (1.5 |g| + 8) u absolute.
#  5. a = sig v: |da| <= |dsig||v| + sig|dv| + u|a|.   6. b = RMS_conv(a) as above.
#  7. masked tokens: a = b = 0 on both sides, exactly.
#  8. z = sum_j w_j b_j (K terms; the state is an input, exact): |dz| <= sum|w||db| +
#     (K + 1) u sum|w b|; c = SiLU(z): SiLU's slope lies in [-0.1, 1.1], and evaluating
#     z sigmoid(z) costs (1.5 |z| + 10) u |c|: |dc| <= 1.1 |dz| + (1.5 |z| + 10) u |c|.
#  9. out = a + c: |dout| <= |da| + |dc| + u |a + c|.
# Then |impl - other| <= B_impl + B_other = 2 B, times 1.01 for the second-order terms
# dropped, plus the smallest normal fp32 (2^-126) for values that underflow.
#
# Worst case, first order: it grows with E and D where real errors grow like their square
# roots. At the test sizes (D 32, E 16..48, random weights) it is ~2e-4..8e-4 of |out| at the
# median; the CPU oracle in fp32 uses at most ~4% of B against float64, and fp32 variants
# that sum the conv in another order at most ~0.6% of the bound against the oracle. It
# still catches the structural mistakes (a conv summed in bf16, a dropped (1 + w), a wrong
# dilation, a copysign gate at s = 0), which exceed it 16 to 10^5 times.
# --------------------------------------------------------------------------

_U32 = 2.0**-24  # fp32 unit roundoff
_FUNCTION_ULPS = 4 * _U32  # rsqrt, sqrt, exp within 2 ulp
_FP32_FLOOR = 2.0**-126


def _rms_bound(
    x: torch.Tensor, dx: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``RMS_w(x)`` (float64) and its bound, from ``x`` and its bound ``dx``."""
    xs, dxs = x.unflatten(-1, (-1, group)), dx.unflatten(-1, (-1, group))
    mean = xs.pow(2).mean(-1, keepdim=True) + eps
    dmean = (2 * (xs.abs() * dxs).sum(-1, keepdim=True) + dxs.pow(2).sum(-1, keepdim=True)) / group
    dmean = dmean + (group + 3) * _U32 * mean
    rel_r = dmean / (2 * (mean - dmean).clamp_min(eps / 2)) + _FUNCTION_ULPS
    inv_root = torch.rsqrt(mean)
    scale = (1.0 + weight.double()).abs()
    y = (xs * inv_root).flatten(-2) * (1.0 + weight.double())
    dy = scale * (inv_root * (dxs + xs.abs() * rel_r)).flatten(-2) + 3 * _U32 * y.abs()
    return y, dy


def _gate_bound(
    key: torch.Tensor, dkey: torch.Tensor, query: torch.Tensor, dquery: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``sigmoid(g)`` ``[T, hc]`` and its bound, from ``[T, hc, D]`` key and query."""
    dim = key.shape[-1]
    products = key * query
    dproducts = dkey * query.abs() + key.abs() * dquery + dkey * dquery + _U32 * products.abs()
    score = products.sum(-1) / math.sqrt(dim)
    dscore = (dproducts.sum(-1) + (dim + 2) * _U32 * products.abs().sum(-1)) / math.sqrt(dim)
    logit = torch.sign(score) * score.abs().clamp_min(MIN_ABS_SCORE).sqrt()
    agree = score.abs() > dscore
    slope = 0.5 / (score.abs() - dscore).clamp_min(MIN_ABS_SCORE).sqrt()
    flip = 2 * (score.abs() + dscore).clamp_min(MIN_ABS_SCORE).sqrt() * (1 + _FUNCTION_ULPS)
    dlogit = torch.where(agree, slope * dscore + _FUNCTION_ULPS * logit.abs(), flip)
    dlogit = torch.where(dscore == 0, torch.zeros_like(dlogit), dlogit)
    gate = torch.sigmoid(logit)
    dgate = dlogit / 4 + (1.5 * logit.abs() + 8) * _U32
    dgate = torch.where(dscore == 0, torch.zeros_like(dgate), dgate)
    return gate, dgate


def ple_layer_tolerance(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    weights: PleLayerWeights,
    *,
    ngram_size: int,
    eps: float,
    conv_state: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, bound)``: the layer's output in float64 and the per-element bound
    ``[T, hc*D]`` (float64) on the difference of two fp32 implementations given these
    inputs (derivation in the comment above).

    Arguments as :func:`ple_layer_reference` (any float dtype; used exactly). A sequence
    streamed in chunks is bounded by computing this over the whole sequence at once: each
    token's arithmetic is the same, only the state's rows are treated as exact here.
    """
    _check_tokens(hidden, rows, weights, ngram_size, eps, token_mask)
    exact_weights = weights.to(torch.float64)
    hc, dim = weights.hc_count, weights.hidden_size
    num_tokens, width = hidden.shape[0], hc * dim
    e, h = rows.double(), hidden.double()
    key_proj, value_proj = exact_weights.key_proj, exact_weights.value_proj
    emb = weights.embed_dim
    key = e @ key_proj.t()
    dkey = (emb + 1) * _U32 * (e.abs() @ key_proj.abs().t())
    value = e @ value_proj.t()
    dvalue = (emb + 1) * _U32 * (e.abs() @ value_proj.abs().t())
    key, dkey = _rms_bound(key, dkey, exact_weights.norm_key, dim, eps)
    query, dquery = _rms_bound(h, torch.zeros_like(h), exact_weights.norm_query, dim, eps)
    split = (num_tokens, hc, dim)
    gate, dgate = _gate_bound(
        key.view(split), dkey.view(split), query.view(split), dquery.view(split)
    )
    gated = (gate.unsqueeze(-1) * value.unsqueeze(-2)).flatten(-2)  # a
    dgated = dgate.unsqueeze(-1) * value.abs().unsqueeze(-2) + gate.unsqueeze(
        -1
    ) * dvalue.unsqueeze(-2)
    dgated = dgated.flatten(-2) + _U32 * gated.abs()
    normed, dnormed = _rms_bound(gated, dgated, exact_weights.norm_conv, dim, eps)  # b
    if token_mask is not None:
        keep = token_mask.double().unsqueeze(-1)
        gated, dgated, normed, dnormed = gated * keep, dgated * keep, normed * keep, dnormed * keep
    state_len = ple_conv_state_len(weights.conv_kernel_size, ngram_size)
    state = h.new_zeros(state_len, width) if conv_state is None else conv_state.to(torch.float64)
    window = torch.cat([state, normed])
    dwindow = torch.cat([torch.zeros_like(state), dnormed])
    conv = torch.zeros_like(normed)
    dconv = torch.zeros_like(normed)
    magnitude = torch.zeros_like(normed)
    for tap in range(weights.conv_kernel_size):
        taps = exact_weights.conv1d[:, 0, tap]
        rows_at = slice(tap * ngram_size, tap * ngram_size + num_tokens)
        conv = conv + taps * window[rows_at]
        dconv = dconv + taps.abs() * dwindow[rows_at]
        magnitude = magnitude + (taps * window[rows_at]).abs()
    dconv = dconv + (weights.conv_kernel_size + 1) * _U32 * magnitude
    mixed = F.silu(conv)
    dmixed = 1.1 * dconv + (1.5 * conv.abs() + 10) * _U32 * mixed.abs()
    exact = gated + mixed
    bound = dgated + dmixed + _U32 * exact.abs()
    return exact, 2 * 1.01 * bound + _FP32_FLOOR


# --------------------------------------------------------------------------
# Where a 16-bit implementation of the layer may land: an interval per value.
#
# Two bf16 (or fp16) implementations that round at the reference's steps (the module doc:
# each step computed in fp32, its result rounded to the model dtype) differ only through
# their fp32 arithmetic: the order of the GEMMs' and the reductions' sums, FMA or not,
# rsqrt / sqrt / exp within a few fp32 ulps. Such a difference moves a 16-bit result only
# where it carries the fp32 value across a rounding boundary (the midpoint between two
# 16-bit neighbours), and then by one 16-bit ulp, which the next steps carry on (a norm
# through its mean, the score through its D-sum, the gate through a square root whose
# slope is 500 at |s| = 1e-6). A first-order bound charges every step with that ulp and is
# vacuous (ple_layer_tolerance's derivation at u = 2^-9), and "a few values differ by a few
# ulps" is a count, not a bound. Instead, the set of values any such implementation can
# produce is followed step by step as an interval per value, from the exact inputs:
#
#  a. the step's exact result over its input intervals, in float64: monotone functions at
#     the ends; a product from the four corners; a sum from the ends' sums (worst case,
#     no assumption about signs or independence); RMS_w from the squares' interval, its
#     mean's and rsqrt's (one interval per stream, applied to each element); the gate
#     g = sign(s) sqrt(max(|s|, 1e-6)) then sigmoid, rounded at each step, is
#     non-decreasing in s, so its ends are the chain at the score's ends; SiLU takes its
#     minimum -0.2785 at z* = -1.2785 when the interval holds z*;
#  b. widened by that step's fp32 evaluation error (u = 2^-24):
#       a sum of n terms in any order, each addition rounded to nearest or toward zero
#       (tensor cores): below 2u each, 2 (n + 2) u sum|terms| with the division by n and
#       the + eps (Higham's gamma_n, doubled) -- key_proj and value_proj (n = E), the norms'
#       mean of squares (n = D), the score (n = D), the conv (n = K);
#       rsqrt and sqrt within 2 ulps (4u relative); the division by sqrt(D) (or a product
#       with its fp32 reciprocal) 4u; x r (1 + w) 3u; each 16-bit product u (exact in fact);
#       sigmoid 1 / (1 + exp(-g)) with a fast exp, (1.5 |g| + 8) u absolute; SiLU
#       z sigmoid(z), (2.5 |z| + 10) u |SiLU(z)|; a + c u;
#  c. rounded: rounding to nearest is monotone, so every implementation's rounded value
#     lies between the rounded ends (a double rounding, float64 to fp32 to 16 bits, is
#     monotone too), and the ends are 16-bit values again.
#
# Masked tokens are 0 on both sides, exactly; a sequence's state rows are its exact inputs
# or b's intervals. Every implementation of this kind (the reference on any device, the
# kernels, transformers' layer, torch.compile with eager's casts kept) gives values inside
# the enclosure, so two of them differ by at most its width. Where no rounding boundary
# lies within a step's fp32 band the interval is one value and stays one value downstream:
# at the test sizes (D = 32, E = 32) most outputs' enclosure is a single value, and a conv
# rounded per tap, a gate computed in fp32 and rounded once, a wrong tap, a wrong state or
# torch.compile's elided casts fall outside it. The worst-case sums grow with E and D where
# real errors grow like their square roots: at the released sizes (E = 2560, D = 2048) the
# GEMM's band 2 (E + 2) u sum|W e| is a few bf16 ulps of a typical key, so the score's and
# the gate's intervals widen and outputs get enclosures tens of ulps wide, too wide for a
# gate's rounding mistake; a wrong or reversed tap or another sequence's state still leave
# it (tests/families/qwen4_ple/test_module.py holds both sizes to these statements).
# --------------------------------------------------------------------------

_ENCLOSURE_DTYPES = (torch.bfloat16, torch.float16)
_ADD_ULP = 2 * _U32  # one fp32 addition, rounded to nearest or toward zero
_SILU_ARGMIN = -1.2784645427610738  # z* with SiLU'(z*) = 0
_ENCLOSURE_BLOCK = 1024
"""Tokens per block of the float64 per-token steps (the memory of a few ``[block, hc*D]``
float64 tensors, not of ``[T, hc*D]``)."""


@dataclass(frozen=True, eq=False)
class PleLayerEnclosure:
    """The values a 16-bit implementation of the layer that rounds at the reference's steps
    may give (derivation in the comment above :func:`ple_layer_enclosure`): every value of
    such an implementation lies in ``[low, high]``, ends included; all four in the model
    dtype (each end is a model-dtype value).

    Attributes:
        out_low, out_high: ``[T, hc*D]`` the layer's increment.
        states_low, states_high: ``[B, S, hc*D]`` each sequence's new conv state.
    """

    out_low: torch.Tensor
    out_high: torch.Tensor
    states_low: torch.Tensor
    states_high: torch.Tensor


def _round_ends(
    low: torch.Tensor, high: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step c: both ends rounded to the model dtype (back in float64, exactly)."""
    return low.to(dtype).double(), high.to(dtype).double()


def _widened(
    low: torch.Tensor, high: torch.Tensor, relative: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps b and c for an error of ``relative`` times the larger magnitude."""
    slack = relative * torch.maximum(low.abs(), high.abs())
    return _round_ends(low - slack, high + slack, dtype)


def _interval_product(
    a_low: torch.Tensor, a_high: torch.Tensor, b_low: torch.Tensor, b_high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a * b`` over intervals (broadcasting): the smallest and largest corner."""
    corners = (a_low * b_low, a_low * b_high, a_high * b_low, a_high * b_high)
    low, high = corners[0], corners[0]
    for corner in corners[1:]:
        low, high = torch.minimum(low, corner), torch.maximum(high, corner)
    return low, high


def _rms_enclosure(
    low: torch.Tensor, high: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMS_w`` over intervals ``[.., n*group]`` (float64), unrounded: ``x``'s interval
    times the stream's ``rsqrt`` interval times ``1 + w``, widened by steps b."""
    lo, hi = low.unflatten(-1, (-1, group)), high.unflatten(-1, (-1, group))
    square_high = torch.maximum(lo * lo, hi * hi)
    square_low = torch.where((lo <= 0) & (hi >= 0), 0.0, torch.minimum(lo * lo, hi * hi))
    slack = (group + 2) * _ADD_ULP
    mean_low = square_low.sum(-1, keepdim=True) * (1 - slack) / group + eps
    mean_high = square_high.sum(-1, keepdim=True) * (1 + slack) / group + eps
    inv_low = torch.rsqrt(mean_high) * (1 - _FUNCTION_ULPS)
    inv_high = torch.rsqrt(mean_low) * (1 + _FUNCTION_ULPS)
    y_low, y_high = _interval_product(lo, hi, inv_low, inv_high)
    scale = (1.0 + weight.double()).view(-1, group)
    y_low, y_high = (
        torch.minimum(y_low * scale, y_high * scale),
        torch.maximum(y_low * scale, y_high * scale),
    )
    slack_y = 3 * _U32 * torch.maximum(y_low.abs(), y_high.abs())
    return (y_low - slack_y).flatten(-2), (y_high + slack_y).flatten(-2)


def _gate_end(
    score_sum: torch.Tensor, direction: int, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """One end of the gate's interval: the rounded chain of :func:`ple_gate_reference` from
    the rounded D-sum ``score_sum`` (an end of its interval), each fp32 error taken in
    ``direction`` (-1 low, +1 high). Every step is non-decreasing in the score."""
    score = score_sum / math.sqrt(dim)
    score = (score + direction * _FUNCTION_ULPS * score.abs()).to(dtype).double()
    magnitude = score.abs().to(dtype).double()
    sign = torch.sign(score)
    toward = direction * sign  # +1: the root's larger value moves the gate this way
    floor = MIN_ABS_SCORE * (1 + toward * 2.0**-20)  # 1e-6 as fp32 or float64
    magnitude = torch.maximum(magnitude, floor).to(dtype).double()
    root = (magnitude.sqrt() * (1 + toward * _FUNCTION_ULPS)).to(dtype).double()
    logit = (root * sign).to(dtype).double()
    gate = torch.sigmoid(logit) + direction * (1.5 * logit.abs() + 8) * _U32
    return gate.to(dtype).double()


def _silu_interval(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU over ``[low, high]``, unrounded: the ends' values, and its minimum where the
    interval holds the argmin."""
    at_low, at_high = F.silu(low), F.silu(high)
    minimum = F.silu(torch.tensor(_SILU_ARGMIN, dtype=torch.float64))
    holds = (low <= _SILU_ARGMIN) & (high >= _SILU_ARGMIN)
    return torch.where(holds, minimum, torch.minimum(at_low, at_high)), torch.maximum(
        at_low, at_high
    )


def _gate_norm_enclosure(
    hidden: torch.Tensor, rows: torch.Tensor, weights: PleLayerWeights, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-7 for a block of tokens: ``(a_low, a_high, b_low, b_high)`` ``[t, hc*D]``
    float64, rounded (each end a model-dtype value)."""
    dtype = weights.dtype
    hc, dim, emb = weights.hc_count, weights.hidden_size, weights.embed_dim
    num_tokens = hidden.shape[0]
    e, h = rows.double(), hidden.double()

    def projected(proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        proj = proj.double()
        exact = e @ proj.t()
        slack = (emb + 2) * _ADD_ULP * (e.abs() @ proj.abs().t())
        return _round_ends(exact - slack, exact + slack, dtype)

    key_low, key_high = projected(weights.key_proj)
    value_low, value_high = projected(weights.value_proj)
    key_low, key_high = _round_ends(
        *_rms_enclosure(key_low, key_high, weights.norm_key, dim, eps), dtype
    )
    query_low, query_high = _round_ends(*_rms_enclosure(h, h, weights.norm_query, dim, eps), dtype)
    product_low, product_high = _widened(
        *_interval_product(key_low, key_high, query_low, query_high), _U32, dtype
    )
    split = (num_tokens, hc, dim)
    product_low, product_high = product_low.view(split), product_high.view(split)
    magnitude = torch.maximum(product_low.abs(), product_high.abs()).sum(-1)
    slack = (dim + 2) * _ADD_ULP * magnitude
    sum_low, sum_high = _round_ends(
        product_low.sum(-1) - slack, product_high.sum(-1) + slack, dtype
    )
    gate_low = _gate_end(sum_low, -1, dim, dtype).unsqueeze(-1)  # [t, hc, 1]
    gate_high = _gate_end(sum_high, +1, dim, dtype).unsqueeze(-1)
    gated_low, gated_high = _interval_product(
        gate_low, gate_high, value_low.unsqueeze(-2), value_high.unsqueeze(-2)
    )
    gated_low, gated_high = _widened(gated_low.flatten(-2), gated_high.flatten(-2), _U32, dtype)
    normed_low, normed_high = _round_ends(
        *_rms_enclosure(gated_low, gated_high, weights.norm_conv, dim, eps), dtype
    )
    return gated_low, gated_high, normed_low, normed_high


def ple_layer_enclosure(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    weights: PleLayerWeights,
    *,
    query_start_loc: torch.Tensor,
    ngram_size: int,
    eps: float,
    conv_states: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> PleLayerEnclosure:
    """Intervals that hold every value of a bf16/fp16 implementation that rounds at the
    reference's steps, whatever order its fp32 sums take (derivation in the comment above).

    Arguments as :func:`ple_layer_reference_varlen` (model dtype bf16 or fp16; used
    exactly). The reference itself, the kernels of
    :class:`~engramrt.families.qwen4_ple.module.PleLayer` and transformers' layer are such
    implementations; one that skips roundings (``torch.compile`` without
    ``emulate_precision_casts``) is not. A sequence streamed in chunks is held to this
    over the whole sequence at once: its carried state rows are its own ``b``, inside
    their intervals here. Float64 work of a few ``[1024, hc*D]`` tensors at a time, on the
    inputs' device.

    Raises:
        ValidationError: naming the input, what it is and what was expected.
    """
    _check_tokens(hidden, rows, weights, ngram_size, eps, token_mask)
    if weights.dtype not in _ENCLOSURE_DTYPES:
        raise ValidationError(
            f"weights have dtype {weights.dtype}; expected bf16 or fp16 (fp32 models have "
            f"ple_layer_tolerance)"
        )
    starts = _check_starts(query_start_loc, hidden.shape[0])
    conv_states = _varlen_states(conv_states, len(starts) - 1, hidden, weights, ngram_size)
    dtype, device = weights.dtype, hidden.device
    num_tokens, width = hidden.shape[0], weights.hc_count * weights.hidden_size
    num_seqs, state_len = conv_states.shape[0], conv_states.shape[1]
    taps = weights.conv_kernel_size
    # Steps 2-7 per token, in blocks; the ends kept in the model dtype (exact).
    ends = [torch.empty((num_tokens, width), dtype=dtype, device=device) for _ in range(4)]
    for start in range(0, num_tokens, _ENCLOSURE_BLOCK):
        block = slice(start, start + _ENCLOSURE_BLOCK)
        for end, value in zip(
            ends, _gate_norm_enclosure(hidden[block], rows[block], weights, eps), strict=True
        ):
            end[block] = value.to(dtype)
    gated_low, gated_high, normed_low, normed_high = ends
    if token_mask is not None:
        keep = token_mask.to(dtype).unsqueeze(-1)
        gated_low, gated_high = gated_low * keep, gated_high * keep
        normed_low, normed_high = normed_low * keep, normed_high * keep
    # Steps 8-9 over the flat batch: window rows are every sequence's state (sequence i's
    # at i*S), then the tokens' b; token t of sequence i at position p reads tap j from
    # b[t - (K-1-j)*N] when p >= (K-1-j)*N, else from its state's row S + p - (K-1-j)*N.
    counts = torch.tensor(
        [b - a for a, b in itertools.pairwise(starts)], dtype=torch.int64, device=device
    )
    chunk_starts = torch.tensor(starts[:-1], dtype=torch.int64, device=device)
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), counts)
    tokens = torch.arange(num_tokens, device=device)
    position = tokens - chunk_starts[seq]
    states = conv_states.reshape(num_seqs * state_len, width)
    window_low = torch.cat([states, normed_low])
    window_high = torch.cat([states, normed_high])
    chunk_base = num_seqs * state_len
    conv_low = torch.zeros((num_tokens, width), dtype=torch.float64, device=device)
    conv_high = torch.zeros_like(conv_low)
    magnitude = torch.zeros_like(conv_low)
    for tap in range(taps):
        back = (taps - 1 - tap) * ngram_size
        source = position - back
        index = torch.where(
            source >= 0, chunk_base + tokens - back, seq * state_len + state_len + source
        )
        weight = weights.conv1d[:, 0, tap].double()
        low, high = _interval_product(
            weight, weight, window_low.index_select(0, index).double(),
            window_high.index_select(0, index).double(),
        )  # fmt: skip
        conv_low, conv_high = conv_low + low, conv_high + high
        magnitude = magnitude + torch.maximum(low.abs(), high.abs())
    slack = (taps + 2) * _ADD_ULP * magnitude
    conv_low, conv_high = _round_ends(conv_low - slack, conv_high + slack, dtype)
    mixed_low, mixed_high = _silu_interval(conv_low, conv_high)
    slack = (2.5 * torch.maximum(conv_low.abs(), conv_high.abs()) + 10) * _U32
    slack = slack * torch.maximum(mixed_low.abs(), mixed_high.abs())
    mixed_low, mixed_high = _round_ends(mixed_low - slack, mixed_high + slack, dtype)
    out_low, out_high = _widened(
        gated_low.double() + mixed_low, gated_high.double() + mixed_high, _U32, dtype
    )
    # New states: row r of sequence i is row r + count_i of (state ++ chunk).
    source = torch.arange(state_len, device=device).unsqueeze(0) + counts.unsqueeze(1)
    index = torch.where(
        source < state_len,
        torch.arange(num_seqs, device=device).unsqueeze(1) * state_len + source,
        chunk_base + chunk_starts.unsqueeze(1) + source - state_len,
    ).reshape(-1)
    shape = (num_seqs, state_len, width)
    return PleLayerEnclosure(
        out_low=out_low.to(dtype),
        out_high=out_high.to(dtype),
        states_low=window_low.index_select(0, index).view(shape),
        states_high=window_high.index_select(0, index).view(shape),
    )


def assert_within_enclosure(
    found: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    *,
    label: str,
    reference: torch.Tensor | None = None,
    show: int = 6,
) -> None:
    """Raise ``AssertionError`` unless every value of ``found`` lies in ``[low, high]`` (NaN
    never does), listing the worst values outside (index, value, interval, and the
    ``reference``'s value when given). How many values differ from the ``reference``'s
    bits is reported as information only: it is not the criterion."""
    if found.shape != low.shape:
        raise AssertionError(f"{label} has shape {tuple(found.shape)}; expected {tuple(low.shape)}")
    value, lo, hi = found.double(), low.double(), high.double()
    bad = ~((value >= lo) & (value <= hi))
    if not bool(bad.any()):
        return
    distance = torch.where(value < lo, lo - value, value - hi).nan_to_num(nan=math.inf)
    excess = torch.where(bad, distance, -math.inf)
    worst = torch.topk(excess.flatten(), k=min(show, int(bad.sum()))).indices.tolist()
    lines = [
        f"{label}: {int(bad.sum())} of {found.numel()} values lie outside the enclosure of "
        f"the reference's rounding steps (ple_layer_enclosure)"
    ]
    if reference is not None:
        bits = {2: torch.int16, 4: torch.int32}[found.element_size()]
        differ = int((found.view(bits) != reference.to(found.dtype).view(bits)).sum())
        lines[0] += f"; {differ} differ from the reference's bits (information)"
    for flat in worst:
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), found.shape))
        line = (
            f"  {index}: {found[index].item()!r} not in [{low[index].item()!r}, "
            f"{high[index].item()!r}]"
        )
        if reference is not None:
            line += f", reference {reference[index].item()!r}"
        lines.append(line)
    raise AssertionError("\n".join(lines))
