"""A tiny Engram language model: backbone, corpus, training and serving.

- :mod:`engramrt.models.lm`: :class:`TinyLM`, a decoder in the DeepSeek-V4
  shape (hyper-connection streams, causal attention, SwiGLU), with Engram
  at two blocks; the same backbone without Engram is the baseline.
- :mod:`engramrt.models.vocab`: the trimmed vocabulary (K ids + ``<other>``).
- :mod:`engramrt.models.corpus`: the stdlib corpus and its row ids.
- :mod:`engramrt.models.train`: ``python -m engramrt.models.train --out DIR``.
- :mod:`engramrt.models.artifacts`: the files of a model directory.
- :mod:`engramrt.models.serve`: :func:`load_model` -> :class:`TinyEngramModel`
  (held-out loss, greedy generation through the runtime, eager reference).

Importing this package imports torch but no Triton kernel.
"""

from engramrt.models.lm import KVCache, LMConfig, TinyLM
from engramrt.models.serve import GenerationResult, ReferenceResult, TinyEngramModel, load_model
from engramrt.models.vocab import Vocab

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
