"""Fixtures shared by integration modules: the Debian package, built once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.systemd_guest import built_package, require_guest


@pytest.fixture(scope="session")
def vacancyd_package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(vacancyd_<version>_<arch>.deb built by tools/build-deb from this checkout, the
    wheelhouse it was made of). Only built where a systemd guest can boot."""
    require_guest()
    with built_package(tmp_path_factory.mktemp("deb")) as built:
        yield built
