"""Importing the training ops loads no Triton and touches no GPU."""

from __future__ import annotations

from tests.helpers import assert_import_is_lean


def test_training_import_is_lean():
    assert_import_is_lean("engramrt_lab.training")
