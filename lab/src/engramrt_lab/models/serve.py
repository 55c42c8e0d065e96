"""Load a trained model directory and serve it: loss, greedy generation, eager reference.

::

    model = load_model("DIR", TablePlacement("host", device="cpu"))
    loss = model.evaluate()                           # fp8 model, held-out sample
    result = model.generate([prompt_a, prompt_b], max_new_tokens=16)
    assert result.tokens == [model.reference_generate(p, 16).tokens for p in (prompt_a, prompt_b)]

:meth:`TinyEngramModel.generate` runs requests the way an engine does: the
scheduler of the engine simulator (:class:`engramrt.testing.Scheduler`: paged
KV blocks, a content-keyed prefix cache) decides blocks, slots and prefix
hits; each step is a vLLM-v1 runner step (:class:`engramrt.testing.VllmView`)
that goes through :func:`~engramrt.adapters.from_vllm_step` into
:meth:`EngramRuntime.plan <engramrt.runtime.EngramRuntime.plan>`, and the
backbone (keeping a KV cache per request) calls
:meth:`~engramrt.runtime.EngramRuntime.run` at each Engram block:

- the first request: its prompt prefilled in chunks of ``chunk_size``, then
  greedy decode steps, one of which is a speculative step: the pending
  token plus ``drafts`` draft tokens are verified in one step; drafts that
  greedy decoding would not produce are rejected and rolled back in the
  scheduler (its blocks past the kept tokens given back), in the backbone's
  KV cache and in the runtime's hash history;
- every later request: the prefix cache's longest chain of whole KV blocks of
  ``block_size`` equal to its prompt's (at least one token left to compute)
  is a prefix-cache hit: its keys/values are copied from the earlier request
  that computed them, and its hash history comes from those KV slots
  (``history="slot"``), from lookback ids (``"lookback"``) or from a seeded
  :class:`~engramrt.hashing.RequestHistory` (``"request"``); the rest is
  prefilled in chunks, then greedy decode.

Greedy means argmax over the K kept ids but the document-start token
(:data:`~engramrt_lab.models.vocab.BOS_TOKEN_ID`: it starts a prompt, and after
one the model would begin another document; a model that saw few documents
end predicts runs of it) and ``<other>`` (it has no text): neither is ever
emitted. :meth:`TinyEngramModel.reference_generate` is the eager
reference of the same fp8 model: each new token from a full-sequence
forward, row ids from :func:`~engramrt.hashing.hash_sequence`, rows from
:func:`~engramrt.lookup.lookup_rows_reference` of the packed rows read
straight from the checkpoint, no runtime, no KV cache. The two must give the
same tokens.

Gate values: per token and Engram layer, the gate of SPEC §8 averaged over
the ``hc`` streams (:func:`~engramrt.gate.gate_values_reference` of the
layer's input and kv), where the layer lets its memory in.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramrt._device import resolve_device
from engramrt.config import EngramConfig
from engramrt.errors import CheckpointError, ValidationError
from engramrt.gate import gate_values_reference
from engramrt.hashing import (
    HashConstants,
    NgramHasher,
    hash_sequence,
)
from engramrt.layer import EngramHead
from engramrt.lookup import lookup_rows_reference
from engramrt.lookup.tiers import TablePlacement, check_placement
from engramrt.testing import Chunk, Request, VllmEngine
from engramrt.tokenmap import TokenMap
from engramrt_lab.models import artifacts
from engramrt_lab.models.corpus import EvalSegments
from engramrt_lab.models.lm import KVCache, LMConfig, TinyLM, next_token_loss_sum
from engramrt_lab.models.vocab import BOS_TOKEN_ID, Vocab

__all__ = [
    "HISTORY_MODES",
    "GenerationResult",
    "ReferenceResult",
    "TinyEngramModel",
    "load_model",
]

HISTORY_MODES = ("slot", "request", "lookback")


@dataclass
class ReferenceResult:
    """Greedy tokens of the eager reference.

    Attributes:
        tokens: the generated tokenizer ids.
        gates: ``[len(prompt) + len(tokens) - 1, L]`` gate per position of
            the last forward (mean over streams).
    """

    tokens: list[int]
    gates: np.ndarray


@dataclass
class GenerationResult:
    """What :meth:`TinyEngramModel.generate` did.

    Attributes:
        tokens: per request, the generated tokenizer ids.
        gates: per request, ``[positions, L]``: the gate (mean over streams)
            of every position that was fed through the model (prompt and
            generated tokens but the last), from the step that last computed
            it (positions of a prefix-cache hit: the first request's values).
        steps: one entry per engine step: ``{"request", "kind", "start",
            "tokens"}``; kind is ``prefill``, ``decode`` or ``verify``.
        prefix_hit_tokens: per request, the positions taken from the first
            request's cache (0 for the first).
        rejected_drafts: draft tokens rejected (and rolled back) in all.
        accepted_drafts: draft tokens accepted.
        cache_stats: per Engram layer, the source's counters (a cache's), or None.
    """

    tokens: list[list[int]] = field(default_factory=list)
    gates: list[np.ndarray] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    prefix_hit_tokens: list[int] = field(default_factory=list)
    rejected_drafts: int = 0
    accepted_drafts: int = 0
    cache_stats: list[Any] = field(default_factory=list)


@dataclass
class _Request:
    index: int
    sim: Request  # the scheduler's request: tokens (prompt, then generated), blocks
    kv: KVCache
    gates: np.ndarray


@dataclass
class _Serving:
    """What one :meth:`TinyEngramModel.generate` call serves with."""

    engine: VllmEngine
    runtime: Any
    result: GenerationResult


class TinyEngramModel:
    """A loaded model directory (see :func:`load_model`).

    Attributes:
        lm: the Engram model's backbone (fp32, eval mode).
        baseline: the baseline backbone, or None when not loaded.
        lm_config: its :class:`LMConfig`.
        config: the :class:`EngramConfig` of the tables.
        vocab: the trimmed :class:`Vocab`.
        token_map: the DeepSeek-V4 :class:`TokenMap` (hashing uses real ids).
        hasher: an :class:`NgramHasher` on :attr:`device`.
        stores: one row source per Engram layer (the tier, optionally behind a cache).
        heads: one :class:`EngramHead` per Engram layer, with the trained weights.
        packed_tables: per layer, the packed fp8 rows ``[rows, E + E/32]``
            uint8 (CPU) read from the checkpoint, for the eager reference.
        sample: the held-out sample sequences.
        record: the training record of ``model.json``.
        device: where everything computes.
    """

    def __init__(
        self,
        *,
        lm: TinyLM,
        baseline: TinyLM | None,
        config: EngramConfig,
        vocab: Vocab,
        token_map: TokenMap,
        stores: list[Any],
        heads: list[EngramHead],
        packed_tables: list[torch.Tensor],
        sample: EvalSegments,
        record: dict[str, Any],
        device: torch.device,
    ) -> None:
        self.lm = lm
        self.baseline = baseline
        self.baselines: dict[str, TinyLM] = {} if baseline is None else {"baseline": baseline}
        self.lm_config: LMConfig = lm.config
        self.config = config
        self.vocab = vocab
        self.token_map = token_map
        self.consts = HashConstants.from_config(config, token_map)
        self.hasher = NgramHasher(self.consts, token_map, device)
        self.stores = stores
        self.heads = heads
        self.packed_tables = packed_tables
        self.sample = sample
        self.record = record
        self.device = device
        self._trim = torch.as_tensor(np.array(vocab.trim_map), device=device)
        bos = int(vocab.trim([BOS_TOKEN_ID])[0])
        self._not_emitted = [bos] if bos < vocab.num_kept else []  # trimmed ids
        self._tokenizer: Any = None
        self.load_heads()

    @torch.no_grad()
    def load_heads(self) -> None:
        """Load :attr:`heads` with the backbone's Engram weights (``wkv``, ``q_weight``,
        ``k_weight`` of each Engram block, as bf16): done at load; call again after
        changing the backbone's weights."""
        for head, block in zip(self.heads, self.lm_config.engram_layer_ids, strict=True):
            trained = self.lm.engram_head(block)
            head.load_weights(
                wkv=trained.served_wkv().detach().to(torch.bfloat16),
                q_weight=trained.q_weight.detach().to(torch.bfloat16),
                k_weight=trained.k_weight.detach().to(torch.bfloat16),
            )

    # -- held-out loss -------------------------------------------------------

    @torch.no_grad()
    def evaluate(
        self,
        segments: EvalSegments | None = None,
        *,
        model: str = "engram",
        batch_size: int = 8,
    ) -> float:
        """Mean next-token loss (nats) over held-out sequences (default: the sample).

        ``model="engram"``: the fp8 model, eager, whole sequences: each
        sequence hashed as one request with its lookback ids by
        :attr:`hasher`, rows from :attr:`stores`, :attr:`heads`, the backbone
        without KV cache. ``model="baseline"`` / ``"baseline_wide"``: the
        baseline backbones (the same backbone without Engram; the FLOP-matched one).
        """
        known = ("engram", *self.baselines)
        if model not in ("engram", "baseline", "baseline_wide"):
            raise ValidationError(f"model={model!r}; expected one of {', '.join(known)}")
        if model != "engram" and model not in self.baselines:
            raise ValidationError(f"model={model!r} but it was not loaded; loaded: {known}")
        segments = self.sample if segments is None else segments
        total, count = 0.0, 0
        for begin in range(0, segments.num_sequences, batch_size):
            part = segments.subset(range(begin, min(begin + batch_size, segments.num_sequences)))
            tokens = self._trim[torch.as_tensor(part.tokens, device=self.device)]
            lengths = torch.as_tensor(part.lengths, device=self.device)
            if model != "engram":
                logits = self.baselines[model](tokens)
            else:
                fns = self._eager_engram(self.segment_row_ids(part), tokens.shape, None)
                logits = self.lm(tokens, engram=fns)
            loss, n = next_token_loss_sum(logits, tokens, lengths)
            total += float(loss)
            count += n
        return total / max(count, 1)

    def segment_row_ids(self, part: EvalSegments) -> torch.Tensor:
        """Row ids ``[M*S, L, C]`` of held-out sequences ``part`` (``M`` of ``S`` tokens),
        each hashed inside its document (its lookback ids)."""
        return self.hasher(part.hash_batch(self.device))  # [M*S, L, C]

    def _eager_engram(
        self, row_ids: torch.Tensor, shape: torch.Size, gates: list[torch.Tensor] | None
    ) -> dict[int, Any]:
        """Engram layers of a whole-sequence forward: rows from the stores by ``row_ids [T, L, C]``."""
        fns = {}
        for index, block in enumerate(self.lm_config.engram_layer_ids):

            def apply(streams: torch.Tensor, index: int = index) -> torch.Tensor:
                rows = self.stores[index].lookup(row_ids[:, index])
                return self._head(index, streams, rows, gates)

            fns[block] = apply
        return fns

    def _head(
        self,
        index: int,
        streams: torch.Tensor,
        rows: torch.Tensor,
        gates: list[torch.Tensor] | None,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        shape = streams.shape
        hidden = streams.reshape(-1, shape[-2], shape[-1]).contiguous()
        head = self.heads[index]
        out, kv = head(hidden, rows.contiguous(), return_kv=True)
        return self._layer_output(index, head, shape, hidden, out, kv, gates, cache, start)

    def _layer_output(
        self,
        index: int,
        head: EngramHead,
        shape: torch.Size,
        hidden: torch.Tensor,
        out: torch.Tensor,
        kv: torch.Tensor,
        gates: list[torch.Tensor] | None,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Engram layer ``index``'s streams ``[B, S, hc, D]`` fp32 from its head's ``out``
        and ``kv`` for ``hidden [B*S, hc, D]``; appends the mean gate of each token to
        ``gates`` (if given). A model with a short convolution after its gates
        (:class:`~engramrt_lab.models.lm.ShortConv`) adds it here, over the gated values
        ``g * value`` (the gate of :func:`~engramrt.gate.gate_values_reference`): with
        ``cache`` (one request, the positions from ``start``) the values of the earlier
        positions come from it, and these positions' are written there; without, each of
        the ``B`` sequences starts at zero."""
        streams = out.float().view(shape)
        conv = self.lm.engram_head(self.lm_config.engram_layer_ids[index]).conv
        if gates is None and conv is None:
            return streams
        values = gate_values_reference(hidden, kv, head.q_weight, head.k_weight, head.eps)
        if gates is not None:
            gates.append(values.mean(dim=-1))
        if conv is None:
            return streams
        hc, dim = shape[-2], shape[-1]
        y = (values[..., None] * kv[:, hc * dim :].float()[:, None, :]).view(shape)
        history = None
        if cache is not None:
            assert cache.conv is not None  # KVCache.empty keeps them for such a model
            end = start + shape[1]
            cache.conv[index, start:end] = y[0]
            history = y.new_zeros((1, conv.context, hc, dim))
            first = max(0, start - conv.context)
            history[0, conv.context - (start - first) :] = cache.conv[index, first:start]
        return streams + conv(y, history)

    # -- eager reference -----------------------------------------------------

    @torch.no_grad()
    def reference_forward(
        self, token_ids: Sequence[int], chunk: int | None = None
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Logits ``[T, K+1]`` and gates ``[T, L]`` of one whole sequence (tokenizer ids
        from position 0): reference hashing, reference lookups of the checkpoint's packed
        rows, the heads, the backbone in one forward; with ``chunk``, in forwards of that
        many positions, each reading the earlier ones from the request's
        :class:`~engramrt_lab.models.lm.KVCache` (keys, values, and the gated values a
        short convolution reads)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        row_ids = torch.as_tensor(hash_sequence(self.token_map.compress(ids), self.consts))
        tokens = self._trim[torch.as_tensor(ids, device=self.device)][None, :]
        if not ids.size:
            raise ValidationError("token_ids is empty; expected at least one token")
        step = ids.size if chunk is None else chunk
        if step < 1:
            raise ValidationError(f"chunk={chunk!r}; expected a positive number of positions")
        cache = self._cache(ids.size)
        logits, gate_chunks = [], []
        for start in range(0, ids.size, step):
            end = min(start + step, ids.size)
            gates: list[torch.Tensor] = []
            fns = {}
            for index, block in enumerate(self.lm_config.engram_layer_ids):

                def apply(
                    streams: torch.Tensor,
                    index: int = index,
                    start: int = start,
                    end: int = end,
                    gates: list[torch.Tensor] = gates,
                ) -> torch.Tensor:
                    rows = lookup_rows_reference(
                        row_ids[start:end, index], self.packed_tables[index], self.config.head_dim
                    )
                    return self._head(index, streams, rows.to(self.device), gates, cache, start)

                fns[block] = apply
            logits.append(self.lm(tokens[:, start:end], engram=fns, cache=cache, start=start)[0])
            gate_chunks.append(
                torch.stack(gates, dim=-1) if gates else torch.zeros((end - start, 0))
            )
        return torch.cat(logits), torch.cat(gate_chunks).cpu().numpy()

    @torch.no_grad()
    def reference_check(self, prompt: Sequence[int], tokens: Sequence[int]) -> ReferenceResult:
        """The eager reference's greedy choice after each prefix of ``prompt + tokens``,
        from one full forward (teacher forcing): equal to ``tokens`` exactly when
        :meth:`reference_generate` would generate them, at the cost of one forward."""
        self._check_prompt(prompt, max(1, len(tokens)))
        sequence = [int(t) for t in prompt] + [int(t) for t in tokens]
        logits, gates = self.reference_forward(sequence[:-1] if tokens else sequence)
        greedy = self._greedy(logits[len(prompt) - 1 :])
        return ReferenceResult(greedy[: len(tokens)], gates)

    @torch.no_grad()
    def reference_generate(self, prompt: Sequence[int], max_new_tokens: int) -> ReferenceResult:
        """Greedy tokens of the eager reference (a full forward per new token)."""
        self._check_prompt(prompt, max_new_tokens)
        sequence = [int(t) for t in prompt]
        gates = np.zeros((0, len(self.lm_config.engram_layer_ids)))
        for _ in range(max_new_tokens):
            logits, gates = self.reference_forward(sequence)
            sequence.append(self._greedy(logits[-1:])[0])
        return ReferenceResult(sequence[len(prompt) :], gates)

    # -- serving through the runtime -----------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        history: str = "slot",
        chunk_size: int = 16,
        block_size: int = 8,
        speculative_step: int | None = 1,
        drafts: Sequence[int] | None = None,
    ) -> GenerationResult:
        """Greedy generation through an :class:`~engramrt.runtime.EngramRuntime`
        (see the module docstring for the schedule).

        Args:
            prompts: tokenizer ids of each request (the first is served first;
                later ones may hit its prefix cache).
            max_new_tokens: tokens generated per request.
            history: where hash history comes from: ``"slot"``
                (:class:`SlotHashCache` over the KV blocks), ``"request"``
                (:class:`RequestHistory`) or ``"lookback"`` (lookback ids only).
            chunk_size: prefill tokens per step.
            block_size: KV block size (prefix hits are whole blocks).
            speculative_step: the first request's decode step (0-based) that
                verifies drafts; None for none.
            drafts: the draft tokens (tokenizer ids of kept tokens); default
                the two least frequent kept tokens, which greedy decoding
                almost never produces, so they are rejected.
        """
        from engramrt.runtime import EngramRuntime

        if history not in HISTORY_MODES:
            raise ValidationError(f"history={history!r}; expected one of {HISTORY_MODES}")
        if not prompts:
            raise ValidationError("prompts is empty; expected at least one request")
        for prompt in prompts:
            self._check_prompt(prompt, max_new_tokens)
        for name, value in (("chunk_size", chunk_size), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValidationError(f"{name}={value!r} must be a positive integer")
        if drafts is None:
            drafts = [self.vocab.token_ids[-1], self.vocab.token_ids[-2]]
        drafts = [int(t) for t in drafts]
        if any(self.vocab.trim([t])[0] == self.vocab.other_id for t in drafts):
            raise ValidationError(f"drafts={drafts} must be kept tokenizer ids (not <other>)")
        max_len = max(len(p) for p in prompts) + max_new_tokens + len(drafts) + 1
        max_tokens = max(chunk_size, len(drafts) + 1)
        engine = VllmEngine(
            history=history,
            max_ngram_size=self.config.max_ngram_size,
            token_map=self.token_map.map,
            max_requests=len(prompts),
            max_len=max_len,
            max_tokens=max_tokens,
            max_drafts=len(drafts),
            block_size=block_size,
            device=self.device,
        )
        scheduler = engine.scheduler
        runtime = EngramRuntime(
            self.hasher,
            self.stores,
            heads=self.heads,
            max_tokens=max_tokens,
            max_requests=1,
            history=engine.history,
        )
        result = GenerationResult()
        serving = _Serving(engine, runtime, result)
        requests: list[_Request] = []
        try:
            for index, prompt in enumerate(prompts):
                sim = scheduler.admit([int(t) for t in prompt])
                assert sim is not None  # a row per prompt
                request = _Request(
                    index, sim, self._cache(max_len), np.full((max_len, len(self.heads)), np.nan)
                )
                hit = sim.computed
                if hit:  # the keys/values of an earlier request with the same prefix
                    donor = next(
                        r
                        for r in requests
                        if r.kv.length >= hit and r.sim.tokens[:hit] == sim.tokens[:hit]
                    )
                    request.kv.copy_prefix(donor.kv, hit)
                    request.gates[:hit] = donor.gates[:hit]
                result.prefix_hit_tokens.append(hit)
                requests.append(request)

                def next_tokens(chunk: Chunk, kind: str, r: _Request = request) -> list[int]:
                    return self._greedy(self._step(serving, r, chunk, kind))

                def truncate(keep: int, r: _Request = request) -> None:
                    r.kv.length = keep  # the rejected drafts' keys and values are stale

                accepted, rejected = serving.engine.serve(
                    sim,
                    len(prompt),
                    max_new_tokens,
                    next_tokens,
                    chunk_size=chunk_size,
                    speculative_step=speculative_step if index == 0 else None,
                    drafts=drafts,
                    truncate=truncate,
                )
                result.accepted_drafts += accepted
                result.rejected_drafts += rejected
                scheduler.finish(sim)
                result.tokens.append(sim.tokens[len(prompt) :])
                result.gates.append(request.gates[: len(sim.tokens) - 1].copy())
            if any(s.stats() is not None for s in self.stores):
                result.cache_stats = runtime.cache_stats()
        finally:
            runtime.close()
        return result

    def _step(self, serving: _Serving, request: _Request, chunk: Chunk, kind: str) -> torch.Tensor:
        """One engine step: ``chunk`` of ``request`` as a runner step, through the adapter
        into the runtime's plan, then the backbone; returns the chunk's logits."""
        sim, runtime = request.sim, serving.runtime
        runtime.plan(serving.engine.batch(chunk))
        gates: list[torch.Tensor] = []
        fns = {}
        for index, block in enumerate(self.lm_config.engram_layer_ids):

            def apply(streams: torch.Tensor, index: int = index) -> torch.Tensor:
                shape = streams.shape
                hidden = streams.reshape(-1, shape[-2], shape[-1]).contiguous()
                out, kv = runtime.run(index, hidden, return_kv=True)
                head = runtime.heads[index]
                return self._layer_output(
                    index, head, shape, hidden, out, kv, gates, request.kv, chunk.start
                )

            fns[block] = apply
        chunk_ids = sim.tokens[chunk.start : chunk.end]
        tokens = self._trim[torch.as_tensor(chunk_ids, device=self.device)][None, :]
        logits = self.lm(tokens, engram=fns, cache=request.kv, start=chunk.start)
        if gates:
            request.gates[chunk.start : chunk.end] = torch.stack(gates, dim=-1).cpu().numpy()
        serving.result.steps.append(
            {"request": request.index, "kind": kind, "start": chunk.start, "tokens": chunk.count}
        )
        return logits[0]

    # -- helpers ------------------------------------------------------------------

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        """Tokenizer ids of the argmax of ``logits [S, K+1]`` over the ids greedy
        decoding may emit: the kept ids but the document-start token (masked to -inf;
        ``<other>``, id K, is left out)."""
        scores = logits[:, : self.vocab.num_kept].clone()
        scores[:, self._not_emitted] = float("-inf")
        best = scores.argmax(dim=-1).cpu().numpy()
        return [int(t) for t in self.vocab.untrim(best)]

    def _cache(self, max_len: int) -> KVCache:
        return KVCache.empty(self.lm_config, max_len, self.device, torch.float32)

    def _check_prompt(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        if len(prompt) < 1:
            raise ValidationError("a prompt is empty; expected at least one token")
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1
        ):
            raise ValidationError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
        ids = np.asarray(prompt, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.token_map.vocab_size:
            raise ValidationError(
                f"a prompt holds ids outside the tokenizer's [0, {self.token_map.vocab_size})"
            )
        longest = len(prompt) + max_new_tokens + 3
        if longest > self.lm_config.max_seq_len:
            raise ValidationError(
                f"a prompt of {len(prompt)} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"the model's max_seq_len={self.lm_config.max_seq_len}"
            )

    @property
    def tokenizer(self) -> Any:
        """The DeepSeek-V4 tokenizer the token map was built from (loaded once)."""
        if self._tokenizer is None:
            from engramrt.tokenmap import load_tokenizer

            self._tokenizer = load_tokenizer(self.token_map.tokenizer_path)
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """Tokenizer ids of a text, starting with the document-start token (as in training)."""
        return [BOS_TOKEN_ID, *self.tokenizer.encode(text, add_special_tokens=False).ids]

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of tokenizer ids (special tokens kept)."""
        return str(self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=False))


def load_model(
    path: str | os.PathLike[str],
    placement: TablePlacement | None = None,
    *,
    cache_mib: float = 0.0,
    token_map: TokenMap | None = None,
    load_baseline: bool = True,
    head_backend: str = "auto",
    require_checksums: bool = True,
) -> TinyEngramModel:
    """Load a directory written by ``python -m engramrt_lab.models.train``, or the shipped
    model by its name.

    Args:
        path: the model directory, or ``"tiny-lm"`` (:data:`~engramrt_lab.models.packaged.PACKAGED_MODEL`):
            the model ``engramrt demo`` serves, from the package data of any install.
        placement: where the fp8 tables live and the compute device (see
            :class:`~engramrt.lookup.tiers.TablePlacement`: tier ``auto``,
            ``device``, ``uva``, ``host`` or ``disk``, or a tier's settings;
            tier ``disk`` needs ``disk_dir``). Default: tier ``auto`` on CUDA
            when available, else the CPU.
        cache_mib: a hot-row cache of this many MiB per layer in front of the
            tier (:class:`~engramrt.cache.CachedRowStore`); 0 for none.
        token_map: the DeepSeek-V4 token map (default: built or read once per process).
        load_baseline: also load the baseline backbone.
        head_backend: the Engram heads' gate backend (``auto``, ``triton``, ``reference``).
        require_checksums: refuse a ``model.json`` that records no checksum of itself
            (``model_json_sha256``) or of the files it names (``checksums``); False loads
            such a directory unchecked, with a warning (recorded checksums are always
            checked). See :mod:`engramrt_lab.models.artifacts`.

    Raises:
        CheckpointError: a damaged directory, naming the file and the field (a
            ``model.json`` edited after training among them).
    """
    from engramrt.checkpoint import load_tables, read_table
    from engramrt.layer import EngramHead
    from engramrt.tokenmap import default_token_map
    from engramrt_lab.models.packaged import PACKAGED_MODEL, packaged_model_dir

    directory = Path(path)
    if str(path) == PACKAGED_MODEL and not directory.exists():
        directory = packaged_model_dir()
    data = artifacts.read_model_json(directory, require_checksums=require_checksums)
    if data.get("format") != "engramrt-tiny-lm/1":
        raise ValidationError(
            f"{str(directory / artifacts.MODEL_JSON)!r} has format {data.get('format')!r}; "
            f"expected 'engramrt-tiny-lm/1'"
        )
    placement = check_placement(placement, "load_model(path, TablePlacement('host', 'cpu'))")
    if placement.tier_name == "disk" and placement.disk_dir is None:
        raise ValidationError(
            "tier='disk' needs TablePlacement(disk_dir=...) (where the packed-row files go)"
        )
    if not 0 <= cache_mib < 2**40:
        raise ValidationError(f"cache_mib={cache_mib}; expected a size in MiB >= 0")
    dev = resolve_device(placement.device)  # "cuda" is the current device, by index
    placement = dataclasses.replace(placement, device=dev)
    token_map = token_map or default_token_map()
    config = artifacts.parse_field(
        directory, data, "engram", lambda d: EngramConfig.from_hf_dict(d, name="tiny-lm")
    )
    lm_config = artifacts.parse_field(directory, data, "lm", LMConfig.from_dict)
    vocab = artifacts.parse_field(directory, data, "vocab", Vocab.from_dict)
    if vocab.size != lm_config.vocab_size:
        raise CheckpointError(
            f"{str(directory / artifacts.MODEL_JSON)!r}: field vocab.token_ids holds "
            f"{vocab.num_kept} ids; lm.vocab_size={lm_config.vocab_size} expects "
            f"{lm_config.vocab_size - 1}"
        )

    def checked(key: str) -> Path:
        file = artifacts.model_file(directory, data, key)
        artifacts.verify_checksum(directory, data, file, required=require_checksums)
        return file

    lm = TinyLM(lm_config)
    artifacts.load_weights(checked("engram_weights"), lm)
    lm = lm.to(dev).float().eval()
    baseline = baseline_wide = None
    if load_baseline:
        baseline = TinyLM(artifacts.parse_field(directory, data, "baseline_lm", LMConfig.from_dict))
        artifacts.load_weights(checked("baseline_weights"), baseline)
        baseline = baseline.to(dev).float().eval()
        if "baseline_wide_lm" in data:  # models trained before the FLOP-matched baseline lack it
            baseline_wide = TinyLM(
                artifacts.parse_field(directory, data, "baseline_wide_lm", LMConfig.from_dict)
            )
            artifacts.load_weights(checked("baseline_wide_weights"), baseline_wide)
            baseline_wide = baseline_wide.to(dev).float().eval()
    tables = checked("engram_tables")
    stores: list[Any] = load_tables(tables, config, placement, token_map=token_map)
    if cache_mib > 0:
        from engramrt.cache import cached_stores

        stores = cached_stores(stores, config, int(cache_mib * 2**20))
    heads = [EngramHead(config, device=dev, backend=head_backend) for _ in config.layer_ids]
    packed = [read_table(tables, config, i, token_map=token_map) for i in range(config.n_layers)]
    sample = artifacts.load_sample(checked("heldout_sample"))
    model = TinyEngramModel(
        lm=lm,
        baseline=baseline,
        config=config,
        vocab=vocab,
        token_map=token_map,
        stores=stores,
        heads=heads,
        packed_tables=packed,
        sample=sample,
        record=data["training"],
        device=dev,
    )
    if baseline_wide is not None:
        model.baselines["baseline_wide"] = baseline_wide
    return model
