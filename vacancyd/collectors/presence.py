"""Presence sources that need no OS backend.

``headless`` is a fixed logged-out reading on any platform: the host has no owner at a
desktop. With no presence source configured at all, no reading is ever recorded, so the gate
refuses host-scoped work with ``owner_active`` ("never sampled") — the safe reading.
"""

from __future__ import annotations

from vacancyd.state import PresenceReading

HEADLESS = PresenceReading(
    owner_signal=False, evidence_complete=True, detail="headless: no local sessions considered"
)


def sample_headless() -> PresenceReading:
    return HEADLESS
