"""Benchmark cases for Qwen4-Exp PLE row ids at the shipped hash constants.

The kernel (``PleHasher``, every PLE layer in one launch) beside the reference's own torch
path: transformers' ``Qwen4ExpTextNGramEmbedding`` (one module per PLE layer, its table
swapped for an identity so only the ids are timed; no cache, so each request starts from
an EOS context, which skips the cache's clone and update: a lower bound on the
reference's time), and engramrt's plain torch path (``ple_row_ids_torch``) on the device.
The transformers path runs where transformers 5.23.0 is installed; otherwise the torch
path is the baseline.

The PLE layer (``ple/layer ...``, second half of this file): ``PleLayer`` (Triton), its
vectorised torch path eager and compiled, the reference's own loop, and transformers'
``Qwen4ExpTextPLELayer`` (the baseline where installed) on the same weights, table rows and
conv states, each held to ``ple_layer_enclosure`` before it is timed.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engramrt.bench.registry import Case, register

PLE_LAYER_IDS = {1: (2,), 2: (2, 6)}
"""PLE layers by count: layer 2 is the one reported for the released model (unverified,
docs/families.md §1); a second shows the one-launch kernel across layers."""


def _config(n_layers: int) -> Any:
    from engramrt.families.qwen4_ple.config import PleConfig

    return PleConfig(
        ple_layer_ids=PLE_LAYER_IDS[n_layers],
        ple_embed_dim=2560,
        eos_token_id=248_044,
        num_hidden_layers=8,
        layer_types=("linear_attention",) * 8,
    )


def _oracle_available() -> bool:
    if importlib.util.find_spec("transformers") is None:
        return False
    import transformers

    return bool(transformers.__version__ == "5.23.0")


class _RowIdsOut(torch.nn.Module):
    """Stands in for the oracle's ``ngram_embedding``: returns the row ids it is given."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, device=device), requires_grad=False)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        return row_ids


def _oracle_modules(cfg: Any, device: torch.device) -> list[torch.nn.Module]:
    """One ``Qwen4ExpTextNGramEmbedding`` per PLE layer, built with one value per row
    (E = C) so the table it allocates is small, then swapped for :class:`_RowIdsOut`."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as oracle

    fields = cfg.replace(ple_embed_dim=cfg.n_cols).to_hf_dict()
    del fields["model_type"]
    hf_config = oracle.Qwen4ExpTextConfig(**fields)
    modules: list[torch.nn.Module] = []
    for ple_index, decoder_layer in enumerate(cfg.decoder_layer_indices):
        module = oracle.Qwen4ExpTextNGramEmbedding(
            hf_config, embedding_dim=cfg.n_cols, layer_idx=decoder_layer, ple_layer_index=ple_index
        )
        module.ngram_embedding = _RowIdsOut(device)  # type: ignore[assignment]
        modules.append(module.to(device))
    return modules


def _setup(device: torch.device, n_layers: int, n_req: int, per: int, seed: int) -> dict[str, Any]:
    from engramrt.families.qwen4_ple.ops import PleHasher

    cfg = _config(n_layers)
    rng = np.random.default_rng(seed)
    t_len = n_req * per
    hasher = PleHasher(cfg, device, backend="triton", validate=False)
    inputs: dict[str, Any] = {
        "cfg": cfg,
        "hasher": hasher,
        "token_ids": torch.tensor(rng.integers(0, cfg.vocab_size, size=t_len), device=device),
        "query_start_loc": torch.tensor(
            np.arange(n_req + 1) * per, dtype=torch.int32, device=device
        ),
        "contexts": hasher.start_contexts(n_req),  # fresh requests: the oracle's start
        "out": torch.empty((t_len, n_layers, cfg.n_cols), dtype=torch.int64, device=device),
        "next_context": torch.empty((n_req, cfg.ngram_size - 1), dtype=torch.int64, device=device),
        "packed": hasher.consts.packed(device),
        "shape": (n_req, per),
    }
    if _oracle_available():
        inputs["oracle"] = _oracle_modules(cfg, device)
    return inputs


def _triton(s: dict[str, Any]) -> torch.Tensor:
    s["hasher"](
        s["token_ids"],
        s["query_start_loc"],
        s["contexts"],
        out=s["out"],
        next_context=s["next_context"],
    )
    return s["out"]


def _torch(s: dict[str, Any]) -> torch.Tensor:
    from engramrt.families.qwen4_ple.ids import ple_row_ids_torch

    cfg = s["cfg"]
    rows, _ = ple_row_ids_torch(
        s["token_ids"],
        s["query_start_loc"],
        s["contexts"],
        s["packed"],
        cfg.heads_per_ngram,
        cfg.eos,
    )
    return rows


@torch.no_grad()
def _transformers(s: dict[str, Any]) -> torch.Tensor:
    n_req, per = s["shape"]
    ids = s["token_ids"].view(n_req, per)
    rows = [module(ids, None).view(n_req * per, -1) for module in s["oracle"]]
    return torch.stack(rows, dim=1)


def _check(inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
    from engramrt.families.qwen4_ple.ids import ple_row_ids_batch_reference

    hasher = inputs["hasher"]
    n_check = min(inputs["token_ids"].shape[0], 4096)
    n_req = int((inputs["query_start_loc"].cpu() <= n_check).sum()) - 1
    end = int(inputs["query_start_loc"][n_req])
    want, _ = ple_row_ids_batch_reference(
        inputs["token_ids"][:end].cpu(),
        inputs["query_start_loc"][: n_req + 1].cpu(),
        inputs["contexts"][:n_req].cpu(),
        hasher.consts,
        hasher.eos,
    )
    for name, output in outputs.items():
        got = output[:end].cpu().to(torch.int64)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[:5].tolist()
            raise AssertionError(f"{name} and the reference differ at {bad}")


@register
def ple_cases(quick: bool) -> list[Case]:
    shapes = [(1, "decode", 256, 1), (2, "decode", 256, 1), (2, "prefill", 1, 8192)]
    if quick:
        shapes = shapes[1:2]
    oracle = _oracle_available()
    impls: dict[str, Callable[[dict[str, Any]], Any]] = {"triton": _triton, "torch-eager": _torch}
    if oracle:
        impls["transformers"] = _transformers
    cases = []
    for n_layers, kind, n_req, per in shapes:
        t_len = n_req * per
        cases.append(
            Case(
                name=f"ple/ids {kind} {n_req}x{per} L={n_layers}",
                params={
                    "requests": n_req,
                    "tokens_per_request": per,
                    "T": t_len,
                    "ple_layers": n_layers,
                    "C": 16,
                    "constants": "Qwen4-Exp defaults (head sizes from 20,000,003)",
                },
                make=functools.partial(
                    _setup, n_layers=n_layers, n_req=n_req, per=per, seed=t_len + n_layers
                ),
                impls=impls,
                check=_check,
                # ids read (8 B), contexts read and written (2 x 16 B a request), row ids
                # written (L x 16 x 8 B a token)
                bytes_moved=t_len * (8 + n_layers * 16 * 8) + n_req * 32,
                items=t_len,
                item_name="tokens",
                baseline="transformers" if oracle else "torch-eager",
                graph=True,
                graph_impls=("triton",),
            )
        )
    return cases


# --------------------------------------------------------------------------
# The PLE layer (docs/families.md §6) at the released shapes: hidden 2048, hc 4, C 16,
# d 160 (E 2560), N 3, K 4 (S 9).
# --------------------------------------------------------------------------

LAYER_TABLE_ROWS_ENV = "ENGRAMRT_BENCH_PLE_TABLE_ROWS"
LAYER_TABLE_ROWS = 1 << 24
"""Rows of the benchmark's bf16 table on the device tier: 2^24 rows of 320 B (5 GiB), far
beyond L2, ids uniform over all of it. ``ENGRAMRT_BENCH_PLE_TABLE_ROWS=320001536`` times
the full 95.4 GiB table of PLE layer 0 instead."""

LAYER_IMPLS = (
    "engramrt",
    "engramrt-inductor",
    "engramrt-compiled",
    "torch-vectorised",
    "reference-eager",
)
"""The layer's implementations that update a pool of conv states of their own
(``transformers`` keeps its states in a ``DynamicCache``)."""

_LAYER_SHARED: dict[str, Any] = {}


def _layer_table_rows() -> int:
    import os

    value = os.environ.get(LAYER_TABLE_ROWS_ENV, "")
    return int(value) if value else LAYER_TABLE_ROWS


def _layer_shared(device: torch.device, cfg: Any) -> dict[str, Any]:
    """One table and one set of weights for both layer cases (filling the table is the
    slow part of making inputs)."""
    rows = _layer_table_rows()
    key = (str(device), rows, cfg)
    if _LAYER_SHARED.get("key") == key:
        return _LAYER_SHARED
    from engramrt.families.qwen4_ple.layer import PleLayerWeights
    from engramrt.family import BF16
    from engramrt.lookup.tiers import DeviceOptions, TablePlacement, make_store

    _LAYER_SHARED.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    width, embed = cfg.table_width, cfg.embed_dim
    hc_width = cfg.hc_count * cfg.hidden_size
    generator = torch.Generator(device=device).manual_seed(2026)
    store = make_store(
        TablePlacement(DeviceOptions(backend="triton"), device=device),
        num_rows=rows,
        E=width,
        row_format=BF16,
    )
    fill = 1 << 22
    for start in range(0, rows, fill):
        count = min(fill, rows - start)
        block = torch.randn(count, width, device=device, generator=generator).bfloat16()
        store.write_rows(start, block.view(torch.uint8))

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, device=device, generator=generator)).bfloat16()

    weights = PleLayerWeights(
        key_proj=randn(hc_width, embed, scale=embed**-0.5),
        value_proj=randn(cfg.hidden_size, embed, scale=embed**-0.5),
        norm_key=randn(hc_width, scale=0.1),
        norm_query=randn(hc_width, scale=0.1),
        norm_conv=randn(hc_width, scale=0.1),
        conv1d=randn(hc_width, 1, cfg.ple_conv_kernel_size, scale=0.5),
    )
    _LAYER_SHARED.update(key=key, cfg=cfg, store=store, weights=weights)
    return _LAYER_SHARED


class _RowsFromTable(torch.nn.Module):
    """Stands in for the oracle layer's ``ple_embedding``: its ``input_ids`` are the row ids
    ``[B, L, C]`` of the case, and it returns their rows of our bf16 table concatenated,
    ``[B, L, C*d]`` (``index_select``, as ``reference-eager`` reads them). The table is a
    view of the store's rows, not a copy and not a parameter."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table  # [R, d] bf16

    def forward(self, input_ids: torch.Tensor, past_key_values: Any) -> torch.Tensor:
        rows = self.table.index_select(0, input_ids.reshape(-1).long())
        return rows.view(*input_ids.shape[:2], -1)


def _oracle_layer(cfg: Any, weights: Any, table: torch.Tensor) -> tuple[Any, Any]:
    """``(layer, hf_config)``: transformers' ``Qwen4ExpTextPLELayer`` of the case's PLE layer
    with our weights, built on the meta device (its own table would be ``[R, d]``, 95 GiB at
    the released sizes) and given :class:`_RowsFromTable` as its ``ple_embedding``."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as oracle

    from engramrt.families.qwen4_ple.layer import PleLayerWeights

    fields = cfg.to_hf_dict()
    del fields["model_type"]
    hf_config = oracle.Qwen4ExpTextConfig(**fields)
    decoder_layer = cfg.decoder_layer_indices[0]
    with torch.device("meta"):
        layer = oracle.Qwen4ExpTextPLELayer(hf_config, layer_idx=decoder_layer, ple_layer_index=0)
    layer.ple_embedding = _RowsFromTable(table)  # type: ignore[assignment]
    # Our weights by their checkpoint names (docs/families.md §5) without the module path:
    # the names of the oracle's own state dict (PleLayerWeights.from_state_dict reads them).
    names = PleLayerWeights.checkpoint_names(decoder_layer, prefix="")
    module_path = f"layers.{decoder_layer}.ple."
    state = {names[f].removeprefix(module_path): getattr(weights, f) for f in names}
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.eval(), hf_config


def _layer_setup(device: torch.device, n_req: int, per: int, cfg: Any) -> dict[str, Any]:
    """The inputs of one layer case: ``n_req`` running sequences of ``per`` tokens each, at
    scattered slots of a pool of random states, on a table of :func:`_layer_table_rows`
    rows; the same weights and table for every implementation (and for the oracle, where
    transformers 5.23.0 is installed). Any device and any ``cfg`` (the CPU test runs it
    small)."""
    from engramrt.families.qwen4_ple.module import PleLayer

    shared = _layer_shared(device, cfg)
    store, weights = shared["store"], shared["weights"]
    t_len = n_req * per
    generator = torch.Generator(device=device).manual_seed(t_len)
    # validate=False: the inputs are ours (as in a serving loop's captured step).
    layer = PleLayer.from_config(cfg, weights, store, backend="triton", validate=False)
    reference = PleLayer.from_config(cfg, weights, store, backend="reference", validate=False)
    num_slots = 2 * n_req + 1
    # Running sequences: random states, at scattered slots of a larger pool.
    pool = torch.randn(
        num_slots, layer.state_len, layer.width, device=device, generator=generator
    ).bfloat16()
    slots = torch.randperm(num_slots, device=device, generator=generator)[:n_req]
    inputs: dict[str, Any] = {
        "cfg": cfg,
        "layer": layer,
        "reference_layer": reference,
        "weights": layer.weights,
        "store": store,
        "hidden": torch.randn(t_len, layer.width, device=device, generator=generator).bfloat16(),
        "row_ids": torch.randint(
            0,
            store.num_rows,
            (t_len, cfg.n_cols),
            device=device,
            generator=generator,
            dtype=torch.int32,
        ),
        "query_start_loc": torch.arange(n_req + 1, device=device, dtype=torch.int32) * per,
        "state_slots": slots.to(torch.int32),
        "initial_pool": pool,
        "shape": (n_req, per),
    }
    # Each implementation updates a pool of its own, so each first call (the one checked)
    # starts from the same states; the timed calls go on from there.
    for name in LAYER_IMPLS:
        inputs[f"pool:{name}"] = pool.clone()
        inputs[f"out:{name}"] = torch.empty_like(inputs["hidden"])
    if _oracle_available():
        import transformers

        table = store.device_rows().view(torch.bfloat16)
        oracle, hf_config = _oracle_layer(cfg, shared["weights"], table)
        # The oracle's conv state: DynamicCache conv state 1 of its decoder layer (a
        # linear-attention layer, so the cache holds conv states), [B, hc*D, S] channels
        # first, batch row i = sequence i. The first update of an empty cache takes the
        # states as they are (a "prefill" of S columns): every sequence starts running.
        cache = transformers.DynamicCache(config=hf_config)
        cache.update_conv_state(
            pool.index_select(0, slots).transpose(1, 2).contiguous(),
            cfg.decoder_layer_indices[0],
            state_idx=1,
            conv_kernel_size=cfg.conv_state_len,
        )
        inputs.update(oracle=oracle, oracle_cache=cache)
    return inputs


def _layer_call(s: dict[str, Any], name: str, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    pool = s[f"pool:{name}"]
    out = layer(
        s["hidden"],
        s["row_ids"],
        s["query_start_loc"],
        pool,
        s["state_slots"],
        out=s[f"out:{name}"],
    )
    return out, pool


def _layer_engramrt(s: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer_call(s, "engramrt", s["layer"])


def _layer_compiled(s: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    compiled = s.get("compiled")
    if compiled is None:
        # Inductor elides a bf16 rounding between fused operations unless it keeps eager's
        # casts; the reference rounds every step (the check's enclosure assumes it).
        compiled = s["compiled"] = torch.compile(
            s["reference_layer"].__call__,
            fullgraph=True,
            options={"emulate_precision_casts": True},
        )
    return _layer_call(s, "engramrt-compiled", compiled)


def _layer_inductor(s: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    compiled = s.get("inductor")
    if compiled is None:
        # As an engine compiles its model: the kernels stay opaque operators (layer_ops).
        compiled = s["inductor"] = torch.compile(s["layer"].__call__, fullgraph=True)
    return _layer_call(s, "engramrt-inductor", compiled)


def _layer_vectorised(s: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer_call(s, "torch-vectorised", s["reference_layer"])


def _layer_rows(s: dict[str, Any]) -> torch.Tensor:
    """``[T, E]`` each token's rows, gathered with ``index_select`` from the store's values."""
    table = s["store"].device_rows().view(torch.bfloat16)
    row_ids = s["row_ids"]
    return table.index_select(0, row_ids.reshape(-1).long()).view(row_ids.shape[0], -1)


def _layer_reference(s: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's own torch path on the device: the rows gathered with
    ``index_select``, then ``ple_layer_reference_varlen`` (a loop over sequences that reads
    ``query_start_loc`` on the host), its states written back to the pool."""
    from engramrt.families.qwen4_ple.layer import ple_layer_reference_varlen

    cfg = s["cfg"]
    pool, slots = s["pool:reference-eager"], s["state_slots"].long()
    out, states = ple_layer_reference_varlen(
        s["hidden"],
        _layer_rows(s),
        s["weights"],
        query_start_loc=s["query_start_loc"],
        ngram_size=cfg.ngram_size,
        eps=cfg.rms_norm_eps,
        conv_states=pool.index_select(0, slots),
    )
    pool.index_copy_(0, slots, states)
    return out, pool


@torch.no_grad()
def _layer_transformers(s: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """transformers 5.23.0's ``Qwen4ExpTextPLELayer``, our weights, on the case's batch the
    oracle's way: ``[B, L, hc*D]`` hidden streams (decode 256: 256 sequences of 1 token;
    prefill: 1 of 8192), the row ids as its ``input_ids``, which its ``ple_embedding``
    (:class:`_RowsFromTable`) turns into rows of our bf16 table with ``index_select``: the
    table is not copied, and the oracle's id path is timed by ``ple/ids``. Its conv states
    live in a ``DynamicCache`` (channels first), updated in place by each call. Returns
    ``(out [B, L, hc*D], cache)``; the check reads both in our layout."""
    n_req, per = s["shape"]
    out = s["oracle"](
        s["hidden"].view(n_req, per, -1), s["row_ids"].view(n_req, per, -1), s["oracle_cache"]
    )
    return out, s["oracle_cache"]


def _oracle_as_pool(s: dict[str, Any], output: tuple[torch.Tensor, Any]) -> tuple[Any, Any]:
    """The oracle's ``(out [B, L, hc*D], cache)`` as ``(out [T, hc*D], pool)``: its states
    ``[B, hc*D, S]`` transposed to ``[B, S, hc*D]`` and written at the case's slots of a
    copy of the initial pool."""
    out, cache = output
    states = cache.get_conv_state(s["cfg"].decoder_layer_indices[0], state_idx=1)
    pool = s["initial_pool"].clone()
    pool.index_copy_(0, s["state_slots"].long(), states.transpose(1, 2))
    return out.reshape(-1, out.shape[-1]), pool


def _layer_check(inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
    """Every implementation's out and updated states (the first call's) inside the
    enclosure of the reference's rounding steps (``ple_layer_enclosure``, derived in
    layer.py): bf16 throughout, each step computed in fp32 and rounded alike, so two
    implementations differ only where their fp32 sums (GEMM, norms, score, conv, in any
    order, within ``2 (n + 2) u sum|terms|``) or functions (rsqrt, sqrt, exp, within a
    few ulps) carry a value across a bf16 rounding boundary, then by one ulp carried on;
    the enclosure follows those intervals step by step from the exact inputs. The
    reference-eager output is held to it too; how many values differ from its bits is
    reported only as information. ``engramrt-compiled`` is not checked on CUDA (Inductor
    rounds otherwise there; the case's params say so)."""
    from engramrt.families.qwen4_ple.layer import assert_within_enclosure, ple_layer_enclosure

    cfg, slots = inputs["cfg"], inputs["state_slots"].long()
    enclosure = ple_layer_enclosure(
        inputs["hidden"],
        _layer_rows(inputs),
        inputs["weights"],
        query_start_loc=inputs["query_start_loc"],
        ngram_size=cfg.ngram_size,
        eps=cfg.rms_norm_eps,
        conv_states=inputs["initial_pool"].index_select(0, slots),
    )
    want_out, want_pool = outputs["reference-eager"]
    want_states = want_pool.index_select(0, slots)
    for name, output in outputs.items():
        if name == "engramrt-compiled" and inputs["hidden"].is_cuda:
            continue  # timed, not checked: see the case's params
        out, pool = _oracle_as_pool(inputs, output) if name == "transformers" else output
        assert_within_enclosure(
            out, enclosure.out_low, enclosure.out_high, label=f"{name} out", reference=want_out
        )
        assert_within_enclosure(
            pool.index_select(0, slots),
            enclosure.states_low,
            enclosure.states_high,
            label=f"{name} states",
            reference=want_states,
        )


@register
def ple_layer_cases(quick: bool) -> list[Case]:
    cfg = _config(1)
    rows = _layer_table_rows()
    hc_width = cfg.hc_count * cfg.hidden_size
    shapes = [("decode", 256, 1), ("prefill", 1, 8192)]
    if quick:
        shapes = [("decode", 256, 1), ("prefill", 1, 2048)]
    oracle = _oracle_available()
    impls: dict[str, Callable[[dict[str, Any]], Any]] = {
        "engramrt": _layer_engramrt,
        "engramrt-inductor": _layer_inductor,
        "torch-vectorised": _layer_vectorised,
        "engramrt-compiled": _layer_compiled,
        "reference-eager": _layer_reference,
    }
    if oracle:
        impls["transformers"] = _layer_transformers
    cases = []
    for kind, n_req, per in shapes:
        t_len = n_req * per
        bf16 = 2
        weights_bytes = (cfg.hc_count + 1) * cfg.hidden_size * cfg.embed_dim * bf16
        state_bytes = n_req * cfg.conv_state_len * hc_width * bf16
        bytes_moved = (
            t_len * cfg.n_cols * (4 + cfg.table_width * bf16)  # ids and rows read
            + weights_bytes  # key_proj and value_proj read once
            + 2 * t_len * hc_width * bf16  # hidden read, out written
            + 2 * state_bytes  # states read and written
        )
        label = f"{t_len}" if kind == "prefill" else f"{n_req}"
        params = {
            "requests": n_req,
            "tokens_per_request": per,
            "T": t_len,
            "hidden": cfg.hidden_size,
            "hc": cfg.hc_count,
            "C": cfg.n_cols,
            "d": cfg.table_width,
            "E": cfg.embed_dim,
            "table": f"bf16 [{rows}, {cfg.table_width}] on the device tier",
            "table_GiB": round(rows * cfg.table_width * bf16 / 2**30, 2),
            "gemm_tflop": round(2 * t_len * cfg.embed_dim * hc_width * 1.25 / 1e12, 3),
            "targets": "SPEC_PLE §10 (BENCHMARKS.md, the PLE layer)",
            "engramrt-inductor": (
                "the engramrt layer inside torch.compile(fullgraph): its kernels opaque "
                "operators (engramrt::ple_*), the GEMM Inductor's"
            ),
            "engramrt-compiled": (
                "torch.compile(fullgraph) of the vectorised torch path, eager's bf16 casts "
                "kept (emulate_precision_casts); timed, not checked on CUDA: Inductor leaves "
                "the enclosure there (47 of 2,097,152 values at decode 256, H200, 2026-12-05)"
            ),
            "check": "every value inside ple_layer_enclosure (bounds derived in layer.py)",
        }
        if oracle:
            params["transformers"] = (
                f"transformers 5.23.0 Qwen4ExpTextPLELayer, our weights, batch {n_req} x {per}, "
                f"conv states in a DynamicCache; its ple_embedding replaced by index_select "
                f"of the same bf16 table at the case's row ids (not copied; its id path is "
                f"timed by ple/ids)"
            )
        cases.append(
            Case(
                name=f"ple/layer {kind} {label}",
                params=params,
                make=functools.partial(_layer_setup, n_req=n_req, per=per, cfg=cfg),
                impls=impls,
                check=_layer_check,
                bytes_moved=bytes_moved,
                items=t_len,
                item_name="tokens",
                baseline="transformers" if oracle else "reference-eager",
                graph=True,
                graph_impls=("engramrt",),
            )
        )
    return cases
