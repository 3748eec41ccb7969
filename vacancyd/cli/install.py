"""Setting up this machine: ``vacancyd init`` (a starting config) and ``vacancyd
install-service | remove-service`` (the systemd unit)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def cmd_init(args: argparse.Namespace) -> int:
    from vacancyd.runtime.init import DEFAULT_CANDIDATES, InitError, run_init

    candidates = list(args.server or DEFAULT_CANDIDATES)
    for address in candidates:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            print(f"vacancyd init: --server {address!r} is not HOST:PORT", file=sys.stderr)
            return 2
    if not 0 < args.probe_timeout <= 60:
        print("vacancyd init: --probe-timeout must be between 0 and 60 s", file=sys.stderr)
        return 2
    try:
        text, report = run_init(
            args.config,
            candidates=candidates,
            timeout_s=args.probe_timeout,
            state_dir=args.state_dir,
            force=args.force,
            to_stdout=args.print,
            gpus=not args.no_gpus,
        )
    except InitError as exc:
        print(f"vacancyd init: {exc}", file=sys.stderr)
        return 1
    for line in report:
        print(f"vacancyd init: {line}", file=sys.stderr)
    if args.print:
        print(text)
    return 0


def _service(args: argparse.Namespace) -> Any:
    from vacancyd.runtime.service import Service

    # Below another root (an image being built) nothing may act on this host's systemd.
    return Service(root=args.root, config=args.config, manage=args.root.resolve() == Path("/"))


def cmd_install_service(args: argparse.Namespace) -> int:
    from vacancyd.runtime.service import ServiceError, command_warning

    if args.root == Path("/") and os.geteuid() != 0:
        print("vacancyd install-service: needs root (run it with sudo)", file=sys.stderr)
        return 1
    service = _service(args)
    warning = command_warning(service.command)
    if warning:
        print(f"vacancyd install-service: warning: {warning}", file=sys.stderr)
    try:
        service.install(start=not args.no_start)
    except ServiceError as exc:
        print(f"vacancyd install-service: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_remove_service(args: argparse.Namespace) -> int:
    from vacancyd.runtime.service import ServiceError

    if args.root == Path("/") and os.geteuid() != 0:
        print("vacancyd remove-service: needs root (run it with sudo)", file=sys.stderr)
        return 1
    try:
        _service(args).remove()
    except ServiceError as exc:
        print(f"vacancyd remove-service: {exc}", file=sys.stderr)
        return 1
    return 0
