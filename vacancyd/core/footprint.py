"""Learned footprint priors: what loading a model through vacancyd was seen to cost.

A configured footprint is the owner's measurement; it can be wrong, or missing for a model
a borrower asks for. So whenever a borrowed job may have loaded its model (no residency
credit applied), the daemon compares the primary resource's free memory at admission with
the first capacity sample after the job ended. If it dropped, the model (still resident, as
Ollama and ComfyUI keep it) took at least that much, and the drop becomes the model's prior.
The prior only grows (it is conservative: a drop that included someone else's allocation
makes it larger, never smaller), and the gate charges max(configured, prior) whenever a load
may happen. A residency credit replaces both. Pure: numbers in MiB, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: Drops smaller than this (MiB) are noise (the driver, a CUDA context) and teach nothing.
MIN_LEARNED_DROP_MIB = 64


def observed_drop(free_before_mib: float | None, free_after_mib: float | None) -> int | None:
    """The MiB a load took (rounded up), or None when it teaches nothing."""
    if free_before_mib is None or free_after_mib is None:
        return None
    drop = free_before_mib - free_after_mib
    if drop < MIN_LEARNED_DROP_MIB:
        return None
    return math.ceil(drop)


def learn_prior(priors: Mapping[str, int], model: str, drop_mib: int) -> dict[str, int] | None:
    """A copy of ``priors`` with ``model``'s prior raised to ``drop_mib``; None when the prior
    already covers it."""
    if priors.get(model, 0) >= drop_mib:
        return None
    out = dict(priors)
    out[model] = drop_mib
    return out


def charge_for(configured_mib: int, prior_mib: int | None) -> tuple[int, bool]:
    """(MiB to charge when a load may happen, whether the learned prior set it)."""
    if prior_mib is not None and prior_mib > configured_mib:
        return prior_mib, True
    return configured_mib, False
