"""The configurations the Kubernetes tests run: a lender with one ``chat`` upstream (openai
adapter) gated on system memory, presence ``headless``, a read token for the companion and a
borrow token for borrowers, on ephemeral loopback ports; and a companion following it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.support.config import companion_toml, daemon_toml, lender, token, upstream

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


def follower_toml(
    url: str,
    *,
    timeout_s: float,
    poll_s: float = 30.0,
    ns: str = "vacancy",
    lendable_stable_s: float | None = 0.0,
) -> str:
    """A companion (against a fake API server: no kubeconfig) following one lender ``pc`` at
    ``url`` for node ``pc`` (192.0.2.10) in namespace ``ns``, with heartbeats and resyncs
    far apart; ``timeout_s`` bounds each read of the lender, ``poll_s`` is its cadence.
    A return to lendable is published at once (``lendable_stable_s`` 0; None: the default)."""
    cluster: dict[str, Any] = {"namespace": ns, "heartbeat_s": 60, "resync_s": 60}
    if lendable_stable_s is not None:
        cluster["lendable_stable_s"] = lendable_stable_s
    return companion_toml(
        lender("pc", url, READ, "192.0.2.10", node="pc"),
        kubernetes=cluster,
        lender_timeout_s=timeout_s,
        status_poll_s=poll_s,
    )
