"""Which sockets serve an upstream's target, classified (vacancyd.core.exposure)."""

from __future__ import annotations

import pytest

from vacancyd.core.exposure import ListenerExposure as E
from vacancyd.core.exposure import classify

LOCAL = ["127.0.0.1", "::1", "192.168.1.5"]


@pytest.mark.parametrize(
    ("targets", "listening", "expected"),
    [
        (["127.0.0.1"], [("127.0.0.1", 8080)], E.LOOPBACK_ONLY),
        (["127.0.0.1", "::1"], [("::1", 8080)], E.LOOPBACK_ONLY),
        (["127.0.0.1"], [("0.0.0.0", 8080)], E.LISTENS_ON_NETWORK),
        (["127.0.0.1"], [("::", 8080)], E.LISTENS_ON_NETWORK),  # dual-stack wildcard
        (["127.0.0.1"], [("127.0.0.1", 8080), ("192.168.1.5", 8080)], E.LISTENS_ON_NETWORK),
        (["192.168.1.5"], [("192.168.1.5", 8080)], E.LISTENS_ON_NETWORK),
        (["127.0.0.1"], [("127.0.0.1", 9999)], E.UNKNOWN),
        (["127.0.0.1"], [("::1", 8080)], E.UNKNOWN),  # IPv6-only loopback misses IPv4
        (["127.0.0.1"], [], E.UNKNOWN),
        (["10.9.9.9"], [("0.0.0.0", 8080)], E.NOT_OBSERVABLE),
        ([], [("0.0.0.0", 8080)], E.NOT_OBSERVABLE),  # a name that does not resolve
    ],
)
def test_classify(targets: list[str], listening: list[tuple[str, int]], expected: E) -> None:
    verdict = classify(targets, 8080, LOCAL, listening)
    assert verdict.state is expected
    assert verdict.detail


def test_network_detail_names_the_exposed_address() -> None:
    verdict = classify(["127.0.0.1"], 8080, LOCAL, [("0.0.0.0", 8080)])
    assert "0.0.0.0:8080" in verdict.detail
