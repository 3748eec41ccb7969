"""The lender configuration the Kubernetes tests run: one ``chat`` upstream (openai adapter)
gated on system memory, presence ``headless``, a read token for the companion and a borrow
token for borrowers, on ephemeral loopback ports."""

from __future__ import annotations

from tests.support.config import daemon_toml, upstream

READ = "r" * 24
BORROW = "b" * 24


def lender_toml(target: str, kubernetes: str = "") -> str:
    """Config text for ``running_daemon``; ``kubernetes`` is appended verbatim (a
    ``[kubernetes]`` table for host-side publishing)."""
    tokens = [
        {"name": "reader", "token": READ, "scopes": ["read"]},
        {"name": "borrower", "token": BORROW, "scopes": ["borrow"]},
    ]
    return daemon_toml(
        upstream("chat", target),
        server={"trust_loopback": None, "tokens": tokens},
        collectors={"poll_s": 0.2},
        extra=kubernetes,
    )
