"""Load Engram weights the way serving engines load a model: from ``(name, tensor)`` pairs.

An engine walks its checkpoint once and hands every tensor, in whatever
order the files give them, to each module's ``load_weights(weights)``.
:class:`EngramWeightLoader` is that entry point for the Engram part of a
model: it owns one :class:`~engramrt.lookup.tiers.RowStore` per Engram layer
(this rank's shard of the table, SPEC §7) and the layers' heads, picks the
Engram tensors out of the stream by name (:mod:`engramrt.checkpoint.names`:
DeepSeek-V4.1's names by default, with or without ``model.``), and ignores
every other tensor (the rest of the model's weights)::

    placement = TablePlacement("host", device="cuda", tp=tp, rank=rank)
    loader = EngramWeightLoader(config, placement, heads=heads)
    loader.load_weights(engine_weights_iterator)   # any order, may be called repeatedly
    loader.finish()                                 # raises naming every missing tensor
    stores, heads = loader.stores, loader.heads

It is also the one loader of engramrt's other entry points:
:meth:`EngramWeightLoader.read_checkpoint` fills the same stores and heads
from a safetensors checkpoint, reading only this rank's rows (from whole
tensors or from the per-rank files of ``engramrt convert --tp N``), and
:func:`~engramrt.checkpoint.load_table`, :func:`~engramrt.checkpoint.load_tables`
and :func:`~engramrt.checkpoint.load_layer` are calls of it.

Per Engram block ``{layer}`` the tensors are (see :data:`DEFAULT_WEIGHT_NAMES`,
:data:`DEFAULT_SCALE_NAMES`, :data:`DEFAULT_HEAD_NAMES`):

- ``layers.{layer}.engram.embed.weight``: fp8 e4m3fn ``[num_embeddings, E]``;
- ``layers.{layer}.engram.embed.weight_scale_inv`` (or ``.scale``): ue8m0
  ``[num_embeddings, E/32]``, float8_e8m0fnu or uint8 (the same bytes);
- ``layers.{layer}.engram.wkv.weight`` ``[(hc+1)*D, C*E]``, bf16 or fp8 with
  ``wkv.weight_scale_inv`` (or ``wkv.scale``) float32;
- ``layers.{layer}.engram.q_weight``, ``layers.{layer}.engram.k_weight``
  ``[hc, D]`` bf16.

Memory. The table's values and scales are two tensors that may arrive in
either order. Whichever of the two comes first, only this rank's rows of it
are kept (copied to host memory, so the caller may drop the tensor); when
its partner arrives the rows are packed in blocks of ``block_rows`` and
written into the store, and the kept copy is freed. Peak memory per layer
is therefore the store (allocated at construction) plus this rank's rows of
one tensor (the values, ``E`` bytes per row, when they come first; the
scales, ``E/32`` bytes per row, when they do) plus one packed block: a
94 GiB table is never held twice. The head's tensors (a few hundred MB) are
kept until all of a layer's have arrived, then loaded into its head.

Checks at the door: a name that contains ``.engram.`` but matches no role
of any Engram layer is a :class:`~engramrt.errors.CheckpointError` naming
the tensor (a misspelt or unexpected Engram tensor is never skipped
silently); so is a tensor of the wrong shape or dtype, or one given twice.
Missing tensors are reported by :meth:`EngramWeightLoader.finish`, each
with its layer. Only whole tensors are accepted (a checkpoint's tensors,
as engines read them) by :meth:`~EngramWeightLoader.load_weights`;
engramrt's per-rank converted files are read by
:meth:`~EngramWeightLoader.read_checkpoint`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engramrt.checkpoint.fill import fill_store
from engramrt.checkpoint.finite import check_head_weight, check_packed_rows_finite
from engramrt.checkpoint.names import DEFAULT_HEAD_NAMES, TensorNames, head_name_templates
from engramrt.checkpoint.ranks import agreed_checkpoint
from engramrt.checkpoint.reader import (
    ConfigSource,
    LayerRead,
    NamesSpec,
    SafetensorsCheckpoint,
    _iter_plan,
    _resolve,
    check_block_rows,
    check_plan_token_map,
    plan_layer_read,
    read_tensor,
)
from engramrt.errors import CheckpointError, ValidationError
from engramrt.layout import ColumnShard, EngramLayout
from engramrt.lookup.tiers import RowStore, TablePlacement, check_placement, make_store
from engramrt.packed import pack_rows, row_bytes_for
from engramrt.tokenmap import TokenMap

if TYPE_CHECKING:
    from engramrt.protocols import LayerHead

__all__ = ["ENGRAM_MARKER", "EngramWeightLoader"]

ENGRAM_MARKER = ".engram."
"""A tensor whose name contains this belongs to an Engram block: it must match a role."""

_TABLE_ROLES = ("weight", "scale")
_HEAD_ROLES = tuple(DEFAULT_HEAD_NAMES)
_WHAT = {
    "weight": "table values",
    "scale": "table scales",
    "wkv": "wkv projection",
    "wkv_scale": "wkv block scales",
    "q_weight": "gate q_weight",
    "k_weight": "gate k_weight",
}


def _describe_item(item: Any) -> str:
    if isinstance(item, tuple):
        kinds = ", ".join(type(part).__name__ for part in item)
        return f"a tuple of {len(item)} ({kinds})"
    return f"a {type(item).__name__}"


def _describe(tensor: Any) -> str:
    if isinstance(tensor, torch.Tensor):
        return f"shape {list(tensor.shape)} dtype {tensor.dtype}"
    return f"a {type(tensor).__name__}"


def _check_store(store: RowStore, shard: ColumnShard, E: int) -> None:
    if (store.num_rows, store.E, store.row_begin) != (shard.num_rows, E, shard.row_begin):
        raise ValidationError(
            f"store holds {store.num_rows} rows of E={store.E} from row {store.row_begin}; "
            f"expected {shard.num_rows} rows of E={E} from row {shard.row_begin} "
            f"(rank {shard.rank} of tp={shard.tp})"
        )


class _LayerTable:
    """One layer's table in flight: the store and the half of the rows that came first."""

    def __init__(self, store: RowStore, shard: ColumnShard) -> None:
        self.store = store
        self.shard = shard
        self.held: dict[str, torch.Tensor] = {}  # role -> this shard's rows, host uint8
        self.names: dict[str, str] = {}  # role -> the tensor name that delivered it
        self.written = False


class EngramWeightLoader:
    """Owns a model's Engram stores and heads and fills them from ``(name, tensor)`` pairs
    (:meth:`load_weights`) or from a safetensors checkpoint (:meth:`read_checkpoint`).

    Args:
        config: an :class:`~engramrt.config.EngramConfig`, preset name or config path.
        placement: where each layer's rows live: the tier and its settings, the
            device, the tensor-parallel rank whose shard is kept (SPEC §7) and,
            for tier ``"disk"``, the directory of the packed-row files (see
            :class:`~engramrt.lookup.tiers.TablePlacement`).
        layer_ids: the Engram layers this loader owns (a pipeline stage's),
            default all of ``config.layer_ids``; tensors of the other Engram
            layers are recognised and skipped.
        heads: one :class:`~engramrt.protocols.LayerHead` per owned layer
            (``config.layer_ids`` order), e.g. :class:`~engramrt.layer.EngramHead`;
            each gets ``load_weights(wkv=, wkv_scale=, q_weight=, k_weight=)``
            once its tensors have all arrived. None: the head tensors are kept
            in :attr:`head_weights` for the caller.
        with_heads: False: load the tables only (head tensors are skipped and
            never missing).
        stores: empty stores to fill instead of building them from
            ``placement``, one per owned layer (rows, E and row_begin must
            match the layer's shard).
        table_names: the table's tensor names (:class:`TensorNames`; defaults:
            V4.1's), as ``names=`` of :func:`~engramrt.checkpoint.load_table`.
        weight_names: overrides of :data:`DEFAULT_HEAD_NAMES` (role -> a format
            string or a list of them; ``{layer}`` block index, ``{index}``
            position in ``engram_layer_ids``).
        block_rows: rows packed per write (default: about 64 MiB).
        layout: the config's layout, if already built.

    Attributes:
        layer_indices: positions in ``config.layer_ids`` of the owned layers.
        stores: one store per owned layer, allocated at construction, filled
            as each layer's values and scales have both arrived.
        heads: the heads passed in (or None).
        head_weights: per owned layer, the head tensors received (role ->
            tensor) when ``heads`` is None; emptied when a head is loaded.
    """

    def __init__(
        self,
        config: ConfigSource,
        placement: TablePlacement | None = None,
        *,
        layer_ids: Sequence[int] | None = None,
        heads: Sequence[LayerHead] | None = None,
        with_heads: bool = True,
        stores: Sequence[RowStore] | None = None,
        table_names: NamesSpec = None,
        weight_names: Mapping[str, str | Sequence[str]] | None = None,
        block_rows: int | None = None,
        layout: EngramLayout | None = None,
    ) -> None:
        cfg, layout = _resolve(config, layout)
        placement = check_placement(
            placement, "EngramWeightLoader(config, TablePlacement('host', 'cpu', tp=2, rank=0))"
        )
        self.config = cfg
        self.layout = layout
        self.placement = placement
        self.block_rows = check_block_rows(block_rows, row_bytes_for(cfg.head_dim))
        owned = list(cfg.layer_ids) if layer_ids is None else list(layer_ids)
        unknown = [layer for layer in owned if layer not in cfg.layer_ids]
        if not owned or unknown or len(set(owned)) != len(owned):
            raise ValidationError(
                f"layer_ids = {owned}; expected distinct Engram layers among "
                f"{list(cfg.layer_ids)} (engram_layer_ids)"
            )
        self.layer_indices = sorted(cfg.layer_ids.index(layer) for layer in owned)
        self.heads = self._per_layer("heads", heads)
        if heads is not None and not with_heads:
            raise ValidationError("heads given with with_heads=False; expected one of the two")
        self.with_heads = with_heads
        self._heads = dict(zip(self.layer_indices, self.heads or [], strict=False))
        self._table_names = TensorNames.from_spec(table_names)
        self._roles = self._name_table(self._table_names, weight_names)
        given = dict(zip(self.layer_indices, self._per_layer("stores", stores) or [], strict=False))
        self._tables: dict[int, _LayerTable] = {}
        for index in self.layer_indices:
            shard = placement.shard(layout, index)
            store = given.get(index)
            if store is None:
                store = make_store(
                    placement,
                    E=cfg.head_dim,
                    shard=shard,
                    path=placement.disk_path(cfg.layer_ids[index]),
                    new_file=True,
                )
            else:
                _check_store(store, shard, cfg.head_dim)
            self._tables[index] = _LayerTable(store, shard)
        self._head_weights: dict[int, dict[str, torch.Tensor]] = {i: {} for i in self._tables}
        self._head_names: dict[int, dict[str, str]] = {i: {} for i in self._tables}
        self._head_loaded = dict.fromkeys(self._tables, not with_heads)
        self._finished = False
        self.conversion_id: str | None = None
        """The :attr:`~SafetensorsCheckpoint.conversion_id` of the checkpoint
        :meth:`read_checkpoint` read (None before, or when filled by :meth:`load_weights`)."""

    def _per_layer(self, what: str, values: Sequence[Any] | None) -> list[Any] | None:
        """``values`` as a list of one per owned layer (None stays None)."""
        if values is None:
            return None
        values = list(values)
        if len(values) != len(self.layer_indices):
            layers = [self.config.layer_ids[i] for i in self.layer_indices]
            raise ValidationError(
                f"{what} has {len(values)} {what[:-1]}(s); expected {len(self.layer_indices)}, one "
                f"per Engram layer {layers}"
            )
        return values

    # --- names ---------------------------------------------------------------------------

    def _name_table(
        self, names: TensorNames, weight_names: Mapping[str, str | Sequence[str]] | None
    ) -> dict[str, tuple[int, str]]:
        """Every accepted tensor name -> (layer index, role)."""
        cfg = self.config
        head_templates = head_name_templates(weight_names)
        self._candidates: list[dict[str, tuple[str, ...]]] = []
        table: dict[str, tuple[int, str]] = {}
        per_role = {role: names.per_layer(role, cfg) for role in _TABLE_ROLES}
        for index, layer_id in enumerate(cfg.layer_ids):
            layer: dict[str, tuple[str, ...]] = {
                role: per_role[role][index] for role in _TABLE_ROLES
            }
            for role in _HEAD_ROLES:
                layer[role] = tuple(
                    t.format(layer=layer_id, index=index) for t in head_templates[role]
                )
            self._candidates.append(layer)
            for role, candidates in layer.items():
                for name in candidates:
                    other = table.setdefault(name, (index, role))
                    if other != (index, role):
                        raise CheckpointError(
                            f"tensor name {name!r} is both layer {cfg.layer_ids[other[0]]} "
                            f"{other[1]} and layer {layer_id} {role}; expected one role per name"
                        )
        return table

    def role_of(self, name: str) -> tuple[int, str] | None:
        """``(layer_index, role)`` of an Engram tensor name; None for a name outside Engram.

        Raises:
            CheckpointError: ``name`` contains ``.engram.`` but matches no role.
        """
        found = self._roles.get(name)
        if found is None and ENGRAM_MARKER in name:
            expected = ", ".join(repr(c[0]) for c in self._candidates[0].values())
            raise CheckpointError(
                f"tensor {name!r} looks like an Engram weight (contains {ENGRAM_MARKER!r}) but "
                f"matches no role of Engram layers {list(self.config.layer_ids)}; expected names "
                f"such as {expected} (for layer {self.config.layer_ids[0]}; also with 'model.', "
                f"and '.scale' for '.weight_scale_inv'), or pass table_names=/weight_names="
            )
        return found

    # --- loading -------------------------------------------------------------------------

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> set[str]:
        """Take the Engram tensors out of ``weights`` (any order); returns the names used.

        ``weights`` yields ``(name, tensor)`` pairs (a mapping of name ->
        tensor is read through its items). May be called several times (e.g.
        once per checkpoint file). Tensors outside Engram are skipped without
        being read.

        Raises:
            CheckpointError: an unknown Engram name, a tensor of the wrong
                shape or dtype, one holding NaN or inf (a table row, naming
                it), a meta tensor, a tensor given twice (naming it), an item
                that is not a ``(str, tensor)`` pair.
        """
        if self._finished:
            raise CheckpointError("load_weights called after finish(); expected a new loader")
        items = weights.items() if isinstance(weights, Mapping) else weights
        used: set[str] = set()
        for position, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str):
                raise CheckpointError(
                    f"weights item {position} is {_describe_item(item)}; expected a (name: str, "
                    f"tensor) pair, as engines' weight iterators yield"
                )
            name, tensor = item
            found = self.role_of(name)
            if found is None:
                continue
            index, role = found
            if index not in self._tables:
                continue  # another pipeline stage's layer
            if role in _TABLE_ROLES:
                self._table_tensor(index, role, name, tensor)
            elif self.with_heads:
                self._head_tensor(index, role, name, tensor)
            else:
                continue
            used.add(name)
        return used

    def read_checkpoint(
        self,
        checkpoint: SafetensorsCheckpoint | str | os.PathLike[str],
        *,
        token_map: TokenMap | None = None,
        verify_checksums: bool = False,
        group: Any = None,
    ) -> None:
        """Fill the owned layers' stores (and heads) from a safetensors checkpoint.

        Only this rank's rows are read, in blocks of ``block_rows``, from one
        full tensor or stitched from several partial ones (the per-rank files
        of ``engramrt convert --tp N``); every tensor is checked first, so
        errors come before the first block. The head tensors are read whole
        and go through the same checks as :meth:`load_weights`'s.

        Args:
            checkpoint: a file or directory (see :class:`SafetensorsCheckpoint`).
            token_map: the token map the rows are served with (default: the
                DeepSeek-V4 map); a file whose recorded fingerprint differs is
                refused (see :func:`engramrt.checkpoint.metadata.check_token_map`).
            verify_checksums: first check the content checksum of every file the
                rows come from (:meth:`SafetensorsCheckpoint.verify`: each file
                read whole once per checkpoint, so off by default).
            group: a ``torch.distributed`` process group of the ranks loading this
                checkpoint (e.g. the tensor-parallel group): before any row is read,
                every rank's :attr:`~SafetensorsCheckpoint.conversion_id` is
                all-gathered and the ranks go on only when they hold the same
                conversion (a path is opened again, up to
                :data:`~engramrt.checkpoint.ranks.AGREE_ATTEMPTS` times, while a
                conversion commits meanwhile). None: no comparison. Every rank of
                the group must call this.

        Sets :attr:`conversion_id` to the id of the set read.

        Raises:
            CheckpointError: a tensor is missing, has the wrong dtype or shape,
                or holds NaN or inf (naming it); with ``group``, the ranks hold
                different conversions (naming each rank's id).
            TokenizerError: the checkpoint was hashed with another token map.
        """
        with agreed_checkpoint(checkpoint, group) as ckpt:
            self.conversion_id = ckpt.conversion_id
            plans = [self._plan_table(ckpt, index, token_map) for index in self._tables]
            if verify_checksums:
                files = {
                    p.location.file
                    for plan in plans
                    for s in plan.segments
                    for p in (s.weight, s.scale)
                }
                for file in sorted(files):
                    ckpt.verify(file)
            if self.with_heads:
                for index in self._tables:
                    self._read_head(ckpt, index)
            for plan in plans:
                layer = self._tables[plan.layer_index]
                fill_store(layer.store, _iter_plan(plan, self.block_rows))
                layer.written = True

    def _plan_table(
        self, ckpt: SafetensorsCheckpoint, index: int, token_map: TokenMap | None
    ) -> LayerRead:
        layer = self._tables[index]
        if layer.names:
            raise CheckpointError(
                f"layer {self.config.layer_ids[index]}'s table was already given "
                f"({', '.join(repr(n) for n in layer.names.values())}); expected each Engram "
                f"tensor once"
            )
        plan = plan_layer_read(
            ckpt, self.config, self.layout, index, layer.shard, self._table_names
        )
        check_plan_token_map(ckpt, plan, self.config, token_map)
        first = plan.segments[0] if plan.segments else None
        if first is not None:
            layer.names.update(weight=first.weight.location.name, scale=first.scale.location.name)
        else:
            layer.names.update(weight="", scale="")  # a shard of no rows: nothing to read
        return plan

    def _read_head(self, ckpt: SafetensorsCheckpoint, index: int) -> None:
        """Read layer ``index``'s head tensors (the first name of each role the
        checkpoint holds) and take them as :meth:`load_weights` would."""
        layer_id = self.config.layer_ids[index]
        for role in _HEAD_ROLES:
            if role not in self._head_needs(index):
                continue
            candidates = self._candidates[index][role]
            found = read_tensor(ckpt, candidates)
            if found is None:
                tried = ", ".join(repr(n) for n in candidates)
                raise CheckpointError(
                    f"layer {layer_id}: no {role} tensor (tried {tried}) in {ckpt.describe()}; "
                    f"pass weight_names={{{role!r}: ...}} if the checkpoint names it differently"
                )
            self._head_tensor(index, role, *found)

    def _check_table(self, index: int, role: str, name: str, tensor: Any) -> None:
        cfg = self.config
        layer_id = cfg.layer_ids[index]
        E = cfg.head_dim
        width = E if role == "weight" else E // 32
        dtypes = (torch.float8_e4m3fn,) if role == "weight" else (torch.float8_e8m0fnu, torch.uint8)
        expected = [cfg.num_embeddings[index], width]
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dtype not in dtypes
            or list(tensor.shape) != expected
        ):
            wanted = " or ".join(str(d) for d in dtypes)
            raise CheckpointError(
                f"tensor {name!r} (layer {layer_id} {_WHAT[role]}) has {_describe(tensor)}; "
                f"expected {wanted} of shape {expected} (engram_num_embeddings[{index}] rows of "
                f"{width} {'fp8 values' if role == 'weight' else 'ue8m0 scale bytes'})"
            )
        if tensor.device.type == "meta":
            raise CheckpointError(
                f"tensor {name!r} (layer {layer_id} {_WHAT[role]}) is on the meta device: it "
                f"holds no data; expected a tensor with its values"
            )

    def _table_tensor(self, index: int, role: str, name: str, tensor: torch.Tensor) -> None:
        layer = self._tables[index]
        if role in layer.names:
            raise CheckpointError(
                f"tensor {name!r} (layer {self.config.layer_ids[index]} {_WHAT[role]}) was "
                f"given after {layer.names.get(role, name)!r} already delivered it; expected "
                f"each Engram tensor once"
            )
        self._check_table(index, role, name, tensor)
        layer.names[role] = name
        shard = layer.shard
        rows = tensor[shard.row_begin : shard.row_end].view(torch.uint8)  # [n, width] bytes
        other = "scale" if role == "weight" else "weight"
        if other not in layer.held:
            held = torch.empty(tuple(rows.shape), dtype=torch.uint8)  # this shard only, host
            held.copy_(rows)
            layer.held[role] = held
            return
        partner = layer.held.pop(other)
        values, scales = (rows, partner) if role == "weight" else (partner, rows)
        step = self.block_rows
        for begin in range(0, shard.num_rows, step):
            end = min(begin + step, shard.num_rows)
            block_values = values[begin:end]
            block_scales = scales[begin:end].to(block_values.device)
            check_packed_rows_finite(
                block_values,
                block_scales,
                weight_name=layer.names["weight"],
                scale_name=layer.names["scale"],
                row_begin=shard.row_begin + begin,
            )
            layer.store.write_rows(begin, pack_rows(block_values, block_scales))
        layer.written = True

    def _head_tensor(self, index: int, role: str, name: str, tensor: torch.Tensor) -> None:
        layer_id = self.config.layer_ids[index]
        received = self._head_names[index]
        if role in received or self._head_loaded[index]:
            previous = received.get(role)
            raise CheckpointError(
                f"tensor {name!r} (layer {layer_id} {_WHAT[role]}) was given after layer "
                f"{layer_id}'s head was "
                + (f"given {previous!r} for it" if previous else "loaded without it")
                + "; expected each Engram tensor once (a wkv scale only with an fp8 wkv)"
            )
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"tensor {name!r} (layer {layer_id} {_WHAT[role]}) is {_describe(tensor)}; "
                f"expected a tensor"
            )
        check_head_weight(tensor, name=name, positive=role == "wkv_scale")
        received[role] = name
        self._head_weights[index][role] = tensor
        self._load_head_if_complete(index)

    def _head_needs(self, index: int) -> tuple[str, ...]:
        wkv = self._head_weights[index].get("wkv")
        if wkv is not None and wkv.dtype != torch.float8_e4m3fn:
            return ("wkv", "q_weight", "k_weight")
        return _HEAD_ROLES

    def _load_head_if_complete(self, index: int) -> None:
        weights = self._head_weights[index]
        needs = self._head_needs(index)
        if index not in self._heads or not all(role in weights for role in needs):
            return
        try:
            self._heads[index].load_weights(
                wkv=weights["wkv"],
                wkv_scale=weights.get("wkv_scale"),
                q_weight=weights["q_weight"],
                k_weight=weights["k_weight"],
            )
        except CheckpointError as exc:
            given = ", ".join(f"{r}={n!r}" for r, n in self._head_names[index].items())
            raise CheckpointError(
                f"layer {self.config.layer_ids[index]} head ({given}): {exc}"
            ) from exc
        self._head_loaded[index] = True
        weights.clear()

    # --- the end -------------------------------------------------------------------------

    def missing(self) -> list[str]:
        """One line per Engram tensor not received yet: its layer, role and accepted names."""
        lines = []
        for index, layer in self._tables.items():
            layer_id = self.config.layer_ids[index]
            roles = [] if layer.written else [r for r in _TABLE_ROLES if r not in layer.names]
            if not self._head_loaded[index]:
                received = self._head_names[index]
                roles += [r for r in self._head_needs(index) if r not in received]
            for role in roles:
                names = " or ".join(repr(n) for n in self._candidates[index][role])
                lines.append(f"layer {layer_id} {_WHAT[role]}: {names}")
        return lines

    def finish(self) -> list[RowStore]:
        """End loading: flush the stores and return them.

        Raises:
            CheckpointError: naming every missing tensor and its layer.
        """
        missing = self.missing()
        if missing:
            raise CheckpointError(
                f"{len(missing)} Engram tensor(s) never given to load_weights:\n  "
                + "\n  ".join(missing)
            )
        for layer in self._tables.values():
            layer.store.flush()
        self._finished = True
        return self.stores

    def pending_bytes(self) -> int:
        """Host bytes held for tables whose partner tensor has not arrived (this shard's rows)."""
        return sum(t.nbytes for layer in self._tables.values() for t in layer.held.values())

    @property
    def stores(self) -> list[RowStore]:
        """One store per owned Engram layer, in ``config.layer_ids`` order, once
        :meth:`finish` has checked that every table is complete.

        Raises:
            CheckpointError: before :meth:`finish` (a store may still miss rows).
        """
        if not self._finished:
            raise CheckpointError(
                "stores read before finish(); expected finish() first, which checks that every "
                "Engram tensor arrived and flushes the stores"
            )
        return [self._tables[index].store for index in self.layer_indices]

    @property
    def head_weights(self) -> list[dict[str, torch.Tensor]]:
        """Per owned layer, the head tensors received and not yet loaded into a head."""
        return [self._head_weights[index] for index in self.layer_indices]
