"""A small decoder LM in the DeepSeek-V4 shape, with or without Engram.

The backbone (one class for training and serving, the Engram model and its
baseline):

- token embedding over the trimmed vocabulary (:mod:`engramrt_lab.models.vocab`),
  tied with the output projection;
- ``hc`` hyper-connection residual streams ``[..., hc, D]``: the embedding
  is copied into every stream; after the last block the streams are summed,
  RMS-normed and projected to logits;
- ``n_blocks`` blocks, each two sub-layers (causal attention, SwiGLU MLP),
  each sub-layer wrapped in a *static* hyper-connection (Zhu et al.,
  "Hyper-Connections", ICLR 2025, arXiv:2409.19606, the static variant
  SHC): learned read weights ``a [hc]`` form the sub-layer's input
  ``sum_i a_i H_i``; its output ``y`` is written back with learned weights
  ``b [hc]`` after the streams are mixed by a learned ``M [hc, hc]``:
  ``H'_j = sum_i M_ij H_i + b_j y``. Initialised as in the paper: sub-layer
  ``k`` reads stream ``k mod hc``, ``M = I``, ``b = 1``. (DeepSeek-V4 uses a
  manifold-constrained variant with a doubly stochastic mixing matrix; the
  static one is enough at this size and keeps serving a pure function of
  the weights.) Hyper-connection arithmetic runs in fp32 also under autocast;
- attention: RMSNorm, rotary positions (half-split, theta 10,000), ``n_heads``
  query heads sharing ``n_kv_heads`` key/value heads,
  :func:`torch.nn.functional.scaled_dot_product_attention`;
- Engram, at the blocks of ``engram_layer_ids``: the block first replaces
  its streams ``[T, hc, D]`` by the Engram layer's output (SPEC §8), then
  runs its sub-layers. In training that layer is :class:`TrainEngramHead`
  (float rows from an :class:`~engramrt_lab.training.EngramTable`, the gate of
  :func:`~engramrt_lab.training.engram_gate_train`); in serving it is the
  runtime's :class:`~engramrt.layer.EngramLayer`, or an
  :class:`~engramrt.layer.EngramHead` given reference rows. The model's
  forward takes it as a callable per block, so the backbone never knows
  where rows come from.

State-dict names follow DeepSeek-V4.1 checkpoints where they exist: an
Engram block's head weights are ``layers.{layer}.engram.wkv.weight``,
``layers.{layer}.engram.q_weight`` and ``layers.{layer}.engram.k_weight``
(the names :class:`~engramrt.checkpoint.EngramWeightLoader` reads).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.errors import ValidationError
from engramrt.gate import GateInputs, gate_values_reference
from engramrt.gate.reference import MIN_ABS_DOT
from engramrt_lab.training import engram_gate_train

__all__ = [
    "EngramFn",
    "HyperConnection",
    "KVCache",
    "LMConfig",
    "ShortConv",
    "TinyLM",
    "TrainEngramHead",
    "dense_parameters",
    "flops_per_token",
    "next_token_loss_sum",
    "next_token_losses",
    "no_autocast",
]

EngramFn = Callable[[torch.Tensor], torch.Tensor]
"""An Engram layer as the backbone sees it: streams ``[B, S, hc, D]`` in, the
same shape out."""


@dataclass(frozen=True)
class LMConfig:
    """Shape of the backbone.

    Attributes:
        vocab_size: trimmed vocabulary incl. the ``<other>`` id (K + 1).
        dim: D, the width of every stream.
        n_blocks: transformer blocks.
        n_heads, n_kv_heads, head_dim: attention heads (queries; shared
            keys/values) and their width.
        mlp_dim: SwiGLU hidden width.
        hc_mult: hyper-connection streams.
        max_seq_len: longest sequence (training window and serving request).
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon of the backbone.
        engram_layer_ids: blocks with an Engram layer (empty: the baseline).
        engram_cols, engram_head_dim: C and E of the Engram layers.
        engram_eps: the gate's RMSNorm epsilon (the Engram config's ``rms_norm_eps``).
        engram_conv_kernel: taps of the short convolution after each Engram gate
            (:class:`ShortConv`); 0 (default): none, the layer is SPEC §8's alone.
        engram_conv_dilation: positions between its taps (DeepSeek's demo: the largest
            n-gram order).
        engram_summed_heads: ``K`` > 0: the rows of each run of ``K`` consecutive hash
            columns (the hash heads of one n-gram order) are summed before the
            projection, which then maps ``C / K`` rows instead of ``C`` (its blocks for the
            heads of one order tied: :meth:`TrainEngramHead.served_wkv`); 0 (default):
            every column's row projected apart, as DeepSeek's.
    """

    vocab_size: int
    dim: int = 256
    n_blocks: int = 4
    n_heads: int = 4
    n_kv_heads: int = 1
    head_dim: int = 64
    mlp_dim: int = 448
    hc_mult: int = 4
    max_seq_len: int = 512
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_cols: int = 0
    engram_head_dim: int = 0
    engram_eps: float = 1e-6
    engram_conv_kernel: int = 0
    engram_conv_dilation: int = 1
    engram_summed_heads: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_blocks", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValidationError(f"{name}={value!r} must be a positive integer")
        for name in ("mlp_dim", "hc_mult", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValidationError(f"{name}={value!r} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValidationError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValidationError(f"head_dim={self.head_dim} must be even (rotary pairs)")
        object.__setattr__(self, "engram_layer_ids", tuple(self.engram_layer_ids))
        for layer in self.engram_layer_ids:
            if not 0 <= layer < self.n_blocks:
                raise ValidationError(
                    f"engram_layer_ids={list(self.engram_layer_ids)} holds {layer}; expected "
                    f"block indices in [0, n_blocks={self.n_blocks})"
                )
        for name, least in (
            ("engram_conv_kernel", 0),
            ("engram_conv_dilation", 1),
            ("engram_summed_heads", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValidationError(f"{name}={value!r}; expected an integer >= {least}")
        for name in ("engram_conv_kernel", "engram_summed_heads"):
            if getattr(self, name) and not self.engram_layer_ids:
                raise ValidationError(
                    f"{name}={getattr(self, name)} without Engram layers; "
                    f"expected 0 when engram_layer_ids is empty"
                )
        if self.engram_summed_heads and self.engram_cols % self.engram_summed_heads:
            raise ValidationError(
                f"engram_summed_heads={self.engram_summed_heads} does not divide "
                f"engram_cols={self.engram_cols}; expected the hash heads of one n-gram order"
            )
        if self.engram_layer_ids and (self.engram_cols <= 0 or self.engram_head_dim <= 0):
            raise ValidationError(
                f"engram_cols={self.engram_cols}, engram_head_dim={self.engram_head_dim}; "
                f"expected positive C and E when engram_layer_ids is set"
            )

    def baseline(self) -> LMConfig:
        """The same backbone without Engram."""
        return dataclasses.replace(
            self,
            engram_layer_ids=(),
            engram_cols=0,
            engram_head_dim=0,
            engram_conv_kernel=0,
            engram_conv_dilation=1,
            engram_summed_heads=0,
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON but those of :data:`_WRITTEN_WHEN_USED` at their defaults
        (a model written before they existed reads back the same)."""
        data = dataclasses.asdict(self)
        data["engram_layer_ids"] = list(self.engram_layer_ids)
        for name in _WRITTEN_WHEN_USED:
            if data[name] == getattr(LMConfig, name):
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LMConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValidationError(
                f"LM config has unknown field(s) {unknown}; expected {sorted(fields)}"
            )
        values: dict[str, Any] = dict(data)
        if "engram_layer_ids" in values:
            values["engram_layer_ids"] = tuple(values["engram_layer_ids"])
        return cls(**values)


_WRITTEN_WHEN_USED = ("engram_conv_kernel", "engram_conv_dilation", "engram_summed_heads")
""":class:`LMConfig` fields added after models were shipped, written only when set."""


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + self.eps)
        return normed * self.weight.float()


def rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [S, head_dim/2]`` fp32 for integer ``positions [S]``."""
    half = head_dim // 2
    inv_freq = theta ** (
        -torch.arange(half, device=positions.device, dtype=torch.float32) / half
    )  # [half]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [S, half]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, S, hd]`` by position (the halves of the last dim are the pairs)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


@dataclass
class KVCache:
    """Keys and values of one request, per block: ``[n_blocks, 2, n_kv, max_len, hd]``;
    for a model with a short convolution after its Engram gates (:class:`ShortConv`),
    also each Engram layer's gated values, ``conv [n_engram, max_len, hc, D]``, which
    the convolutions of later positions read.

    Positions ``< length`` are valid. A forward at ``start`` writes
    positions ``[start, start + S)`` and attends to ``[0, start + S)``;
    rejecting speculative tokens is setting :attr:`length` back (the stale
    entries are overwritten by the next tokens at those positions). A
    prefix-cache hit copies another request's first positions.
    """

    data: torch.Tensor
    length: int = 0
    conv: torch.Tensor | None = None

    @classmethod
    def empty(
        cls, config: LMConfig, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        shape = (config.n_blocks, 2, config.n_kv_heads, max_len, config.head_dim)
        conv = None
        if config.engram_conv_kernel:
            conv_shape = (len(config.engram_layer_ids), max_len, config.hc_mult, config.dim)
            conv = torch.zeros(conv_shape, device=device, dtype=dtype)
        return cls(torch.zeros(shape, device=device, dtype=dtype), conv=conv)

    @property
    def max_len(self) -> int:
        return int(self.data.shape[3])

    def copy_prefix(self, other: KVCache, num_tokens: int) -> None:
        """Take ``other``'s first ``num_tokens`` positions (a prefix-cache hit)."""
        if num_tokens > other.length:
            raise ValidationError(
                f"num_tokens={num_tokens} exceeds the other cache's length {other.length}"
            )
        if (self.conv is None) != (other.conv is None):
            raise ValidationError(
                "the other cache is of a model with another short convolution; expected "
                "caches of one model"
            )
        self.data[:, :, :, :num_tokens] = other.data[:, :, :, :num_tokens]
        if self.conv is not None and other.conv is not None:
            self.conv[:, :num_tokens] = other.conv[:, :num_tokens]
        self.length = num_tokens


class Attention(nn.Module):
    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """``x [B, S, D]`` at positions ``start..start+S-1`` -> ``[B, S, D]``.

        Without ``cache``: a causal forward over the S tokens (training).
        With ``cache`` (``[2, n_kv, max_len, hd]`` of this block, B = 1):
        the new keys/values are written at ``[start, start + S)`` and the
        queries attend to every cached position up to their own, through an
        explicit mask (one code path for prefill chunks, decode steps and a
        whole-sequence reference).
        """
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeat = self.n_heads // self.n_kv_heads
        if cache is None:
            if repeat > 1:
                k = k.repeat_interleave(repeat, dim=1)
                v = v.repeat_interleave(repeat, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            end = start + seq
            cache[0, :, start:end] = k[0].to(cache.dtype)
            cache[1, :, start:end] = v[0].to(cache.dtype)
            keys = cache[0, :, :end].unsqueeze(0).to(q.dtype)  # [1, n_kv, end, hd]
            values = cache[1, :, :end].unsqueeze(0).to(q.dtype)
            if repeat > 1:
                keys = keys.repeat_interleave(repeat, dim=1)
                values = values.repeat_interleave(repeat, dim=1)
            query_pos = torch.arange(start, end, device=x.device)[:, None]
            key_pos = torch.arange(end, device=x.device)[None, :]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_pos <= query_pos)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.mlp_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.mlp_dim, bias=False)
        self.w2 = nn.Linear(config.mlp_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def no_autocast(device_type: str) -> Any:
    """A context in which ``device_type``'s autocast is off (the streams' fp32 arithmetic)."""
    return torch.autocast(device_type=device_type, enabled=False)


class HyperConnection(nn.Module):
    """Static hyper-connection of one sub-layer (see the module docstring).

    Attributes:
        read: ``[hc]`` weights forming the sub-layer input from the streams.
        mix: ``[hc, hc]``, ``mix[i, j]``: how much of stream ``i`` goes into stream ``j``.
        write: ``[hc]`` weights of the sub-layer output in each stream.
    """

    def __init__(self, hc_mult: int, sublayer_index: int) -> None:
        super().__init__()
        read = torch.zeros(hc_mult)
        read[sublayer_index % hc_mult] = 1.0
        self.read = nn.Parameter(read)
        self.mix = nn.Parameter(torch.eye(hc_mult))
        self.write = nn.Parameter(torch.ones(hc_mult))

    def read_input(self, streams: torch.Tensor) -> torch.Tensor:
        """``[..., hc, D] -> [..., D]`` (fp32)."""
        with no_autocast(streams.device.type):
            return torch.einsum("...id,i->...d", streams.float(), self.read.float())

    def update(self, streams: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """Streams after the sub-layer: mixed streams plus the written output (fp32)."""
        with no_autocast(streams.device.type):
            mixed = torch.einsum("...id,ij->...jd", streams.float(), self.mix.float())
            return mixed + self.write.float()[:, None] * output.float().unsqueeze(-2)


class ShortConv(nn.Module):
    """The short convolution after the Engram gate (the Engram paper; ``ShortConv`` in
    DeepSeek's demo code; DeepSeek-V4.1 has none).

    Its input is the gated value ``y [B, S, hc, D]``, what SPEC §8 adds to the streams;
    each position's ``y`` is RMS-normed per stream (weights ``norm_weight [hc, D]``), then
    a causal depthwise convolution over positions with ``kernel`` taps ``dilation``
    apart (``weight [kernel, hc, D]``: tap ``j`` reads position ``t - (kernel - 1 - j) *
    dilation``; positions before a sequence's start read zero), then SiLU. The Engram
    layer's output is its streams plus ``y`` plus this. The taps start at zero, so a new
    layer is SPEC §8's alone.
    """

    def __init__(self, hc: int, dim: int, kernel: int, dilation: int, eps: float) -> None:
        super().__init__()
        self.kernel = kernel
        self.dilation = dilation
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(hc, dim))
        self.weight = nn.Parameter(torch.zeros(kernel, hc, dim))

    @property
    def context(self) -> int:
        """Positions before the first one that the convolution reads."""
        return (self.kernel - 1) * self.dilation

    def forward(self, y: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """``y [B, S, hc, D]`` -> ``[B, S, hc, D]`` fp32.

        ``history [B, context, hc, D]``: ``y`` at the :attr:`context` positions before
        the first of ``y`` (zeros where they precede the sequence); None: all zeros, a
        sequence's start (a training window's, whose earlier positions are not run).
        """
        batch, seq = y.shape[:2]
        expected = (batch, self.context, *y.shape[2:])
        if history is not None and tuple(history.shape) != expected:
            raise ValidationError(
                f"history has shape {tuple(history.shape)}; expected {expected}, y's "
                f"{self.context} earlier positions (kernel {self.kernel}, dilation "
                f"{self.dilation})"
            )
        with no_autocast(y.device.type):
            if history is None:
                history = y.new_zeros(expected)
            full = torch.cat((history.float(), y.float()), dim=1)  # [B, context + S, hc, D]
            scale = torch.rsqrt(full.square().mean(dim=-1, keepdim=True) + self.eps)
            normed = full * scale * self.norm_weight.float()
            out = torch.zeros_like(full[:, :seq])
            for tap in range(self.kernel):
                begin = tap * self.dilation
                out = out + normed[:, begin : begin + seq] * self.weight[tap].float()
            return F.silu(out)


class TrainEngramHead(nn.Module):
    """The Engram layer's weights and its differentiable computation on float rows.

    ``wkv``: ``[(hc+1)*D, C*E]`` (an ``nn.Linear`` weight, the checkpoint's
    ``wkv.weight`` layout; ``[(hc+1)*D, (C/K)*E]`` with ``engram_summed_heads`` K),
    ``q_weight``, ``k_weight``: ``[hc, D]``. The serving
    :class:`~engramrt.layer.EngramHead` loads the same tensors (``wkv`` as
    :meth:`served_wkv`).
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        hc, dim = config.hc_mult, config.dim
        self.num_cols = config.engram_cols
        self.head_dim = config.engram_head_dim
        self.eps = config.engram_eps
        self.summed_heads = config.engram_summed_heads
        groups = self.num_cols // self.summed_heads if self.summed_heads else self.num_cols
        self.wkv = nn.Linear(groups * self.head_dim, (hc + 1) * dim, bias=False)
        self.q_weight = nn.Parameter(torch.ones(hc, dim))
        self.k_weight = nn.Parameter(torch.ones(hc, dim))
        self.slope_floor = MIN_ABS_DOT
        """Training only: :func:`~engramrt_lab.training.engram_gate_train`'s
        ``slope_floor`` (the default is the exact gradient); not a weight."""
        self.conv = (
            ShortConv(hc, dim, config.engram_conv_kernel, config.engram_conv_dilation, self.eps)
            if config.engram_conv_kernel
            else None
        )
        """The :class:`ShortConv` after the gate (``engram_conv_kernel``), or None."""

    def forward(
        self,
        streams: torch.Tensor,
        rows: torch.Tensor,
        gates: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``streams [B, S, hc, D]``, ``rows [B*S, C, E]`` float -> streams (fp32); with
        :attr:`conv`, each of the ``B`` sequences of ``S`` positions starts its
        convolution at zero.

        With ``gates`` (evaluation only), also appends the gate of every position,
        averaged over the ``hc`` streams: ``[B, S]`` fp32 in [0, 1], detached
        (:func:`~engramrt.gate.gate_values_reference` of the same operands, the
        forward of :func:`~engramrt_lab.training.engram_gate_train`). Training passes
        none, so its step does no extra work.
        """
        shape = streams.shape
        tokens = rows.shape[0]
        if self.summed_heads:  # each order's heads' rows summed, then projected once
            rows = rows.reshape(tokens, -1, self.summed_heads, self.head_dim).sum(dim=2)
        kv = self.wkv(rows.reshape(tokens, -1))
        with no_autocast(streams.device.type):
            inputs = GateInputs(
                streams.reshape(tokens, shape[-2], shape[-1]).float(),
                kv.float(),
                self.q_weight.float(),
                self.k_weight.float(),
                self.eps,
            )
            out = engram_gate_train(inputs, slope_floor=self.slope_floor)
            if gates is not None:
                with torch.no_grad():
                    values = gate_values_reference(*inputs[:5])  # [T, hc]
                gates.append(values.mean(dim=-1).view(shape[:-2]))
            if self.conv is not None:  # y = g * value, what the gate added
                y = (out - inputs.hidden).view(shape)
                out = out + self.conv(y).reshape(out.shape)
        return out.view(shape)

    def served_wkv(self) -> torch.Tensor:
        """``wkv`` as a serving head takes it, ``[(hc+1)*D, C*E]`` over every column's row:
        with ``engram_summed_heads`` K, each block of K columns repeats the block its
        summed row has (the same products, summed in another order)."""
        weight = self.wkv.weight
        if not self.summed_heads:
            return weight
        out = weight.shape[0]
        blocks = weight.view(out, -1, 1, self.head_dim)
        return blocks.expand(-1, -1, self.summed_heads, -1).reshape(out, -1)


class Block(nn.Module):
    def __init__(self, config: LMConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.attn_hc = HyperConnection(config.hc_mult, 2 * index)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)
        self.mlp_hc = HyperConnection(config.hc_mult, 2 * index + 1)
        self.engram = TrainEngramHead(config) if index in config.engram_layer_ids else None

    def forward(
        self,
        streams: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        engram: EngramFn | None,
        cache: torch.Tensor | None,
        start: int,
    ) -> torch.Tensor:
        if engram is not None:
            streams = engram(streams)
        x = self.attn_hc.read_input(streams)
        streams = self.attn_hc.update(streams, self.attn(self.attn_norm(x), cos, sin, cache, start))
        x = self.mlp_hc.read_input(streams)
        return self.mlp_hc.update(streams, self.mlp(self.mlp_norm(x)))


class TinyLM(nn.Module):
    """The backbone; see the module docstring.

    ``forward(tokens [B, S], engram={block: fn})`` returns logits
    ``[B, S, vocab_size]`` (fp32). An Engram block needs its ``fn`` (the
    baseline has none).
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.n_blocks)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, *, engram_identity: bool = True) -> None:
        """Normal(0, std) matrices; output projections scaled by ``1/sqrt(2 n_blocks)``;
        with ``engram_identity``, the value part of every Engram ``wkv`` (its last ``D``
        output rows) zero, so each Engram layer starts as the identity (its keys, and so
        its gates, still learn)."""
        for name, param in self.named_parameters():
            if param.dim() != 2 or name.endswith(("q_weight", "k_weight", ".mix", "norm_weight")):
                continue
            scale = (
                std / math.sqrt(2 * self.config.n_blocks)
                if name.endswith(("wo.weight", "w2.weight"))
                else std
            )
            nn.init.normal_(param, 0.0, scale)
        for block in self.config.engram_layer_ids if engram_identity else ():
            wkv = self.engram_head(block).wkv.weight  # [(hc+1) D, C E]
            wkv[self.config.hc_mult * self.config.dim :].zero_()
        for block in self.config.engram_layer_ids:
            conv = self.engram_head(block).conv
            if conv is not None:  # the layer starts without it
                conv.weight.zero_()
                conv.norm_weight.fill_(1.0)

    @torch.no_grad()
    def engram_values_normal_(self, std: float = 0.02) -> None:
        """Normal(0, ``std``) value parts of every Engram ``wkv`` (its last ``D`` output
        rows), for tables whose rows start at zero: the layer is then the identity
        because the rows are, and a row that training never reaches stays so."""
        for block in self.config.engram_layer_ids:
            wkv = self.engram_head(block).wkv.weight  # [(hc+1) D, C E]
            nn.init.normal_(wkv[self.config.hc_mult * self.config.dim :], 0.0, std)

    def engram_head(self, block: int) -> TrainEngramHead:
        """The Engram weights of block ``block`` (one of ``engram_layer_ids``)."""
        head = self.layers[block].engram
        if not isinstance(head, TrainEngramHead):
            raise ValidationError(
                f"block {block} has no Engram layer; engram_layer_ids="
                f"{list(self.config.engram_layer_ids)}"
            )
        return head

    def forward(
        self,
        tokens: torch.Tensor,
        engram: Mapping[int, EngramFn] | None = None,
        *,
        cache: KVCache | None = None,
        start: int = 0,
        return_streams: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` fp32 of ``tokens [B, S]`` (trimmed ids).

        Args:
            tokens: ``[B, S]`` int trimmed ids.
            engram: per Engram block index, the layer to apply to the streams.
            cache: a request's :class:`KVCache` (B = 1): the tokens are at
                positions ``start..start+S-1``; the cache's length becomes
                ``start + S``.
            start: position of the first token (with ``cache``).
            return_streams: return the final streams ``[B, S, hc, D]`` instead.
        """
        config = self.config
        engram = engram or {}
        missing = [b for b in config.engram_layer_ids if b not in engram]
        if missing:
            raise ValidationError(
                f"engram lacks the Engram block(s) {missing}; expected a layer for every block "
                f"of engram_layer_ids={list(config.engram_layer_ids)}"
            )
        batch, seq = tokens.shape
        if cache is not None:
            if batch != 1:
                raise ValidationError(f"tokens has batch {batch}; a KV cache serves one request")
            if not 0 <= start <= cache.length or start + seq > cache.max_len:
                raise ValidationError(
                    f"start={start} with {seq} tokens; expected start in [0, {cache.length}] "
                    f"(the cache's length) and start + tokens <= {cache.max_len}"
                )
        elif start != 0:
            raise ValidationError(f"start={start} needs a cache; expected 0 without one")
        positions = torch.arange(start, start + seq, device=tokens.device)
        cos, sin = rotary_tables(positions, config.head_dim, config.rope_theta)
        h = self.embed(tokens)  # [B, S, D]
        streams = h.float().unsqueeze(-2).expand(batch, seq, config.hc_mult, config.dim)
        for index, block in enumerate(self.layers):
            streams = block(
                streams,
                cos,
                sin,
                engram.get(index),
                None if cache is None else cache.data[index],
                start,
            )
        if cache is not None:
            cache.length = start + seq
        if return_streams:
            return streams
        x = self.norm(streams.sum(dim=-2))
        return F.linear(x, self.embed.weight).float()  # tied output projection


def next_token_losses(
    logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy (nats) ``[B, S-1]`` fp32 of every prediction of padded
    sequences, and which are valid (bool ``[B, S-1]``).

    ``logits [B, S, V]`` of ``tokens [B, S]`` (trimmed ids); sequence ``b``
    has ``lengths[b]`` valid tokens, so ``lengths[b] - 1`` predictions.
    """
    seq = tokens.shape[1]
    valid = torch.arange(1, seq, device=tokens.device)[None, :] < lengths[:, None]  # [B, S-1]
    losses = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        tokens[:, 1:].reshape(-1),
        reduction="none",
    ).view(valid.shape)
    return losses, valid


def next_token_loss_sum(
    logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed :func:`next_token_losses` of the valid predictions, and their count."""
    losses, valid = next_token_losses(logits, tokens, lengths)
    return (losses * valid).sum(), int(valid.sum())


def dense_parameters(config: LMConfig) -> int:
    """Parameters of the backbone (Engram heads included, tables not)."""
    with torch.device("meta"):
        model = TinyLM(config)
    return sum(p.numel() for p in model.parameters())


def flops_per_token(config: LMConfig, seq_len: int | None = None) -> dict[str, int]:
    """Forward FLOPs per token of the matrix products (2 per multiply-add).

    ``linear``: every projection (attention, SwiGLU, Engram ``wkv``) and the tied
    output; ``attention``: scores and weighted values at the mean causal context
    of a ``seq_len`` window (``(S+1)/2`` keys); ``engram_wkv``: the part of
    ``linear`` that is Engram's. Elementwise work (norms, gates, the
    hyper-connections' mixing, a short convolution's taps) is left out; the Engram
    gate adds about ``6 hc D`` of it per layer, a short convolution ``2 kernel hc D``.
    """
    seq = config.max_seq_len if seq_len is None else seq_len
    with torch.device("meta"):
        model = TinyLM(config)
    linear = sum(
        module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear)
    )
    wkv = sum(model.engram_head(b).wkv.weight.numel() for b in config.engram_layer_ids)
    linear += config.vocab_size * config.dim  # the tied output projection
    attention = config.n_blocks * 2 * 2 * config.n_heads * config.head_dim * (seq + 1) // 2
    return {
        "linear": 2 * linear,
        "attention": attention,
        "total": 2 * linear + attention,
        "engram_wkv": 2 * wkv,
    }
