"""TLS for the listeners: one server context shared by the API and every proxy listener.

``[server] tls_cert_file`` and ``tls_key_file`` (PEM) turn TLS on; ``tls_client_ca_file``
additionally requires every client to present a certificate signed by that CA (mutual TLS).
TLS 1.2 is the minimum. Renewed certificates are picked up by :func:`reload_context` (the
daemon calls it on SIGHUP): new connections get the new certificate, open ones keep theirs.

The client side (:func:`client_context`) is what the command-line tools and the Kubernetes
companion use to reach a lender over HTTPS: they verify its certificate and host name against
the system's CAs, or against a CA bundle they are given (``--ca-file`` / ``VACANCYD_CA_FILE``;
the companion's ``ca_file``) for a self-signed certificate or a private CA.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from vacancyd.config.files import read_regular_file


class TlsError(Exception):
    """A certificate, key or CA file could not be loaded; ``str()`` names the file."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM files of a listener's TLS identity."""

    cert: Path
    key: Path
    client_ca: Path | None = None


def _load_identity(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(
            f"cannot load the TLS certificate {files.cert} with key {files.key}: {exc}"
        ) from exc
    if files.client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=files.client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"cannot load the client CA {files.client_ca}: {exc}") from exc


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context for ``files``. Raises :class:`TlsError` naming the bad file."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if files.client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
    _load_identity(ctx, files)
    return ctx


def reload_context(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    """Load renewed files into the running ``ctx``, after checking them in a fresh context
    (so a broken renewal leaves the running identity in place). Raises :class:`TlsError`."""
    server_context(files)  # raises before the running context is touched
    _load_identity(ctx, files)


# -- the client side: the CLI and the companion following a lender over HTTPS ---------------

#: Names a CA bundle for the command-line tools (``--ca-file`` wins over it).
CA_FILE_ENV = "VACANCYD_CA_FILE"
#: The largest CA bundle read (bytes); the system's whole bundle is about 200 KiB.
MAX_CA_BUNDLE_BYTES = 4 * 1024 * 1024


def client_context(ca_file: Path | None) -> ssl.SSLContext:
    """A client context that verifies servers (certificate and host name), trusting
    ``ca_file`` (a PEM bundle: a private CA, or a self-signed certificate itself) in place
    of the system's CAs, or the system's CAs when None. Raises :class:`TlsError` naming the
    file when it cannot be read or holds no certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file is None:
        return ctx
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, checks host names; no system CAs
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # a regular file of bounded size: a FIFO or a device is an error, never a hang
        pem = read_regular_file(ca_file, MAX_CA_BUNDLE_BYTES).decode("ascii", "replace")
        ctx.load_verify_locations(cadata=pem)
    except ValueError as exc:
        raise TlsError(f"cannot load the CA bundle: {exc}") from exc
    except ssl.SSLError as exc:
        raise TlsError(f"cannot load the CA bundle {ca_file} (is it PEM?): {exc}") from exc
    if not ctx.cert_store_stats().get("x509"):
        raise TlsError(f"the CA bundle {ca_file} holds no certificate")
    return ctx


def verify_failure(exc: BaseException) -> str | None:
    """Why a server's certificate was refused (``self-signed certificate``, ``unable to get
    local issuer certificate``, a host-name mismatch...), when ``exc`` (or what it wraps:
    urllib's ``URLError.reason``, aiohttp's ``certificate_error``, a ``__cause__``) is a
    certificate verification failure; None otherwise."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            why = getattr(current, "verify_message", None) or getattr(current, "reason", None)
            return str(why or current)
        for attr in ("reason", "certificate_error", "os_error"):
            inner = getattr(current, attr, None)
            if isinstance(inner, BaseException):
                todo.append(inner)
        todo += [current.__cause__, current.__context__]
    return None
