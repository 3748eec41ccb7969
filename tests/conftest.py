"""Shared fixtures. Test modules name what they cover in their docstrings."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_access_log() -> None:
    logging.getLogger("vacancyd.access").setLevel(logging.WARNING)
