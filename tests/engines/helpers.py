"""Shared by the engine tests: which engines are here, and importing them."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import types

import pytest

ENGINES = {"sglang": "0.5.23", "vllm": "0.33.0"}
"""The engine versions these tests are written against (scripts/test-engines pins them)."""


def engine_skip_reason(name: str) -> str | None:
    """Why the tests of engine ``name`` cannot run here (None: they can)."""
    if importlib.util.find_spec(name) is None:
        return f"{name} is not installed; scripts/test-engines runs these tests with {name}=={ENGINES[name]}"
    version = importlib.metadata.version(name)
    if version != ENGINES[name]:
        return f"{name} {version} is installed; these tests are written for {name}=={ENGINES[name]}"
    return None


def requires_engine(name: str) -> pytest.MarkDecorator:
    """The mark of a module that tests engine ``name``: skipped, with the reason, where
    the engine is missing, except in the engine job, where that is an error."""
    reason = engine_skip_reason(name)
    declared = name in os.environ.get("ENGRAMRT_ENGINES_SKIPPED", "").split()
    if reason is not None and os.environ.get("ENGRAMRT_ENGINE_JOB") == "1" and not declared:
        raise pytest.UsageError(f"engine job: {reason}")
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def import_engine(name: str, *modules: str) -> types.SimpleNamespace:
    """``modules`` of engine ``name`` imported, as attributes named by their last part.
    An import error is a failure, not a skip: the engine is installed at its pin."""
    found = {}
    for module in modules:
        try:
            found[module.rsplit(".", 1)[-1]] = importlib.import_module(module)
        except Exception as error:  # pragma: no cover - a broken engine environment
            pytest.fail(
                f"{name}=={ENGINES[name]} is installed but {module} does not import: {error!r}"
            )
    return types.SimpleNamespace(**found)
