"""Fixtures of the hashing tests."""

from __future__ import annotations

import pytest

from engramrt.config import PRESETS
from engramrt.hashing import HashConstants


@pytest.fixture(scope="session")
def consts(token_map) -> HashConstants:
    """The ``tiny`` preset's hash constants over the DeepSeek-V4 token map."""
    return HashConstants.from_config(PRESETS["tiny"], token_map)
