"""One engine step as a value every family reads: :class:`EngineStep`.

An engine step is the same thing to every memory family: a flat, ragged batch of tokens
(``input_ids``, ``positions``, ``query_start_loc``) with whatever the engine keeps between
steps (lookback ids, KV slots and blocks, request rows). Each family's row-id maker
reads the fields it needs (DeepSeek Engram's hasher: lookback ids or a history store
keyed by KV slots or request rows; Qwen4-Exp PLE: the request rows of its state pool);
the runtime reads the shape and passes the step to the heads.

An engine that keeps its requests' token ids on the host can attach the same step on
the CPU as :attr:`EngineStep.host` (a *host mirror*): the runtime then makes the row ids
of the layers whose rows are gathered on the CPU from the mirror, without waiting for
the device (:meth:`~engramrt.runtime.EngramRuntime.plan`). ``HashBatch``
(:mod:`engramrt.hashing`) is this class's older name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import numpy as np
import torch

from engramrt.errors import ValidationError

__all__ = ["EngineStep"]


@dataclass
class EngineStep:
    """One engine step, flattened and ragged (SPEC §5). All tensors on one device.

    Attributes:
        input_ids: ``[T]`` tokenizer ids (int32/int64). Rows after
            ``query_start_loc[-1]`` are padding (e.g. CUDA-graph padding).
        positions: ``[T]`` position of each token in its request; a
            request's chunk holds consecutive positions.
        query_start_loc: ``[R+1]`` request r owns tokens
            ``qsl[r] .. qsl[r+1]-1``; padded requests repeat the last boundary.
        dead_mask: optional ``[T]`` bool, True for dead tokens (image spans).
        lookback_token_ids: optional ``[R, N-1]`` tokenizer ids; column j is
            the token at position ``chunk_start - 1 - j``, -1 where unknown.
        lookback_dead: optional ``[R, N-1]`` bool dead mask of the lookback ids.
        slot_mapping: ``[T]`` KV slot of each token (-1: none), for a
            :class:`~engramrt.hashing.SlotHashCache`.
        block_table: ``[R, max_blocks]`` KV blocks of each request, for a
            :class:`~engramrt.hashing.SlotHashCache`.
        request_slots: ``[R]`` row of each request in a per-request store (a
            :class:`~engramrt.hashing.RequestHistory`, a PLE state pool).
        host: optional, the same step on the CPU (its tensors on the host, its history
            in ``lookback_token_ids``): the host mirror the runtime makes host-side row
            ids from. Not moved by :meth:`to`.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    dead_mask: torch.Tensor | None = None
    lookback_token_ids: torch.Tensor | None = None
    lookback_dead: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    request_slots: torch.Tensor | None = None
    host: EngineStep | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.query_start_loc.shape[0]) - 1

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str) -> EngineStep:
        """The same step with every tensor on ``device`` (the host mirror stays as it is)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return EngineStep(**moved)

    def with_host(self, host: EngineStep | None = None) -> EngineStep:
        """The same step with a host mirror: ``host``, or (None) this step's own tensors
        copied to the CPU (a synchronising copy when they live on a device: for tests
        and tools; an engine builds the mirror from the ids it already has)."""
        mirror = self.to("cpu") if host is None else host
        if not isinstance(mirror, EngineStep):
            raise ValidationError(
                f"host is a {type(mirror).__name__}; expected an EngineStep on the CPU"
            )
        return dataclasses.replace(self, host=dataclasses.replace(mirror, host=None))

    @classmethod
    def single(
        cls, token_ids: np.ndarray | list[int], start: int = 0, device: str | torch.device = "cpu"
    ) -> EngineStep:
        """A step of one request: ``token_ids`` at positions ``start, start+1, ...``."""
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=device)
        t_len = int(ids.shape[0])
        return cls(
            input_ids=ids,
            positions=torch.arange(start, start + t_len, device=device, dtype=torch.int64),
            query_start_loc=torch.tensor([0, t_len], device=device, dtype=torch.int32),
        )
