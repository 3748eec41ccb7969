"""Single-use login links for the status page (``vacancyd open``): a read-scope caller gets
a ticket, the page trades it once for a read-only session token, and a ticket bound to one
local user cannot be used from another user's connection (the owner of a loopback
connection is read from the kernel's socket table)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import RunningDaemon, running_daemon
from vacancyd.web.logins import connection_uid

READ = "read-token-for-links-0123456789"
ADMIN = "admin-token-for-links-012345678"
NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"
)


@pytest.fixture
async def lender() -> AsyncIterator[RunningDaemon]:
    toml = daemon_toml(
        upstream("up", "http://127.0.0.1:9", adapter="openai"),
        server={"trust_loopback": None},
        tokens=(token("prom", READ, "read"), token("ops", ADMIN, "admin")),
    )
    async with running_daemon(toml) as d:
        yield d


async def ticket(http: aiohttp.ClientSession, api: str, body: object = None) -> str:
    async with http.post(
        api + "/login/ticket", json={} if body is None else body, headers=bearer(READ)
    ) as r:
        assert r.status == 200, await r.text()
        doc = await r.json()
    assert doc["path"] == "/#login=" + doc["ticket"] and doc["expires_in_s"] == 60
    return str(doc["ticket"])


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def redeem_as(user: str, api: str, ticket: str) -> tuple[int, dict[str, object]]:
    """POST /login from a process running as ``user`` (its connection is that user's)."""
    script = (
        "import json, sys, urllib.request, urllib.error\n"
        "req = urllib.request.Request(sys.argv[1] + '/login', method='POST',"
        " data=json.dumps({'ticket': sys.argv[2]}).encode(),"
        " headers={'Content-Type': 'application/json'})\n"
        "try:\n"
        "    r = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req)\n"
        "    print(json.dumps([r.status, json.load(r)]))\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(json.dumps([e.code, json.load(e)]))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        "setpriv",
        "--reuid",
        user,
        "--regid",
        "nogroup",
        "--clear-groups",
        sys.executable,
        "-c",
        script,
        api,
        ticket,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd="/",
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    status, doc = json.loads(out)
    return int(status), doc


async def test_a_ticket_becomes_one_read_only_session(lender: RunningDaemon) -> None:
    api = lender.api_url
    async with aiohttp.ClientSession() as http:
        async with http.post(api + "/login/ticket", json={}) as r:
            assert r.status == 401  # a ticket needs the read scope
        t = await ticket(http, api)
        async with http.post(api + "/login", data=json.dumps({"ticket": t})) as r:
            assert r.status == 415  # a page elsewhere cannot post JSON without a preflight
        async with http.post(api + "/login", json={"ticket": t}) as r:
            assert r.status == 200, await r.text()
            doc = await r.json()
        assert doc["scopes"] == ["read"] and doc["expires_in_s"] == 12 * 3600
        session = doc["token"]
        assert session not in (t, READ, ADMIN)
        async with http.get(api + "/status", headers=bearer(session)) as r:
            assert r.status == 200
        async with http.put(
            api + "/admin/lending", json={"enabled": False}, headers=bearer(session)
        ) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "insufficient_scope"
        assert lender.state.lending_enabled
        async with http.post(api + "/login", json={"ticket": t}) as r:
            assert r.status == 401  # used once already
            assert (await r.json())["error"]["code"] == "invalid_login_ticket"
            assert "used already or has expired" in (await r.json())["error"]["message"]
        async with http.post(api + "/login", json={"ticket": "made-up"}) as r:
            assert r.status == 401


@needs_root
async def test_a_ticket_bound_to_a_user_works_only_from_that_users_connection(
    lender: RunningDaemon,
) -> None:
    api = lender.api_url
    async with aiohttp.ClientSession() as http:
        # root (sudo vacancyd open) asks for the desktop user's link
        t = await ticket(http, api, {"for_uid": NOBODY})
        async with http.post(api + "/login", json={"ticket": t}) as r:
            assert r.status == 401  # root's connection is not that user's
            assert "another local user" in (await r.json())["error"]["message"]
        status, doc = await redeem_as("nobody", api, t)
        assert status == 200 and doc["scopes"] == ["read"]

        # a link minted by root for itself is refused to another user, even first
        t = await ticket(http, api)
        status, doc = await redeem_as("nobody", api, t)
        assert status == 401
        async with http.post(api + "/login", json={"ticket": t}) as r:
            assert r.status == 200


@needs_root
def test_the_owner_of_a_loopback_connection_is_read_from_the_kernel() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as mine:
            conn, peer = server.accept()
            with conn:
                assert connection_uid(peer, conn.getsockname()) == os.geteuid()
                assert mine.fileno() >= 0
        import subprocess

        theirs = subprocess.Popen(
            [
                "setpriv",
                "--reuid",
                "nobody",
                "--regid",
                "nogroup",
                "--clear-groups",
                sys.executable,
                "-c",
                "import socket, sys, time\n"
                f"s = socket.create_connection(('127.0.0.1', {server.getsockname()[1]}))\n"
                "sys.stdin.read()\n",
            ],
            stdin=subprocess.PIPE,
            cwd="/",
        )
        try:
            conn, peer = server.accept()
            with conn:
                assert connection_uid(peer, conn.getsockname()) == NOBODY
        finally:
            assert theirs.stdin is not None
            theirs.stdin.close()
            theirs.wait(10)
    assert connection_uid(("127.0.0.1", 1), ("127.0.0.1", 2)) is None
