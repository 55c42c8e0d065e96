"""Many processes on one node: one shared host copy of each table shard.

Moving rows between ranks is the business of :mod:`engramrt.exchange`
(all-gather, sequence parallel, all-to-all); this package shares memory.

- :class:`SharedHostTable`: data-parallel replicas on one node share one
  host copy of each shard, loaded once into ``/dev/shm`` and mapped
  read-only by everyone, with a crash-safe publication protocol
  (:mod:`.shared_table`); :func:`shared_store` / :func:`load_shared_table`
  serve it through the host-gather or UVA tier without copying
  (:mod:`.stores`).

This package imports torch; ``import engramrt`` does not import it.
"""

from __future__ import annotations

from engramrt.distributed.shared_table import (
    DIRECTORY_ENV,
    Loader,
    SharedHostTable,
    SharingDecision,
    SharingRequest,
    TablePaths,
    clean_stale_tmp_files,
    decide_sharing,
    default_directory,
    node_id,
)
from engramrt.distributed.stores import (
    SharedRows,
    checkpoint_fingerprint,
    checkpoint_loader,
    load_shared_table,
    shared_store,
    shared_table_name,
    shared_tiers,
)

__all__ = [
    "DIRECTORY_ENV",
    "Loader",
    "SharedHostTable",
    "SharedRows",
    "SharingDecision",
    "SharingRequest",
    "TablePaths",
    "checkpoint_fingerprint",
    "checkpoint_loader",
    "clean_stale_tmp_files",
    "decide_sharing",
    "default_directory",
    "load_shared_table",
    "node_id",
    "shared_store",
    "shared_table_name",
    "shared_tiers",
]
