"""Memory families: hashed n-gram memories of different models, each a value the runtime's
pieces (tables, tiers, kernels, checkpoints) can serve.

- :mod:`engramrt.families.qwen4_ple`: Qwen4-Exp per-layer n-gram embeddings (PLE).
"""
