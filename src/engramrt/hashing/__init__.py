"""N-gram hash ids (SPEC §4-5): reference, Triton kernel and streaming history.

- :func:`hash_sequence`: one whole sequence at once; the definition.
- :class:`NgramHasher`: one engine step (a ragged batch) in one launch.
- :func:`hash_batch_host`: one engine step on the host, in numpy, for
  lookups that gather rows on the CPU without waiting for the device.
- :class:`SlotHashCache`, :class:`RequestHistory`: where history lives
  when the batch's lookback ids do not carry it.
"""

from engramrt.hashing.history import RequestHistory, SlotHashCache
from engramrt.hashing.host import hash_batch_host
from engramrt.hashing.ops import NgramHasher
from engramrt.hashing.reference import hash_batch_reference, hash_sequence
from engramrt.hashing.types import DEAD, EMPTY, HashBatch, HashConstants

__all__ = [
    "DEAD",
    "EMPTY",
    "HashBatch",
    "HashConstants",
    "NgramHasher",
    "RequestHistory",
    "SlotHashCache",
    "hash_batch_host",
    "hash_batch_reference",
    "hash_sequence",
]
