"""A stand-in for ``systemctl`` that records every call and keeps unit state in files.

Run as ``python fake_systemctl.py ARGS...`` with ``FAKE_SYSTEMCTL_DIR`` naming its state
directory. It appends each argv as one JSON line to ``calls.jsonl`` and answers the verbs
install-service uses the way systemctl does: ``is-active`` prints ``active``/``inactive``
(exit 0/3), ``is-enabled`` prints ``enabled``/``disabled`` (exit 0/1); ``start``, ``stop``,
``restart``, ``enable``, ``disable`` and ``daemon-reload`` change that state.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    state = Path(os.environ["FAKE_SYSTEMCTL_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    with (state / "calls.jsonl").open("a") as f:
        f.write(json.dumps(argv) + "\n")
    verb = argv[0] if argv else ""
    active, enabled = state / "active", state / "enabled"
    if verb == "is-active":
        print("active" if active.exists() else "inactive")
        return 0 if active.exists() else 3
    if verb == "is-enabled":
        print("enabled" if enabled.exists() else "disabled")
        return 0 if enabled.exists() else 1
    if verb in ("start", "restart"):
        active.touch()
    elif verb == "stop":
        active.unlink(missing_ok=True)
    elif verb == "enable":
        enabled.touch()
    elif verb == "disable":
        enabled.unlink(missing_ok=True)
    elif verb != "daemon-reload":
        print(f"fake systemctl: unknown verb {verb!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
