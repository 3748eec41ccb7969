"""The lender configuration the Kubernetes tests run: one ``chat`` upstream (openai adapter)
gated on system memory, presence ``headless``, a read token for the companion and a borrow
token for borrowers, on ephemeral loopback ports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.support.config import daemon_toml, token, upstream

READ = "r" * 24
BORROW = "b" * 24


def lender_toml(
    target: str, *, kubernetes: Mapping[str, Any] | None = None, **upstream_keys: Any
) -> str:
    """Config text for ``running_daemon``; ``kubernetes``: the ``[kubernetes]`` table for
    host-side publishing, when given; ``upstream_keys``: more keys of the ``chat`` upstream."""
    return daemon_toml(
        upstream("chat", target, **upstream_keys),
        server={"trust_loopback": None},
        tokens=(token("reader", READ, "read"), token("borrower", BORROW, "borrow")),
        collectors={"poll_s": 0.2},
        kubernetes=kubernetes,
    )
