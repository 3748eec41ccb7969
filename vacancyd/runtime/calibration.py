"""The calibration cache: each GPU's learned pressure threshold, kept across restarts.

One JSON file per GPU resource, ``STATE_DIR/calibration/RESOURCE.json``, written atomically
by :mod:`vacancyd.runtime.durable` (like every durable state file) so a crash mid-write
leaves the previous calibration intact. A file that cannot be read or
parsed is logged and ignored: the GPU calibrates again from nothing rather than trust it.
The file names its GPU by UUID; :meth:`vacancyd.core.pressure.ThresholdLearner.load_cache`
ignores a cache written for another card. See docs/calibration.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vacancyd.runtime import durable

log = logging.getLogger(__name__)


def cache_path(state_dir: Path, resource: str) -> Path:
    return state_dir / "calibration" / f"{resource}.json"


def load_calibrations(state_dir: Path, resources: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Read every resource's saved calibration that exists and parses; never raises.

    A file that cannot be used is logged and skipped: that GPU calibrates again from nothing
    and refuses borrowed work until it is calibrated, so nothing is lent on a guess. A file
    in another format version is passed on and rejected by the learner with its reason.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in resources:
        path = cache_path(state_dir, name)
        try:
            data = durable.read_json(path)  # bounded: never blocks startup on a huge file
        except durable.StateFileError as exc:
            log.warning("resource %s: calibration cache ignored: %s", name, exc)
            continue
        if data is None:
            continue
        if not isinstance(data, dict):
            log.warning("resource %s: calibration cache %s is not an object; ignored", name, path)
            continue
        out[name] = data
    return out


def save_calibration(state_dir: Path, resource: str, data: Mapping[str, Any]) -> None:
    """Write one resource's calibration atomically. Raises OSError when it cannot."""
    durable.write_state(cache_path(state_dir, resource), data)
