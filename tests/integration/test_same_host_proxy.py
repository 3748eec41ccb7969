"""A real nginx on the lender's own host in front of a loopback-trusting API listener: the
clients behind it are not the owner merely because nginx connects from 127.0.0.1. Only with
nginx named in ``trusted_proxies`` is a client it relays for from this host trusted, and a
remote client's own ``X-Forwarded-For: 127.0.0.1`` never makes it local.

Tests reach only loopback addresses, so nginx's realip module stands in for the network: a
request carrying ``X-Test-Client`` is, to nginx, from that address (its ``$remote_addr``),
which nginx then reports in ``X-Forwarded-For`` and ``X-Real-IP`` as it would for a client
that really connected from there.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.integration.test_balancers import (
    binary,
    free_port,
    nginx_check,
    running,
    until_listening,
)
from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import openai_like_app, running_daemon, serve_app

ADMIN = "admin-token-0123456789a"
REMOTE = {"X-Test-Client": "203.0.113.7"}

NGINX = """
events {}

http {
    server {
        listen 127.0.0.1:%(port)d;
        set_real_ip_from 127.0.0.0/8;
        real_ip_header X-Test-Client;

        location / {
            proxy_pass http://%(api)s;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Test-Client "";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Real-IP $remote_addr;
        }
    }
}
"""


@pytest.mark.parametrize("trusted", [[], ["127.0.0.1"]], ids=["no-trusted-proxy", "trusted"])
async def test_clients_behind_a_same_host_nginx_are_not_the_owner(
    tmp_path: Path, trusted: list[str]
) -> None:
    nginx = binary("nginx")
    app, _seen = openai_like_app()
    async with serve_app(app) as target:
        toml = daemon_toml(
            upstream("up", target, models={"default_mib": 1}),
            server={"trust_loopback": True, "trusted_proxies": trusted or None},
            tokens=(token("ops", ADMIN, "admin"),),
        )
        async with running_daemon(toml) as d:
            await d.wait_ready()
            port = free_port()
            conf = tmp_path / "nginx.conf"
            conf.write_text(NGINX % {"port": port, "api": d.daemon.bound["api"]})
            assert nginx_check(conf).returncode == 0
            argv = [
                nginx, "-p", str(tmp_path), "-c", str(conf),
                "-g", f"daemon off; pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log;",
            ]  # fmt: skip
            with running(argv, tmp_path / "nginx.log"):
                await until_listening(port)
                front = f"http://127.0.0.1:{port}"
                async with aiohttp.ClientSession() as http:

                    async def status(path: str, method: str = "GET", **headers: str) -> int:
                        body = b'{"enabled": false}' if method == "PUT" else None
                        async with http.request(
                            method,
                            front + path,
                            data=body,
                            headers={"Content-Type": "application/json", **headers},
                        ) as r:
                            return r.status

                    # a remote client, bare or claiming to be local
                    assert await status("/status", **REMOTE) == 401
                    assert await status("/admin/lending", "PUT", **REMOTE) == 401
                    spoof = {**REMOTE, "X-Forwarded-For": "127.0.0.1"}
                    assert await status("/status", **spoof) == 401
                    assert await status("/admin/lending", "PUT", **spoof) == 401
                    # with a token it is whoever the token says
                    auth = {"Authorization": f"Bearer {ADMIN}"}
                    assert await status("/status", **REMOTE, **auth) == 200
                    assert d.state.lending_enabled
                    # a client on this host, through nginx: the owner only if nginx is named
                    local = await status("/status")
                    assert local == (200 if trusted else 401)
                    # and directly, the owner in any case
                    async with http.get(d.api_url + "/status") as r:
                        assert r.status == 200
            log = (tmp_path / "error.log").read_text()
            assert "[emerg]" not in log, log
