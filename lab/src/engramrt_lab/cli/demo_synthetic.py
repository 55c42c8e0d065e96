"""``engramrt demo --synthetic``: the V4.1-Flash layout on synthetic rows, every stage checked.

Rows come from a synthetic table computed from the row ids (no storage, so
the real V4.1-Flash layout with its 384 M rows per layer works anywhere) or
from a checkpoint (``--checkpoint``); they are projected by a random wkv
and gated into random hidden states, each stage checked against its
reference. Nothing here is a trained model: the tokenizer, the token map
and the hashing are real, the rows, weights and hidden states are not.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

DEFAULT_TEXT = (
    "Only Alexander the Great could tame the horse Bucephalus. THE GREAT horse and the great "
    "Alexander rode east; the Great Sea lay behind them. Alexander the Great could tame the "
    "horse Bucephalus, and only Alexander THE GREAT could ride him."
)


def _stream_checked(
    hasher: Any,
    stores: list[Any],
    heads: list[Any],
    hidden: Any,
    token_ids: Any,
    token_map: Any,
    consts: Any,
) -> tuple[list[dict[str, Any]], Any]:
    """Stream ``token_ids`` through an :class:`EngramRuntime` as two requests of an engine.

    The engine is the simulator's (:mod:`engramrt.testing`): its scheduler over
    paged KV blocks of 8 with a prefix cache, each step a vLLM runner step through
    :func:`~engramrt.adapters.from_vllm_step` into ``runtime.plan``, then
    ``runtime.run`` of every Engram layer with the step's hidden states
    (``hidden [T, hc, D]``, by position). Request A: chunked prefill, one
    speculative step whose drafts are rejected, decode steps. Request B: the
    same text, found in the prefix cache (A's full blocks), the rest prefilled.
    Every step's row ids are checked against one-shot hashing, its rows against
    the reference lookup of the same table, and each layer's kv and output
    against the float reference. Returns the checks and the runtime (closed;
    for its cache stats).
    """
    import numpy as np
    import torch

    from engramrt.adapters import from_vllm_step, vllm_slot_cache
    from engramrt.hashing import hash_sequence
    from engramrt.runtime import EngramRuntime
    from engramrt.testing import Scheduler, Step, VllmView

    device = hasher.device
    block, t_len = 8, len(token_ids)
    max_blocks = t_len // block + 2
    rng = np.random.default_rng(0)
    scheduler = Scheduler(
        block_size=block, num_blocks=2 * max_blocks + 1, max_requests=2, max_len=t_len, rng=rng
    )
    runner = VllmView(
        rng,
        token_map.vocab_size,
        max_tokens=t_len,
        max_requests=1,
        max_blocks=max_blocks,
        num_slots=scheduler.num_blocks * block,
        block_size=block,
    )
    cache = vllm_slot_cache(scheduler.num_blocks, block, device)
    runtime = EngramRuntime(
        hasher, stores, heads=heads, max_tokens=t_len, max_requests=1, history=cache
    )
    steps: list[dict[str, Any]] = []

    def run(label: str, chunk: Any, accepted: int | None = None) -> None:
        engine_step = runner.express([Step(len(steps), [chunk])], None, device)
        plan = runtime.plan(from_vllm_step(**engine_step, cache=cache))
        start, end = chunk.start, chunk.end
        seq = np.asarray(chunk.request.tokens[:end], dtype=np.int64)
        got = plan.row_ids.to(torch.int64).cpu()
        want = hash_sequence(token_map.compress(seq), consts)[start:end]
        ok = bool(np.array_equal(got.numpy(), want))
        step_hidden = hidden[start:end].contiguous()
        for li, store in enumerate(stores):
            rows = _reference_rows(store, got[:, li])
            ok &= torch.equal(plan.rows(li).cpu().view(torch.int16), rows.view(torch.int16))
            out, kv = runtime.run(li, step_hidden, return_kv=True)
            ok &= _layer_within_tolerance(runtime.heads[li], step_hidden, rows.to(device), kv, out)
        scheduler.advance(chunk, accepted)
        steps.append({"step": label, "tokens": end - start, "ok": ok})

    ids = [int(t) for t in token_ids]
    a = scheduler.admit(ids)
    assert a is not None
    prefill_end = max(1, t_len - 6)
    while a.computed < prefill_end:
        start = a.computed
        chunk = scheduler.chunk(a, min(11, prefill_end - start))
        run(f"A prefill {start}:{chunk.end}", chunk)
    pos = a.computed
    # A speculative step: the real next token plus two wrong drafts, then rejected.
    chunk = scheduler.chunk(a, 0, [(ids[pos] + 1) % len(token_map.map), 7])
    run(f"A verify {pos}:{pos + 3} (2 drafts, rejected)", chunk, accepted=0)
    while a.computed < t_len:
        chunk = scheduler.chunk(a, 1)
        run(f"A decode {chunk.start}", chunk)
    b = scheduler.admit(ids)  # the same prompt: A's full blocks are in the prefix cache
    assert b is not None
    hit = b.computed
    chunk = scheduler.chunk(b, t_len - hit)
    run(f"B prefix hit ({hit} tokens), prefill {hit}:{t_len}", chunk)
    runtime.close()
    return steps, runtime


def _layer_within_tolerance(head: Any, hidden: Any, rows: Any, kv: Any, out: Any) -> bool:
    """Whether a layer step's kv and out are within the derived tolerances of the float
    reference computed from ``rows`` (the reference lookup's)."""
    from engramrt._backend import interpreter_enabled
    from engramrt.layer import assert_layer_within_tolerance

    try:
        assert_layer_within_tolerance(
            hidden=hidden,
            rows=rows,
            kv=kv,
            out=out,
            wkv_exact=head.wkv.weight.double(),
            q_weight=head.q_weight,
            k_weight=head.k_weight,
            eps=head.eps,
            weight_rounding=head.wkv.weight_rounding,
            truncating_store=hidden.device.type == "cpu" and interpreter_enabled(),
        )
    except AssertionError:
        return False
    return True


def _reference_rows(store: Any, row_ids: Any) -> Any:
    """The reference lookup of ``row_ids [T, C]`` from the table's own packed bytes."""
    import torch

    from engramrt.lookup import lookup_rows_reference

    table = getattr(store, "backing", store)  # a cache's reference is the table behind it
    unique, inverse = torch.unique(row_ids.cpu().to(torch.int64), return_inverse=True)
    packed = table.gather_packed(unique - table.row_begin).cpu()
    return lookup_rows_reference(inverse, packed, store.E)


def _write_chart(
    path: Path, tokenizer: Any, token_ids: Any, layer_rows: Any, cfg: Any, gates: Any
) -> None:
    """Two panels: how often each token's n-gram rows were already used, and the gates."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from engramrt.cli._checks import write_output

    t_len = len(token_ids)
    h = cfg.n_heads
    orders = range(2, cfg.max_ngram_size + 1)
    reuse = np.zeros((len(orders), t_len))
    for oi, _ in enumerate(orders):
        seen: dict[int, int] = {}
        for p in range(t_len):
            row = int(layer_rows[p, oi * h])  # head 0 of this order
            reuse[oi, p] = seen.get(row, 0)
            seen[row] = seen.get(row, 0) + 1
    labels = [tokenizer.decode([int(t)]) for t in token_ids]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, t_len * 0.22), 6), sharex=True)
    width = 0.8 / len(orders)
    for oi, order in enumerate(orders):
        top.bar(np.arange(t_len) + oi * width, reuse[oi], width, label=f"{order}-gram")
    top.set_ylabel("earlier uses of this row")
    top.set_title(f"{cfg.name}, layer {cfg.layer_ids[0]}: n-gram rows reused across the text")
    top.legend(loc="upper left")
    image = bottom.imshow(gates.T, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    bottom.set_ylabel("stream")
    bottom.set_title("gate value per token and hyper-connection stream")
    bottom.set_xticks(np.arange(t_len))
    bottom.set_xticklabels(labels, rotation=90, fontsize=7)
    fig.colorbar(image, ax=bottom, fraction=0.02)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_output("--plot", path, buf.getvalue())


def run_synthetic(
    *,
    config: str,
    text: str | None,
    device: str,
    plot: Path | None,
    checkpoint: Path | None,
    tier: str,
    cache_mib: float,
) -> None:
    """Stream a text (``None``: :data:`DEFAULT_TEXT`) through Engram like an engine would
    and check every step; write the chart to ``plot`` when given."""
    from engramrt.cli._checks import check_output_path
    from engramrt.cli._console import console
    from engramrt.cli._stages import Stages
    from engramrt.errors import EngramError

    if plot is not None:
        check_output_path("--plot", plot)
    stages = Stages(console)
    stages.say(
        f"[bold]engramrt demo --synthetic[/]: streaming a text through the {config} layout "
        f"with {'rows from ' + str(checkpoint) if checkpoint else 'synthetic rows'}, random "
        f"weights and random hidden states, each step checked against its reference"
    )
    if not 0 <= cache_mib < 2**40:
        raise EngramError(f"--cache-mib={cache_mib}; expected a finite size in MiB >= 0")
    if tier == "disk":
        raise EngramError(
            "--tier='disk' needs a file for the packed rows and the demo takes no path for "
            "it; expected auto, device, uva or host"
        )
    text = DEFAULT_TEXT if text is None else text
    with stages.stage("loading torch, the tokenizer and its token map"):
        import numpy as np
        import torch
        from rich.table import Table

        from engramrt.cli._checks import parse_device
        from engramrt.config import load_config
        from engramrt.gate import gate_values_reference
        from engramrt.hashing import HashBatch, HashConstants, NgramHasher
        from engramrt.layer import EngramLayer
        from engramrt.layout import EngramLayout
        from engramrt.testing.model import random_heads
        from engramrt.tokenmap import TokenMap, load_tokenizer

        dev = parse_device("--device", device, allow_auto=True)
        cfg = load_config(config)
        layout = EngramLayout(cfg)
        token_map = TokenMap.from_tokenizer_file()
        tokenizer = load_tokenizer()
    consts = HashConstants.from_layout(layout, token_map.pad_id(cfg))
    token_ids = np.array(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    if token_ids.size < 24:
        raise EngramError(f"the text has {token_ids.size} tokens; the demo needs at least 24")
    hasher = NgramHasher(consts, token_map, dev, check_ids=True)
    console.print(
        f"[bold]engramrt demo[/]: {cfg.name} layout ({cfg.n_layers} layers, C={cfg.n_cols}, "
        f"{sum(layout.num_embeddings):,} rows), {token_ids.size} tokens, device {dev}, "
        f"hash backend {hasher.backend}"
    )
    rows_from = (
        f"rows read from {checkpoint} (tier {tier})"
        if checkpoint is not None
        else "rows computed from their row ids (a synthetic table: no trained rows)"
    )
    console.print(
        f"[bold]synthetic[/]: {rows_from}; the wkv, q and k weights and the hidden states "
        f"(random, seed 0; D capped at 1024); no trained model. [bold]real[/]: the DeepSeek-V4 "
        f"tokenizer, its token map, the hashing and the {cfg.name} layout"
    )

    row_ids = hasher(HashBatch.single(token_ids, device=dev)).to(torch.int64).cpu().numpy()
    repeats = _print_compressed_ids(tokenizer, token_map, token_ids, row_ids, cfg.n_heads)

    # Rows from a synthetic table (computed from the row ids) or a checkpoint,
    # optionally behind a hot-row cache; Engram layers with a random wkv
    # (D capped at 1024 to stay quick on a CPU) and random hidden states:
    # every stage against its reference.
    t_len, hc, dim = int(token_ids.size), cfg.hc_mult, min(cfg.hidden_size, 1024)
    stores = _stores(cfg, checkpoint, tier, dev, cache_mib)
    heads = random_heads(cfg.replace(hidden_size=dim), dev, seed=0)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(t_len, hc, dim, generator=gen).bfloat16().to(dev)
    steps, runtime = _stream_checked(hasher, stores, heads, hidden, token_ids, token_map, consts)
    cache_stats = runtime.cache_stats() if cache_mib > 0 else []
    # The whole text in one step of one layer: a plain EngramLayer over the store.
    ids_dev = torch.as_tensor(row_ids, device=dev)
    whole = EngramLayer(heads[0], stores[0], max_tokens=t_len)
    out, kv = whole(hidden, ids_dev[:, 0], return_kv=True)
    rows = _reference_rows(stores[0], ids_dev[:, 0])
    steps.append(
        {
            "step": f"Engram layer {cfg.layer_ids[0]} (lookup + wkv + gate), whole text",
            "tokens": t_len,
            "ok": _layer_within_tolerance(heads[0], hidden, rows.to(dev), kv, out),
        }
    )
    head0 = heads[0]
    gates = (
        gate_values_reference(hidden, kv, head0.q_weight, head0.k_weight, cfg.rms_norm_eps)
        .cpu()
        .numpy()
    )

    checks = Table(
        title="checks: streaming through the runtime (slot cache) vs one-shot hashing and "
        "the reference lookup; rows and gate vs references",
        title_justify="left",
    )
    for name in ("step", "tokens", "matches"):
        checks.add_column(name)
    for s in steps:
        checks.add_row(s["step"], str(s["tokens"]), "yes" if s["ok"] else "[red]NO[/]")
    console.print(checks)

    _print_cache_hits(cache_stats, cache_mib)

    batch = HashBatch.single(token_ids, device=dev)
    _print_timing(
        [
            ("hash ids", lambda: hasher(batch)),
            (
                "lookup, both layers" + (" (through the cache)" if cache_mib > 0 else ""),
                lambda: [st.lookup(ids_dev[:, li]) for li, st in enumerate(stores)],
            ),
            (
                f"Engram layer {cfg.layer_ids[0]}, whole text (D={dim})",
                lambda: whole(hidden, ids_dev[:, 0]),
            ),
        ],
        dev,
        t_len,
    )

    _print_memory_plan(cfg, layout)
    if plot is not None:
        _write_chart(plot, tokenizer, token_ids, row_ids[:, 0], cfg, gates)
        console.print(f"chart: {plot.resolve()}", highlight=False, soft_wrap=True, markup=False)
    failed = [s["step"] for s in steps if not s["ok"]]
    if failed or not all(same for *_, same in repeats):
        console.print(f"[bold red]FAILED[/]: {failed}")
        raise SystemExit(1)
    console.print(f"[bold green]all {len(steps)} checks passed[/]")


def _print_compressed_ids(
    tokenizer: Any, token_map: Any, token_ids: Any, row_ids: Any, n_heads: int
) -> list[tuple[int, int, bool]]:
    """Print the first tokens' compressed ids and the bigrams that differ only in case or
    spacing; returns those bigrams ``(earlier, later, same 2-gram rows)``."""
    import numpy as np
    from rich.table import Table

    from engramrt.cli._console import console

    comp = token_map.compress(token_ids)
    sharing = np.bincount(token_map.map, minlength=token_map.num_compressed)
    first = Table(
        title="first tokens: compressed ids merge case and space variants", title_justify="left"
    )
    for name in ("pos", "token", "id", "compressed", "ids sharing it"):
        first.add_column(name, justify="right")
    for p in range(min(12, token_ids.size)):
        piece = tokenizer.decode([int(token_ids[p])])
        first.add_row(str(p), repr(piece), str(token_ids[p]), str(comp[p]), str(sharing[comp[p]]))
    console.print(first)

    repeats, seen = [], set()
    for p in range(2, token_ids.size):
        for q in range(1, p):
            pair = (int(token_ids[p - 1]), int(token_ids[p]))
            if (
                comp[p] == comp[q]
                and comp[p - 1] == comp[q - 1]
                and token_ids[p - 1] != token_ids[q - 1]
                and pair not in seen
            ):
                seen.add(pair)
                same = bool(np.array_equal(row_ids[p, :, :n_heads], row_ids[q, :, :n_heads]))
                repeats.append((q, p, same))
                break
    variants = Table(
        title="bigrams that differ in case or spacing share their 2-gram rows",
        title_justify="left",
    )
    for name in ("bigram", "earlier", "same rows"):
        variants.add_column(name)
    for q, p, same in repeats[:6]:
        variants.add_row(
            repr(tokenizer.decode([int(token_ids[p - 1]), int(token_ids[p])])),
            repr(tokenizer.decode([int(token_ids[q - 1]), int(token_ids[q])])),
            "yes" if same else "[red]NO[/]",
        )
    console.print(variants)
    return repeats


def _check_checkpoint_shapes(checkpoint: Path, cfg: Any) -> None:
    """Refuse a checkpoint whose tables do not have the config's shapes (a tiny model's
    checkpoint under ``-c dsv41-flash``) from its headers alone, before tier ``auto``
    sizes memory for the config's tables: the mismatch is the error to report, not the
    memory the config would need."""
    from engramrt.checkpoint.names import TensorNames
    from engramrt.checkpoint.reader import SafetensorsCheckpoint, plan_layer_read
    from engramrt.layout import EngramLayout

    layout = EngramLayout(cfg)
    names = TensorNames.from_spec(None)
    with SafetensorsCheckpoint(checkpoint) as opened:
        for layer_index in range(cfg.n_layers):
            shard = layout.column_shard(layer_index, 1, 0)
            plan_layer_read(opened, cfg, layout, layer_index, shard, names)


def _stores(cfg: Any, checkpoint: Path | None, tier: str, dev: Any, cache_mib: float) -> list[Any]:
    """Each layer's rows: a checkpoint's (on ``tier``) or a synthetic table, behind a hot-row
    cache when ``cache_mib`` > 0."""
    from engramrt.lookup.tiers import SyntheticOptions, SyntheticRowStore, TablePlacement

    stores: list[Any]
    if checkpoint is not None:
        from engramrt.checkpoint import load_table

        placement = TablePlacement(tier, device=dev)  # a bad tier is refused first
        _check_checkpoint_shapes(checkpoint, cfg)
        stores = [load_table(checkpoint, cfg, li, placement) for li in range(cfg.n_layers)]
    else:
        stores = [
            SyntheticRowStore(n, cfg.head_dim, SyntheticOptions(seed=li), device=dev)
            for li, n in enumerate(cfg.num_embeddings)
        ]
    if cache_mib > 0:
        from engramrt.cache import cached_stores

        stores = cached_stores(stores, cfg, int(cache_mib * 2**20))
    return stores


def _print_cache_hits(cache_stats: list[Any], cache_mib: float) -> None:
    """The hot-row cache's hits over the stream, per layer and n-gram order."""
    from rich.table import Table

    from engramrt.cli._console import console

    if cache_stats:
        hits = Table(
            title=f"hot-row cache ({cache_mib:g} MiB per layer) over the stream, by n-gram order",
            title_justify="left",
        )
        for name in ("layer", "order", "hits", "misses", "hit rate", "bytes saved"):
            hits.add_column(name, justify="right")
        for st in cache_stats:
            for order, counts in st.by_order().items():
                hits.add_row(
                    str(st.layer_id),
                    str(order),
                    str(int(counts["hits"])),
                    str(int(counts["misses"])),
                    f"{counts['hit_rate']:.0%}",
                    f"{int(counts['bytes_saved']):,}",
                )
        console.print(hits)


def _print_timing(stages: list[tuple[str, Any]], dev: Any, t_len: int) -> None:
    """Median of 20 timed calls of each ``(label, fn)``."""
    import torch
    from rich.table import Table

    from engramrt.cli._console import console

    timing = Table(
        title=f"per-stage time on {dev} ({t_len} tokens, median of 20)", title_justify="left"
    )
    timing.add_column("stage")
    timing.add_column("ms", justify="right")
    for label, fn in stages:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        timing.add_row(label, f"{sorted(times)[10]:.3f}")
    console.print(timing)


def _print_memory_plan(cfg: Any, layout: Any) -> None:
    """Memory per placement of the config's tables, for the tensor-parallel sizes that fit."""
    from rich.table import Table

    from engramrt.cli._console import console
    from engramrt.plan import memory_plan

    plan = Table(title=f"memory plan for {cfg.name} tables", title_justify="left")
    for name in ("tp", "GPU / rank", "host / node", "disk / node"):
        plan.add_column(name, justify="right")
    for tp in (t for t in (1, 2, 4, 8) if (t - 1) * -(-cfg.n_cols // t) < cfg.n_cols):
        gpu, host, disk = memory_plan(layout, tp)
        plan.add_row(
            str(tp),
            f"{gpu.gpu_bytes_per_rank / 2**30:.1f} GiB",
            f"{host.host_bytes_per_node / 2**30:.1f} GiB",
            f"{disk.disk_bytes_per_node / 2**30:.1f} GiB",
        )
    console.print(plan)
