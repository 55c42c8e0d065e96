"""Importing the model package (and its training and serving modules) loads no Triton
and touches no GPU."""

from __future__ import annotations

from tests.helpers import assert_import_is_lean


def test_models_import_is_lean():
    assert_import_is_lean(
        "engramrt_lab.models", "engramrt_lab.models.train", "engramrt_lab.models.serve"
    )
