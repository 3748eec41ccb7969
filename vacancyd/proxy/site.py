"""The listener site now lives in :mod:`vacancyd.web.site` (the API listener and the
authenticator use it too); these names stay importable from here."""

from vacancyd.web.site import (
    CappedTCPSite,
    ConnectionGuard,
    ConnectionLimits,
    GuardedTCPSite,
    Probe,
    mark_authenticated,
)

__all__ = [
    "CappedTCPSite",
    "ConnectionGuard",
    "ConnectionLimits",
    "GuardedTCPSite",
    "Probe",
    "mark_authenticated",
]
