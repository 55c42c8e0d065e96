"""Qwen4-Exp per-layer n-gram embeddings (PLE): the configuration, raw-id n-gram row ids
with their streaming state, and the PLE layer (grouped RMSNorms, a sigmoid gate and a
dilated causal conv with its streaming state). The rules are written down in
docs/families.md; the oracle is Hugging Face transformers 5.23.0
(``Qwen4ExpTextNGramEmbedding``, ``Qwen4ExpTextPLELayer``), a test-only dependency.
"""
