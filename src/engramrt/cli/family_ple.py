"""The command-line hooks of Qwen4-Exp PLE (:func:`engramrt.family.command_line_hooks`).

- ``read_config``: the :class:`PleConfig` of a ``--config`` (PLE on);
- ``hash_run``: ``engramrt hash`` (:mod:`engramrt.cli.hash_ple`);
- ``inspect_report``, ``print_inspect``: ``engramrt inspect -c``, what the model's row ids
  are made of (docs/families.md §2): per PLE layer, the multipliers, each head's prime
  bucket count and first row, the table's rows; the family's fingerprint (what a
  converted checkpoint records), and the memory plan of ``engramrt plan``.

A family from another distribution gives a module like this one (see docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

from engramrt.cli._family_config import FamilyConfig, family_value, ple_config
from engramrt.cli._hash_run import HashRun

read_config = ple_config


def hash_run(run: HashRun, loaded: FamilyConfig) -> bool:
    """Raw ids through :class:`PleHasher`, each chunk carrying the request's last ``N - 1``
    ids (:mod:`engramrt.cli.hash_ple`); whether they equal one-shot hashing."""
    from engramrt.cli.hash_ple import hash_ple

    return hash_ple(run, ple_config(loaded))


def inspect_report(loaded: FamilyConfig, tp: int) -> dict[str, Any]:
    """Everything ``inspect`` prints for a Qwen4-Exp config, as one JSON-able object."""
    from engramrt.cli.plan_cmd import plan_report
    from engramrt.families.qwen4_ple.ids import PleConstants

    config = ple_config(loaded)
    family = family_value(loaded)
    consts = PleConstants.from_config(config)
    return {
        "config": loaded.text,
        "family": loaded.family,
        "ple_layer_ids": list(config.ple_layer_ids),
        "decoder_layers": list(config.decoder_layer_indices),
        "vocab_size": config.vocab_size,
        "eos_token_id": config.eos,
        "ngram_size": config.ngram_size,
        "heads_per_ngram": config.heads_per_ngram,
        "n_cols": config.n_cols,
        "embed_dim": config.embed_dim,
        "table_width": config.table_width,
        "row_bytes": 2 * config.table_width,
        "seed": config.seed,
        "multipliers": consts.multipliers.tolist(),
        "head_sizes": consts.head_sizes.tolist(),
        "offsets": consts.offsets.tolist(),
        "table_rows": list(consts.table_rows),
        "fingerprint": family.fingerprint(),
        "tp": tp,
        "memory_plan": plan_report(loaded.text, str(tp)),
    }


def print_inspect(report: dict[str, Any]) -> None:
    from rich.table import Table

    from engramrt.cli._console import console

    console.print(
        f"[bold]{report['config']}[/] ({report['family']}): PLE layers "
        f"{report['ple_layer_ids']} (decoder layers {report['decoder_layers']}), "
        f"N={report['ngram_size']}, H={report['heads_per_ngram']} (C={report['n_cols']} "
        f"heads), d={report['table_width']} bf16 ({report['row_bytes']} B per row), "
        f"E={report['embed_dim']}, vocab {report['vocab_size']:,}, EOS "
        f"{report['eos_token_id']}, seed {report['seed']}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(f"fingerprint {report['fingerprint']}", highlight=False, soft_wrap=True)
    h = report["heads_per_ngram"]
    for index, layer in enumerate(report["ple_layer_ids"]):
        table = Table(
            title=f"PLE layer {layer}: {report['table_rows'][index]:,} rows",
            title_justify="left",
        )
        for name in ("head", "order", "prime", "offset"):
            table.add_column(name, justify="right")
        sizes, offsets = report["head_sizes"][index], report["offsets"][index]
        for head, (size, offset) in enumerate(zip(sizes, offsets, strict=True)):
            table.add_row(str(head), str(head // h + 2), f"{size:,}", f"{offset:,}")
        console.print(table)
        multipliers = ", ".join(str(m) for m in report["multipliers"][index])
        console.print(f"  multipliers (shift 0..{report['ngram_size'] - 1}): {multipliers}")
    plan = report["memory_plan"]
    at_tp = plan["tp"][0]
    console.print(
        f"memory: {len(plan['tables'])} bf16 table(s), {plan['total_bytes']:,} B in all; at "
        f"tp={at_tp['tp']} the largest rank holds {at_tp['max_rank_bytes']:,} B "
        f"(engramrt plan -c {report['config']} for other sizes)",
        highlight=False,
        soft_wrap=True,
    )
