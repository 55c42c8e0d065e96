"""DeepSeek's Engram, the first memory family: its value and the pieces that compute it.

The family's parts, importable from here as Qwen4-Exp PLE's are from
:mod:`engramrt.families.qwen4_ple`:

- :class:`DeepSeekEngramFamily` (``family.py``): the family as a
  :class:`~engramrt.family.MemoryFamily` value (tables, tensor roles, fingerprint),
  registered as ``"deepseek-engram"``;
- the config and its hash layout (:class:`EngramConfig`, :func:`load_config`,
  :class:`EngramLayout`), the compressed token map (:class:`TokenMap`);
- its row-id maker, the n-gram hasher (:class:`NgramHasher`), and the history stores an
  engine binds (:class:`SlotHashCache`, :class:`RequestHistory`);
- its head (:class:`EngramHead`: ``wkv`` and the fused gate).

The modules that define them keep their paths (``engramrt.config``, ``engramrt.layout``,
``engramrt.tokenmap``, ``engramrt.hashing``, ``engramrt.layer``), which stay importable.
"""

from engramrt.config import EngramConfig, load_config
from engramrt.families.deepseek_engram.family import DeepSeekEngramFamily
from engramrt.hashing import NgramHasher, RequestHistory, SlotHashCache
from engramrt.layer.head import EngramHead
from engramrt.layout import EngramLayout
from engramrt.tokenmap import TokenMap

__all__ = [
    "DeepSeekEngramFamily",
    "EngramConfig",
    "EngramHead",
    "EngramLayout",
    "NgramHasher",
    "RequestHistory",
    "SlotHashCache",
    "TokenMap",
    "load_config",
]
