"""A tiny Engram language model: backbone, corpus, training and serving.

- :mod:`engramrt_lab.models.lm`: :class:`TinyLM`, a decoder in the DeepSeek-V4
  shape (hyper-connection streams, causal attention, SwiGLU), with Engram
  at two blocks; the same backbone without Engram is the baseline.
- :mod:`engramrt_lab.models.vocab`: the trimmed vocabulary (K ids + ``<other>``).
- :mod:`engramrt_lab.models.corpus`: the stdlib corpus and its row ids.
- :mod:`engramrt_lab.models.train`: ``python -m engramrt_lab.models.train --out DIR``.
- :mod:`engramrt_lab.models.artifacts`: the files of a model directory.
- :mod:`engramrt_lab.models.serve`: :func:`load_model` -> :class:`TinyEngramModel`
  (held-out loss, greedy generation through the runtime, eager reference).

Importing this package imports torch but no Triton kernel.
"""

from engramrt_lab.models.lm import KVCache, LMConfig, TinyLM
from engramrt_lab.models.serve import GenerationResult, ReferenceResult, TinyEngramModel, load_model
from engramrt_lab.models.vocab import Vocab

__all__ = [
    "GenerationResult",
    "KVCache",
    "LMConfig",
    "ReferenceResult",
    "TinyEngramModel",
    "TinyLM",
    "Vocab",
    "load_model",
]
