"""``EngramHead``: the Engram layer's computation on rows it is given (SPEC §8).

The head holds ``wkv`` and the gate's norm weights and computes
``out = gate(hidden, wkv(rows))``. It does not fetch rows: they come from a
:class:`~engramrt.source.RowSource` (a storage tier, a cache, an exchange,
the runtime's staged rows), so one head serves every placement of the
table. :class:`~engramrt.layer.EngramLayer` pairs a head with a source.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engramrt._device import resolve_device
from engramrt.config import EngramConfig
from engramrt.errors import CheckpointError, ValidationError, describe_tensor
from engramrt.gate import GateInputs, engram_gate
from engramrt.layer.linear import EngramLinear
from engramrt.layer.workspace import fixed_buffer, leading_rows

__all__ = ["EngramHead"]

_NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class EngramHead(nn.Module):
    """``wkv`` projection and fused gate of one Engram layer.

    Args:
        config: the Engram config (``hidden_size`` D, ``hc_mult``,
            ``head_dim`` E, ``n_cols`` C, ``rms_norm_eps``).
        device: where the weights live (default: the current CUDA device,
            else the CPU).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` for the gate.
        validate: check shapes, dtypes and devices on the host every call
            (never reads device memory). Off only for known-good callers.

    Attributes:
        wkv: the :class:`EngramLinear` projection ``[C*E] -> [(hc+1)*D]``.
        q_weight, k_weight: ``[hc, D]`` RMSNorm weights of the gate (ones
            until loaded: an unloaded head is still a valid function).
    """

    def __init__(
        self,
        config: EngramConfig,
        *,
        device: torch.device | str | None = None,
        backend: str = "auto",
        validate: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(config, EngramConfig):
            raise ValidationError(
                f"config is a {type(config).__name__}; expected an EngramConfig (load_config)"
            )
        device = resolve_device(device)
        self.config = config
        self.device = device
        self.hidden_size = config.hidden_size
        self.hc_mult = config.hc_mult
        self.head_dim = config.head_dim
        self.num_cols = config.n_cols
        self.eps = float(config.rms_norm_eps)
        self.backend = backend
        self.validate = validate
        hc, dim = self.hc_mult, self.hidden_size
        self.wkv = EngramLinear(self.num_cols * self.head_dim, (hc + 1) * dim, device=device)
        self.q_weight = nn.Parameter(
            torch.ones(hc, dim, dtype=torch.bfloat16, device=device), requires_grad=False
        )
        self.k_weight = nn.Parameter(
            torch.ones(hc, dim, dtype=torch.bfloat16, device=device), requires_grad=False
        )
        self._out: torch.Tensor | None = None  # [max_tokens, hc, D], from reserve()
        self._kv: torch.Tensor | None = None  # [max_tokens, (hc+1)*D]

    def reserve(self, max_tokens: int) -> None:
        """Allocate the fixed output ``[max_tokens, hc, D]`` and projection
        ``[max_tokens, (hc+1)*D]`` bf16 buffers (NaN-poisoned, so a slice never written
        shows), which :meth:`output_buffer` and :meth:`compute` use; the runtime calls it."""
        hc, dim, device = self.hc_mult, self.hidden_size, self.device
        self._out = fixed_buffer(max_tokens, hc, dim, dtype=torch.bfloat16, device=device)
        self._kv = fixed_buffer(max_tokens, (hc + 1) * dim, dtype=torch.bfloat16, device=device)

    def output_buffer(self, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` rows of the fixed output :meth:`reserve` allocated."""
        return leading_rows(self._out, num_tokens)

    @torch.no_grad()
    def load_weights(
        self,
        *,
        wkv: torch.Tensor,
        wkv_scale: torch.Tensor | None = None,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
    ) -> None:
        """Load the head's weights from plain tensors (any device).

        Args:
            wkv: ``[(hc+1)*D, C*E]`` bf16, or float8_e4m3fn with ``wkv_scale``.
            wkv_scale: the fp8 weight's ``weight_scale_inv``, float32
                ``[ceil((hc+1)*D / 128), ceil(C*E / 128)]``; None for bf16.
            q_weight, k_weight: ``[hc, D]`` bf16, fp16 or fp32 (kept in that dtype).

        Every tensor is checked before anything is written. Load before
        capturing a CUDA graph: a norm weight of another dtype than the one
        held gets a new tensor (a new address).

        Raises:
            CheckpointError: naming the tensor, the expected and the found
                shape and dtype.
        """
        expected = [self.hc_mult, self.hidden_size]
        for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
            if not isinstance(weight, torch.Tensor):
                raise CheckpointError(
                    f"{name} is a {type(weight).__name__}; expected a tensor {expected}"
                )
            if list(weight.shape) != expected or weight.dtype not in _NORM_DTYPES:
                raise CheckpointError(
                    f"{name} has {describe_tensor(weight)}; expected shape {expected} ([hc, D]) "
                    f"and dtype torch.bfloat16, torch.float16 or torch.float32"
                )
        self.wkv.load(wkv, wkv_scale, name="wkv")  # checks wkv and wkv_scale before writing
        for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
            held = getattr(self, name)
            if held.dtype == weight.dtype:
                held.copy_(weight)
            else:
                fresh = weight.to(self.device).contiguous()
                setattr(self, name, nn.Parameter(fresh, requires_grad=False))

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """:meth:`compute` after checking ``hidden`` ``[T, hc, D]`` and ``rows`` ``[T, C, E]``
        (contiguous bf16) on the host when :attr:`validate`."""
        if self.validate:
            self._check(hidden, rows)
        return self.compute(hidden, rows, *args, **kwargs)

    def compute(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        step: Any = None,
        out: torch.Tensor | None = None,
        kv_out: torch.Tensor | None = None,
        return_kv: bool = False,
    ) -> Any:
        """``out [T, hc, D]`` bf16 = gate(hidden, wkv(rows)), for callers that checked
        ``hidden`` and ``rows`` already (the layer; :meth:`forward` checks them); the gate
        still checks its own arguments when :attr:`validate`.

        Args:
            hidden: ``[T, hc, D]`` hidden streams (bf16; fp16/fp32 accepted), contiguous.
            rows: ``[T, C, E]`` bf16 rows of the same tokens, contiguous.
            token_mask: optional bool ``[T]``; False passes the token's hidden
                state through unchanged.
            step: the engine step (unused: an Engram head keeps no state between steps).
            out: optional contiguous bf16 ``[T, hc, D]`` to write (a fixed
                address for CUDA graphs).
            kv_out: optional contiguous bf16 ``[T, (hc+1)*D]`` for the projection
                (default: the fixed buffer of :meth:`reserve`, else a new tensor).
            return_kv: also return kv ``[T, (hc+1)*D]``.

        Returns:
            ``out`` (or a new tensor), or ``(out, kv)``.
        """
        num_tokens = rows.shape[0]
        if kv_out is None and self._kv is not None and num_tokens <= self._kv.shape[0]:
            kv_out = self._kv[:num_tokens]
        kv = self.wkv(rows.view(num_tokens, self.num_cols * self.head_dim), out=kv_out)
        inputs = GateInputs(hidden, kv, self.q_weight, self.k_weight, self.eps, token_mask)
        result = engram_gate(inputs, backend=self.backend, out=out, validate=self.validate)
        return (result, kv) if return_kv else result

    def _check(self, hidden: torch.Tensor, rows: torch.Tensor) -> None:
        expected_rows = (self.num_cols, self.head_dim)
        if (
            not isinstance(rows, torch.Tensor)
            or rows.dim() != 3
            or tuple(rows.shape[1:]) != expected_rows
            or rows.dtype != torch.bfloat16
            or not rows.is_contiguous()
        ):
            found = (
                f"{describe_tensor(rows)} (contiguous: {rows.is_contiguous()})"
                if isinstance(rows, torch.Tensor)
                else type(rows).__name__
            )
            raise ValidationError(
                f"rows has {found}; expected contiguous torch.bfloat16 [T, C, E] with "
                f"C = {self.num_cols}, E = {self.head_dim}"
            )
        if not isinstance(hidden, torch.Tensor):
            raise ValidationError(f"hidden is a {type(hidden).__name__}; expected a tensor")
        expected = [rows.shape[0], self.hc_mult, self.hidden_size]
        if list(hidden.shape) != expected:
            raise ValidationError(
                f"hidden has shape {list(hidden.shape)}; expected {expected} (T tokens of the "
                f"rows, hc, D)"
            )
        for name, tensor in (("hidden", hidden), ("rows", rows)):
            if tensor.device != self.device:
                raise ValidationError(
                    f"{name} is on {tensor.device}; expected the head's device {self.device}"
                )

    def extra_repr(self) -> str:
        return f"D={self.hidden_size}, hc={self.hc_mult}, C={self.num_cols}, E={self.head_dim}"
