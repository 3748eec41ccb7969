"""Clients of a lender that serves TLS with a private CA or a self-signed certificate, both
made in the test: ``vacancyd status`` and the admin subcommands trust a CA given by
``--ca-file`` or ``VACANCYD_CA_FILE``; the Kubernetes companion trusts a ``ca_file`` given
for all lenders or for one; and a certificate that does not verify (no CA given, the wrong
CA) fails with an error that names the certificate problem."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.config import companion_toml, daemon_toml, lender, token, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.fake_kube import FakeKube
from vacancyd.cli import main
from vacancyd.config.load import parse_companion_config
from vacancyd.k8s.companion import Companion
from vacancyd.web.tls import CA_FILE_ENV, TlsError

READ = "read-token-0123456789ab"
ADMIN = "admin-token-0123456789a"


def config(target: str, cert: Path, key: Path) -> str:
    return daemon_toml(
        upstream("chat", target),
        server={"trust_loopback": None, "tls_cert_file": str(cert), "tls_key_file": str(key)},
        tokens=[token("reader", READ, "read"), token("ops", ADMIN, "admin")],
        collectors={"poll_s": 0.2},
    )


def self_signed(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (no CA behind it) and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-box")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = where / "self.crt", where / "self.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@asynccontextmanager
async def tls_lender(cert: Path, key: Path) -> AsyncIterator[RunningDaemon]:
    app, _seen = openai_like_app()
    async with serve_app(app) as url, running_daemon(config(url, cert, key)) as d:
        await d.wait_ready()
        yield d


def private_ca(where: Path) -> tuple[Path, Path, Path]:
    """(CA bundle, server certificate, key) from a fresh private CA."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(where / "ca.pem")
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.cert_chain_pems[0].write_to_path(where / "server.crt")
    leaf.private_key_pem.write_to_path(where / "server.key")
    return where / "ca.pem", where / "server.crt", where / "server.key"


async def cli(
    capsys: pytest.CaptureFixture[str], *argv: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Run the command line in a thread (it blocks; the daemon runs on this loop)."""

    def run() -> int:
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            return main(list(argv))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    capsys.readouterr()
    code = await asyncio.to_thread(run)
    out, err = capsys.readouterr()
    return code, out, err


async def test_the_cli_trusts_a_private_ca_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CA_FILE_ENV, raising=False)
    ca, cert, key = private_ca(tmp_path)
    (tmp_path / "other").mkdir()
    wrong, _, _ = private_ca(tmp_path / "other")
    async with tls_lender(cert, key) as d:
        url = f"https://{d.daemon.bound['api']}"
        read = ("--url", url, "--token", READ)

        code, out, err = await cli(capsys, "status", *read, "--ca-file", str(ca))
        assert code == 0, err
        assert "chat" in out
        code, out, err = await cli(capsys, "status", *read, env={CA_FILE_ENV: str(ca)})
        assert code == 0, err

        # no CA given: the system's CAs do not know this one
        code, _out, err = await cli(capsys, "status", *read)
        assert code == 1
        assert f"cannot verify the TLS certificate of {url}/status" in err
        assert "unable to get local issuer certificate" in err
        assert "--ca-file" in err and CA_FILE_ENV in err
        # the wrong CA: the same, naming the problem
        code, _out, err = await cli(capsys, "status", *read, "--ca-file", str(wrong))
        assert code == 1 and "unable to get local issuer certificate" in err

        # the admin subcommands take the same option
        admin = ("--url", url, "--token", ADMIN)
        code, out, err = await cli(capsys, "pause", "--for", "10m", *admin, "--ca-file", str(ca))
        assert code == 0, err
        assert any(h.key == "pause" for h in d.state.holds)
        code, _out, err = await cli(capsys, "resume", *admin, "--ca-file", str(wrong))
        assert code == 1 and "cannot verify the TLS certificate" in err
        code, _out, err = await cli(capsys, "resume", *admin, env={CA_FILE_ENV: str(ca)})
        assert code == 0, err
        await d.wait_until(lambda: not any(h.key == "pause" for h in d.state.holds), 5)


async def test_the_cli_trusts_a_self_signed_certificate_as_its_own_ca(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CA_FILE_ENV, raising=False)
    cert, key = self_signed(tmp_path)
    async with tls_lender(cert, key) as d:
        url = f"https://{d.daemon.bound['api']}"
        read = ("--url", url, "--token", READ)
        code, _out, err = await cli(capsys, "status", *read)
        assert code == 1 and "self-signed certificate" in err
        code, _out, err = await cli(capsys, "status", *read, "--ca-file", str(cert))
        assert code == 0, err
        # a host name the certificate does not name is refused, saying so
        other = f"https://localhost:{d.daemon.bound['api'].rsplit(':', 1)[1]}"
        code, _out, err = await cli(capsys, "status", "--url", other, "--ca-file", str(cert))
        assert code == 1 and "cannot verify the TLS certificate" in err
        assert "localhost" in err


async def test_a_ca_bundle_that_cannot_be_used_is_an_error_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    url = ("--url", "https://127.0.0.1:9", "--token", READ)
    for bundle, why in (
        (fifo, "is not a regular file (it is a FIFO"),
        (junk, "is it PEM?"),
        (tmp_path / "missing.pem", "No such file"),
    ):
        code, _out, err = await asyncio.wait_for(
            cli(capsys, "status", *url, "--ca-file", str(bundle)), 10
        )
        assert code == 2, err
        assert "--ca-file: cannot load the CA bundle" in err and why in err, err
    code, _out, err = await cli(capsys, "status", *url, env={CA_FILE_ENV: str(junk)})
    assert code == 2 and f"${CA_FILE_ENV}: cannot load the CA bundle" in err


def follower_toml(url: str, lender_ca: Path | None = None, global_ca: Path | None = None) -> str:
    keys = {} if lender_ca is None else {"ca_file": str(lender_ca)}
    return companion_toml(
        lender("pc", url, READ, "192.0.2.10", **keys),
        kubernetes={"namespace": "vacancy", "heartbeat_s": 60, "resync_s": 60},
        lender_timeout_s=5,
        status_poll_s=0.5,
        ca_file=None if global_ca is None else str(global_ca),
    )


@asynccontextmanager
async def companion(toml: str, kube: FakeKube) -> AsyncIterator[Companion]:
    c = Companion(parse_companion_config(toml, "<test>"), connect=kube.connect)
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


async def test_the_companion_trusts_the_ca_file_it_is_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca, cert, key = private_ca(tmp_path)
    (tmp_path / "other").mkdir()
    wrong, _, _ = private_ca(tmp_path / "other")
    async with tls_lender(cert, key) as d:
        url = f"https://{d.daemon.bound['api']}"
        loop = asyncio.get_running_loop()

        async def alive(c: Companion) -> bool:
            deadline = loop.time() + 5
            while loop.time() < deadline:
                if c.followers[0].lender.alive:
                    return True
                await asyncio.sleep(0.05)
            return False

        kube = FakeKube()
        # for all lenders
        async with companion(follower_toml(url, global_ca=ca), kube) as c:
            assert await alive(c)
        # for this lender, over a wrong one for all
        toml = follower_toml(url, lender_ca=ca, global_ca=wrong)
        async with companion(toml, FakeKube()) as c:
            assert await alive(c)
        # none: the certificate is refused, and the log names the problem
        caplog.set_level(logging.WARNING, "vacancyd.k8s.companion")
        async with companion(follower_toml(url), FakeKube()) as c:
            assert not await alive(c)
        refused = [r.getMessage() for r in caplog.records if "cannot be verified" in r.getMessage()]
        assert refused, [r.getMessage() for r in caplog.records]
        assert "unable to get local issuer certificate" in refused[0]
        assert "set ca_file" in refused[0]
        # the wrong one
        caplog.clear()
        async with companion(follower_toml(url, global_ca=wrong), FakeKube()) as c:
            assert not await alive(c)
        assert any(
            "checked against the companion's ca_file" in r.getMessage() for r in caplog.records
        )


async def test_the_companion_refuses_to_start_on_a_bad_ca_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    toml = follower_toml("https://127.0.0.1:9", lender_ca=junk)
    with pytest.raises(TlsError, match=r"lender pc ca_file: cannot load the CA bundle .*junk\.pem"):
        async with companion(toml, FakeKube()):
            pass
