"""Bearer authentication now lives in :mod:`vacancyd.web.auth` (the proxy uses it too);
these names stay importable from here."""

from vacancyd.web.auth import IMPLIED, Authenticator, Token, is_loopback_peer

__all__ = ["IMPLIED", "Authenticator", "Token", "is_loopback_peer"]
