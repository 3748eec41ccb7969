"""TLS on every listener with a throwaway CA made in the test (trustme, on the
``cryptography`` package): the real ``openai`` client borrows over HTTPS, mutual TLS refuses
a client without a certificate, and renewed certificates are picked up on reload."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trustme

from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app

TOKEN = "borrow-token-0123456789"


def config(target: str, tls: Mapping[str, Any]) -> str:
    """A token-guarded lender whose API listener's ``[server]`` TLS keys are ``tls``."""
    return daemon_toml(
        upstream("up", target, models={"default_mib": 1}),
        server={"trust_loopback": None, **tls},
        tokens=(token("cluster", TOKEN, "borrow"),),
        collectors={"poll_s": 0.2},
    )


def issue(ca: trustme.CA, where: Path, stem: str) -> tuple[Path, Path]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path = where / f"{stem}.crt", where / f"{stem}.key"
    cert.cert_chain_pems[0].write_to_path(cert_path)
    cert.private_key_pem.write_to_path(key_path)
    return cert_path, key_path


@asynccontextmanager
async def tls_lender(tmp_path: Path, **extra: Any) -> AsyncIterator[RunningDaemon]:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    cert, key = issue(ca, tmp_path, "server")
    tls = {"tls_cert_file": cert, "tls_key_file": key, **extra}
    app, _seen = openai_like_app()
    async with serve_app(app) as url, running_daemon(config(url, tls)) as d:
        await d.wait_ready()
        d.ca = ca  # type: ignore[attr-defined]
        yield d


def https(d: RunningDaemon, listener: str) -> str:
    return f"https://{d.daemon.bound[listener]}"


async def test_the_openai_client_borrows_over_https(tmp_path: Path) -> None:
    async with tls_lender(tmp_path) as d:
        async with httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=tmp_path / "ca.pem")
        ) as http:
            client = openai.AsyncOpenAI(
                base_url=https(d, "up") + "/v1",
                api_key=TOKEN,
                http_client=http,  # type: ignore[arg-type]  # openai vendors its own httpx
                max_retries=0,
            )
            reply = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
            assert reply.choices[0].message.content == "hi"
            health = await http.get(https(d, "api") + "/healthz")
            assert health.status_code == 200
        # plain HTTP on a TLS listener gets no HTTP answer
        reader, writer = await asyncio.open_connection(*d.daemon.bound["up"].rsplit(":", 1))
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert not data.startswith(b"HTTP/1.1 200")


async def test_mutual_tls_requires_a_client_certificate(tmp_path: Path) -> None:
    async with tls_lender(tmp_path, tls_client_ca_file=tmp_path / "ca.pem") as d:
        ca: trustme.CA = d.ca  # type: ignore[attr-defined]
        url = https(d, "api") + "/healthz"
        async with httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=tmp_path / "ca.pem")
        ) as anonymous:
            with pytest.raises(httpx.HTTPError):
                await anonymous.get(url)
        client_cert = ca.issue_cert("borrower@example")
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        client_cert.configure_cert(ctx)
        async with httpx.AsyncClient(verify=ctx) as holder:
            assert (await holder.get(url)).status_code == 200


async def test_renewed_certificates_are_picked_up_on_reload(tmp_path: Path) -> None:
    async with tls_lender(tmp_path) as d:
        host, port = d.daemon.bound["api"].rsplit(":", 1)

        async def served_serial() -> int:
            ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
            _reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx)
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
            writer.close()
            from cryptography import x509

            return int(x509.load_der_x509_certificate(der).serial_number)

        before = await served_serial()
        ca: trustme.CA = d.ca  # type: ignore[attr-defined]
        _cert, key = issue(ca, tmp_path, "server")  # renewed in place
        assert await d.daemon.reload_tls()
        after = await served_serial()
        assert after != before
        # a broken renewal keeps the running certificate
        key.write_text("not a key")
        assert not await d.daemon.reload_tls()
        assert await served_serial() == after
