"""TLS for the listeners: one server context shared by the API and every proxy listener.

``[server] tls_cert_file`` and ``tls_key_file`` (PEM) turn TLS on; ``tls_client_ca_file``
additionally requires every client to present a certificate signed by that CA (mutual TLS).
TLS 1.2 is the minimum. Renewed certificates are picked up by :func:`reload_context` (the
daemon calls it on SIGHUP): new connections get the new certificate, open ones keep theirs.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


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
