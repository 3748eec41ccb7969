"""``vacancyd run`` without aiohttp's compiled HTTP parser: with ``AIOHTTP_NO_EXTENSIONS=1``
(as on a platform without aiohttp's wheels) aiohttp would parse on its lenient pure-Python
parser, which takes ambiguous framing (``Transfer-Encoding: chunked, chunked``) that the
compiled parser answers with 400; the daemon logs why and refuses to start (exit 2), and
binds nothing."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from e2e.test_daemon_process import lender_config, proc_env, vacancyd, wait_for

__all__ = ["proc_env"]  # the fixture, shared with test_daemon_process

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
BODY = b"\r\n2\r\n{}\r\n0\r\n\r\n"
#: Ambiguous framing, which the compiled parser refuses: two chunked codings, an unknown
#: coding, a coding the body is not framed by, Transfer-Encoding beside Content-Length, two
#: Content-Lengths that disagree.
SMUGGLING = {
    "chunked twice": HEAD + b"Transfer-Encoding: chunked, chunked\r\n" + BODY,
    "unknown coding": HEAD + b"Transfer-Encoding: chunked, x-custom\r\n" + BODY,
    "chunked not last": HEAD + b"Transfer-Encoding: chunked, identity\r\n" + BODY,
    "TE and CL": HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 9\r\n" + BODY,
    "two CLs": HEAD + b"Content-Length: 2\r\nContent-Length: 4\r\n\r\n{}{}",
}


def test_the_daemon_refuses_to_start_on_the_lenient_parser(
    tmp_path: Path, proc_env: dict[str, str]
) -> None:
    cfg, api, _proxy = lender_config(tmp_path)
    env = {**proc_env, "AIOHTTP_NO_EXTENSIONS": "1"}
    p = subprocess.Popen(
        vacancyd("run", "--config", str(cfg)),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 2, out
    assert "pure-Python parser because AIOHTTP_NO_EXTENSIONS is set" in out
    assert "Transfer-Encoding: chunked, chunked" in out
    with socket.socket() as s:  # nothing was bound
        assert s.connect_ex(("127.0.0.1", api)) != 0


def test_with_the_compiled_parser_ambiguous_framing_is_refused(
    tmp_path: Path, proc_env: dict[str, str]
) -> None:
    """What the refusal to start protects: the same request on the daemon as it runs is a
    400 from the parser, never forwarded."""
    cfg, api, proxy = lender_config(tmp_path)
    env = {k: v for k, v in proc_env.items() if k != "AIOHTTP_NO_EXTENSIONS"}
    p = subprocess.Popen(
        vacancyd("run", "--config", str(cfg)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(f"http://127.0.0.1:{api}/readyz")
        statuses = {}
        for name, data in SMUGGLING.items():
            with socket.create_connection(("127.0.0.1", proxy), timeout=10) as s:
                s.sendall(data)
                statuses[name] = s.recv(65536).split(b" ", 2)[1].decode()
        assert statuses == dict.fromkeys(SMUGGLING, "400")
    finally:
        p.terminate()
        p.wait(15)
