"""Load Qwen4-Exp PLE weights the way serving engines load a model: ``(name, tensor)`` pairs.

An engine walks its checkpoint once and hands every tensor, in whatever order the files
give them, to its modules' ``load_weights``. :class:`PleWeightLoader` is that entry point
for the PLE part of a model: it fills one bf16 store per PLE layer (a rank's values of
every row, any tier) and the layers' :class:`~engramrt.families.qwen4_ple.serving.PleHead`
weights, picks the PLE tensors out of the stream by name and ignores every other one.

Names are the family's tensor roles (:meth:`Qwen4PleFamily.tensor_roles
<engramrt.families.qwen4_ple.family.Qwen4PleFamily.tensor_roles>`), matched from
``layers.{i}.ple.`` on, so any prefix an engine keeps or strips works. The table comes
whole (``...ple_embedding.ngram_embedding.weight``) or as the ``torch.chunk`` row shards
``save_pretrained`` writes (``...ngram_embedding.shard_<k>.weight``, ``split_ngram_parts``
of them): shard ``k`` holds rows ``[k c, min((k+1) c, R))``, ``c = ceil(R / parts)``, and
its row count is checked against that, so a shard can never land at the wrong rows.

Checks at the door (a :class:`~engramrt.errors.CheckpointError` naming the tensor): a
``.ple.`` name of no role, a decoder layer without PLE, a wrong shape or dtype (the table
must be bf16, as the stores hold it; weights in the heads' model dtype), a value that is
not finite, a tensor given twice, hash buffers that disagree with the config's constants.
:meth:`PleWeightLoader.finish` names every tensor (or table shard) still missing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch

from engramrt.checkpoint.finite import check_head_weight
from engramrt.errors import CheckpointError, ValidationError, describe_tensor
from engramrt.families.qwen4_ple.family import Qwen4PleFamily
from engramrt.families.qwen4_ple.loading import FamilySource, ple_family
from engramrt.families.qwen4_ple.serving import PleHead
from engramrt.lookup.tiers import RowStore
from engramrt.plan import width_slice

__all__ = ["PleWeightLoader"]

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.ple\.(.+)$")
_SHARD = re.compile(r"^ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
_WHOLE = "ple_embedding.ngram_embedding.weight"
_WEIGHTS = ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d")
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class PleWeightLoader:
    """Fill PLE stores and heads from an engine's ``(name, tensor)`` stream.

    Args:
        config: the family (or what :class:`Qwen4PleFamily` is built from).
        stores: one bf16 store per PLE layer, ``R`` rows of this rank's values
            (``make_store(..., row_format=BF16)``; ``E`` = the rank's value count).
        heads: one :class:`PleHead` per PLE layer (or an empty list: tables only).
        tp, rank: the tensor-parallel rank whose values the stores hold (the
            ``embedding_colwise`` rule, :func:`engramrt.plan.width_slice`).
    """

    def __init__(
        self,
        config: FamilySource,
        stores: Sequence[RowStore],
        heads: Sequence[PleHead] = (),
        *,
        tp: int = 1,
        rank: int = 0,
    ) -> None:
        family = ple_family(config)
        cfg = family.config
        self.family: Qwen4PleFamily = family
        n_layers = cfg.n_layers
        if len(stores) != n_layers or (heads and len(heads) != n_layers):
            raise ValidationError(
                f"{len(stores)} stores and {len(heads)} heads; expected one store per PLE "
                f"layer ({n_layers}) and one head each, or no heads"
            )
        self.values = width_slice(cfg.table_width, tp, rank)
        for index, store in enumerate(stores):
            expected = (family.constants.table_rows[index], self.values[1] - self.values[0])
            if not isinstance(store, RowStore) or (store.num_rows, store.E) != expected:
                found = (
                    f"{store.num_rows} rows of {store.E} values"
                    if isinstance(store, RowStore)
                    else f"a {type(store).__name__}"
                )
                raise ValidationError(
                    f"stores[{index}] holds {found}; expected a RowStore of R = {expected[0]} "
                    f"rows of {expected[1]} values (rank {rank} of tp={tp})"
                )
        self.stores = list(stores)
        self.heads = list(heads)
        self._ple_index = {layer: index for index, layer in enumerate(cfg.decoder_layer_indices)}
        rows = family.constants.table_rows
        self._chunk = [-(-r // cfg.split_ngram_parts) for r in rows]
        self._shards_needed = [-(-r // c) for r, c in zip(rows, self._chunk, strict=True)]
        self._seen: set[str] = set()
        self._table_parts: list[set[int | str]] = [set() for _ in range(n_layers)]
        self._weights: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers)]
        self._roles = {(role.layer_id, role.role): role for role in family.tensor_roles()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Take the PLE tensors of ``weights`` (any order; may be called repeatedly);
        returns the names it took. Every other tensor is ignored."""
        taken: set[str] = set()
        for name, tensor in weights:
            match = _NAME.search(name)
            if match is None:
                continue
            decoder_layer, part = int(match.group(1)), match.group(2)
            index = self._ple_index.get(decoder_layer)
            if index is None:
                raise CheckpointError(
                    f"tensor {name!r}: decoder layer {decoder_layer} has no PLE (ple_layer_ids "
                    f"{list(self.family.layer_ids)}: decoder layers "
                    f"{sorted(self._ple_index)})"
                )
            if name in self._seen:
                raise CheckpointError(f"tensor {name!r} given twice")
            self._take(name, index, part, tensor)
            self._seen.add(name)
            taken.add(name)
        return taken

    def _take(self, name: str, index: int, part: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"tensor {name!r} is a {type(tensor).__name__}")
        shard = _SHARD.match(part)
        if part == _WHOLE or shard is not None:
            self._take_rows(name, index, None if shard is None else int(shard.group(1)), tensor)
        elif part.startswith("ple_embedding.") and part[14:] in _BUFFERS:
            self._check_buffer(name, index, part[14:], tensor)
        elif part.endswith(".weight") and part[:-7] in _WEIGHTS:
            self._take_weight(name, index, part[:-7], tensor)
        else:
            raise CheckpointError(
                f"tensor {name!r} is under '.ple.' but matches no PLE role; expected "
                f"{_WHOLE}, ple_embedding.ngram_embedding.shard_<k>.weight, the hash buffers "
                f"{', '.join(_BUFFERS)} or {', '.join(w + '.weight' for w in _WEIGHTS)}"
            )

    def _take_rows(self, name: str, index: int, shard: int | None, tensor: torch.Tensor) -> None:
        rows, width = self.family.constants.table_rows[index], self.family.config.table_width
        if shard is None:
            begin, end = 0, rows
        else:
            chunk = self._chunk[index]
            if shard >= self._shards_needed[index]:
                raise CheckpointError(
                    f"tensor {name!r}: shard {shard} of a table of R = {rows} rows in "
                    f"split_ngram_parts={self.family.config.split_ngram_parts} parts; expected "
                    f"shards 0..{self._shards_needed[index] - 1}"
                )
            begin, end = shard * chunk, min((shard + 1) * chunk, rows)
        if tensor.dtype != torch.bfloat16 or list(tensor.shape) != [end - begin, width]:
            raise CheckpointError(
                f"tensor {name!r} has {describe_tensor(tensor)}; expected torch.bfloat16 "
                f"[{end - begin}, {width}] (table rows [{begin}, {end}) of R = {rows}; the "
                f"stores hold bf16 rows)"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"tensor {name!r} holds NaN or inf")
        parts = self._table_parts[index]
        if (shard is None and parts) or "whole" in parts:
            raise CheckpointError(
                f"tensor {name!r}: PLE layer {self.family.layer_ids[index]}'s table was given "
                f"both whole and as shards; expected one form"
            )
        values = tensor[:, self.values[0] : self.values[1]].contiguous()
        self.stores[index].write_rows(begin, values.view(torch.uint8))
        parts.add("whole" if shard is None else shard)

    def _check_buffer(self, name: str, index: int, buffer: str, tensor: torch.Tensor) -> None:
        consts = self.family.constants
        expected = {
            "layer_multipliers": consts.multipliers,
            "ngram_heads_vocab_sizes": consts.head_sizes,
            "ngram_heads_offsets": consts.offsets,
        }[buffer][index]
        if tensor.dtype != torch.int64 or tensor.cpu().tolist() != expected.tolist():
            raise CheckpointError(
                f"tensor {name!r} is {describe_tensor(tensor)} {tensor.cpu().tolist()[:6]}; "
                f"expected int64 {expected.tolist()[:6]}: the config's hash constants (another "
                f"config's checkpoint?)"
            )

    def _take_weight(self, name: str, index: int, field: str, tensor: torch.Tensor) -> None:
        role = self._roles[(self.family.layer_ids[index], field)]
        if list(tensor.shape) != list(role.shape) or str(tensor.dtype)[6:] not in role.dtypes:
            raise CheckpointError(
                f"tensor {name!r} has {describe_tensor(tensor)}; expected shape "
                f"{list(role.shape)} in one of {', '.join(role.dtypes)}"
            )
        check_head_weight(tensor, name=name)
        kept = self._weights[index]
        kept[field] = tensor
        if self.heads and len(kept) == len(_WEIGHTS):
            head = self.heads[index]
            try:
                head.load_weights(**{f: t.to(head.device) for f, t in kept.items()})
            except ValidationError as exc:
                raise CheckpointError(f"PLE layer {self.family.layer_ids[index]}: {exc}") from exc

    def missing(self) -> list[str]:
        """What is still missing: each layer's table (or its shards) and weights."""
        missing: list[str] = []
        for index, layer in enumerate(self.family.layer_ids):
            parts = self._table_parts[index]
            if "whole" not in parts:
                absent = [k for k in range(self._shards_needed[index]) if k not in parts]
                if len(absent) == self._shards_needed[index]:
                    missing.append(f"PLE layer {layer}: its table (whole or in shards)")
                elif absent:
                    missing.append(f"PLE layer {layer}: table shards {absent}")
            if self.heads:
                missing += [
                    f"PLE layer {layer}: {field}" for field in _WEIGHTS
                    if field not in self._weights[index]
                ]  # fmt: skip
        return missing

    def finish(self) -> None:
        """Raise a :class:`CheckpointError` naming everything still missing; flush the
        stores (a file-backed tier makes its rows durable)."""
        missing = self.missing()
        if missing:
            raise CheckpointError(f"missing PLE tensors: {'; '.join(missing)}")
        for store in self.stores:
            store.flush()
