"""/status ``listener.state`` per upstream from the real socket table, and the warning
``vacancyd status`` prints when an upstream's server listens on the network."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import running_daemon
from vacancyd.cli import format_status
from vacancyd.core.status import StatusDocument


@contextmanager
def listening(host: str) -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.listen()
        yield int(s.getsockname()[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_listener_state_per_upstream_target() -> None:
    with listening("127.0.0.1") as private, listening("0.0.0.0") as exposed:
        toml = daemon_toml(
            upstream("private", f"http://127.0.0.1:{private}"),
            upstream("exposed", f"http://localhost:{exposed}"),
            upstream("down", f"http://127.0.0.1:{free_port()}"),
            upstream("remote", "http://192.0.2.10:8080"),
            collectors={"poll_s": None},
        )
        async with running_daemon(toml) as d:
            await d.wait_until(lambda: len(d.state.target_exposure) == 4, 10)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{d.api_url}/status") as resp:
                    doc = await resp.json()
    states = {name: u["listener"]["state"] for name, u in doc["upstreams"].items()}
    assert states == {
        "private": "loopback_only",
        "exposed": "listens_on_network",
        "down": "unknown",
        "remote": "not_observable",
    }
    assert f"0.0.0.0:{exposed}" in doc["upstreams"]["exposed"]["listener"]["state_detail"]
    text = format_status(StatusDocument.from_json(doc))
    warnings = [line for line in text.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and f"0.0.0.0:{exposed}" in warnings[0]
    assert text.index("exposed [openai]") < text.index(warnings[0])
