"""Many GPUs and processes: tensor- and data-parallel table lookups over torch.distributed.

- :class:`TPLookup`: each rank of a tensor-parallel group serves its hash
  columns (SPEC §7) from its shard store; an all-gather of the column blocks
  rebuilds ``[T, C, E]`` on every rank (:mod:`.tensor_parallel`).
- :class:`SharedHostTable`: data-parallel replicas on one node share one
  host copy of each shard, loaded once into ``/dev/shm`` and mapped
  read-only by everyone, with a crash-safe publication protocol
  (:mod:`.shared_table`); :func:`shared_store` / :func:`load_shared_table`
  serve it through the host-gather or UVA tier without copying
  (:mod:`.stores`).
- :class:`AllToAllLookup`: the columns sharded over every rank (TP x DP),
  ids and rows exchanged with ``all_to_all_single`` (:mod:`.all_to_all`).

The same code runs over gloo (CPU tensors) and NCCL (CUDA tensors). This
package imports torch; ``import engramrt`` does not import it.
"""

from __future__ import annotations

from engramrt.distributed.all_to_all import (
    AllToAllLookup,
    all_to_all_lookup_reference,
    owner_columns,
)
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
from engramrt.distributed.tensor_parallel import TP_COLLECTIVES, TPLookup

__all__ = [
    "DIRECTORY_ENV",
    "TP_COLLECTIVES",
    "AllToAllLookup",
    "Loader",
    "SharedHostTable",
    "SharedRows",
    "SharingDecision",
    "SharingRequest",
    "TPLookup",
    "TablePaths",
    "all_to_all_lookup_reference",
    "checkpoint_fingerprint",
    "checkpoint_loader",
    "clean_stale_tmp_files",
    "decide_sharing",
    "default_directory",
    "load_shared_table",
    "node_id",
    "owner_columns",
    "shared_store",
    "shared_table_name",
    "shared_tiers",
]
