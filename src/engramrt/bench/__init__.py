"""Benchmarks: a registry of cases (:mod:`.registry`) and one runner (:mod:`.runner`)."""
