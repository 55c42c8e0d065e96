"""Fixtures of the ``engramrt`` command tests: ``convert`` takes the checkpoint tests'
configs and random tables."""

from tests.checkpoint.conftest import small, tiny, tiny_tables

__all__ = ["small", "tiny", "tiny_tables"]
