"""Which borrower a request is (vacancyd.web.auth): a borrower's token names it wherever
the request comes from, a trusted loopback client included; everything else allowed is the
unnamed borrower; a refused request is nobody."""

from __future__ import annotations

from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from vacancyd.core.usage import UNNAMED, UNNAMED_LABEL, borrower_label
from vacancyd.web.auth import BORROWER, Authenticator, Token, borrower_token
from vacancyd.web.metrics import Metrics

FRIEND = "friend-secret-0123456789"
CLUSTER = "cluster-secret-0123456789"
SHARED = "shared-borrow-0123456789"
ADMIN = "admin-secret-0123456789xx"


def authenticator(*, trust_loopback: bool = False, unauthenticated: bool = False) -> Authenticator:
    return Authenticator(
        [
            Token("shared", SHARED, frozenset({"borrow"})),
            Token("admin", ADMIN, frozenset({"admin"})),
            borrower_token("friend", FRIEND),
            borrower_token("cluster", CLUSTER),
        ],
        trust_loopback=trust_loopback,
        metrics=Metrics(),
        allow_unauthenticated_remote=unauthenticated,
    )


def request(peer: str, token: str | None = None, **headers: str) -> web.Request:
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    headers.setdefault("Host", "127.0.0.1:18081")
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (peer, 40000) if name == "peername" else default
    )
    return make_mocked_request("POST", "/v1/chat/completions", headers=headers, transport=transport)


REMOTE = "192.0.2.7"
LOOPBACK = "127.0.0.1"


@pytest.mark.parametrize(("token", "who"), [(FRIEND, "friend"), (CLUSTER, "cluster")])
def test_a_named_token_is_that_borrower(token: str, who: str) -> None:
    auth = authenticator()
    req = request(REMOTE, token)
    assert auth.check(req, "borrow") is None
    assert auth.borrower(req) == who and req[BORROWER] == who


def test_the_single_borrow_token_is_the_unnamed_borrower() -> None:
    auth = authenticator()
    req = request(REMOTE, SHARED)
    assert auth.check(req, "borrow") is None
    assert auth.borrower(req) == UNNAMED == ""
    assert borrower_label(auth.borrower(req)) == UNNAMED_LABEL == "default"


def test_a_loopback_request_with_a_borrower_token_is_that_borrower() -> None:
    """A local gateway or an SSH tunnel relays borrowers' tokens from loopback: trust by
    position must not swallow who they are."""
    auth = authenticator(trust_loopback=True)
    req = request(LOOPBACK, FRIEND)
    assert auth.check(req, "borrow") is None
    assert auth.borrower(req) == "friend"


def test_a_loopback_request_with_a_borrower_token_holds_only_that_borrowers_scope() -> None:
    auth = authenticator(trust_loopback=True)
    denied = auth.check(request(LOOPBACK, FRIEND), "admin")
    assert denied is not None and denied.status == 403
    assert auth.check(request(LOOPBACK), "admin") is None  # without it: the owner, as before


def test_a_loopback_request_without_a_token_is_the_unnamed_borrower() -> None:
    auth = authenticator(trust_loopback=True)
    req = request(LOOPBACK)
    assert auth.check(req, "borrow") is None
    assert auth.borrower(req) == UNNAMED


def test_a_loopback_request_with_another_token_keeps_its_trust_and_is_unnamed() -> None:
    auth = authenticator(trust_loopback=True)
    for token in (SHARED, ADMIN, "not-any-token-at-all-000"):
        req = request(LOOPBACK, token)
        assert auth.check(req, "borrow") is None, token
        assert auth.borrower(req) == UNNAMED


def test_a_loopback_request_is_not_trusted_without_trust_loopback() -> None:
    auth = authenticator()
    denied = auth.check(request(LOOPBACK), "borrow")
    assert denied is not None and denied.status == 401
    req = request(LOOPBACK, FRIEND)
    assert auth.check(req, "borrow") is None and auth.borrower(req) == "friend"


def test_a_relayed_loopback_request_with_a_borrower_token_is_that_borrower() -> None:
    auth = authenticator(trust_loopback=True)
    req = request(LOOPBACK, CLUSTER, **{"X-Forwarded-For": "198.51.100.4"})
    assert auth.check(req, "borrow") is None
    assert auth.borrower(req) == "cluster"


@pytest.mark.parametrize("peer", [REMOTE, LOOPBACK])
def test_a_wrong_token_is_nobody(peer: str) -> None:
    auth = authenticator()
    req = request(peer, "wrong-token-0123456789")
    denied = auth.check(req, "borrow")
    assert denied is not None and denied.status == 401
    assert BORROWER not in req
    assert auth.borrower(req) == UNNAMED  # nobody: never read for a refused request


def test_a_borrower_token_holds_only_borrow() -> None:
    auth = authenticator()
    for scope in ("read", "admin"):
        denied = auth.check(request(REMOTE, FRIEND), scope)
        assert denied is not None and denied.status == 403
    assert auth.check(request(REMOTE, FRIEND), "probe") is None


def test_an_unauthenticated_borrower_is_unnamed_and_a_token_still_names() -> None:
    auth = authenticator(unauthenticated=True)
    req = request(REMOTE)
    assert auth.check(req, "borrow") is None and auth.borrower(req) == UNNAMED
    req = request(REMOTE, FRIEND)
    assert auth.check(req, "borrow") is None and auth.borrower(req) == "friend"


def test_a_borrower_token_with_a_foreign_host_still_authenticates() -> None:
    """The DNS-rebinding guard refuses only requests trusted for their position."""
    auth = authenticator(trust_loopback=True)
    req = request(LOOPBACK, FRIEND, Host="evil.example.com")
    assert auth.check(req, "borrow") is None and auth.borrower(req) == "friend"
