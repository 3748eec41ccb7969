"""``vacancyd run``, ``vacancyd companion`` and ``vacancyd check-config``: running the
daemon or the in-cluster companion, and checking a config before it is used."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from vacancyd.cli.common import _configure_logging, _load, _say
from vacancyd.config import ConfigError, Settings, load_config


def cmd_run(args: argparse.Namespace) -> int:
    from vacancyd.runtime import eventloop
    from vacancyd.runtime.run import run_daemon

    if not _configure_logging(args):
        return 2
    choice = args.event_loop or os.environ.get(eventloop.ENV) or "auto"
    try:
        loop_name, _ = eventloop.loop_factory(choice)
    except eventloop.EventLoopError as exc:
        print(f"vacancyd: {exc}", file=sys.stderr)
        return 2
    try:
        settings = _load(args.config)
    except ConfigError as exc:
        _say(args, "ERROR", str(exc))
        return 2
    if args.config is None:
        _say(args, "WARNING", "no --config given; using the embedded default configuration")
    logging.getLogger("vacancyd.cli").info("event loop: %s", loop_name)
    return eventloop.run(run_daemon(settings, config_path=args.config), choice)


def cmd_companion(args: argparse.Namespace) -> int:
    """Run the in-cluster companion (vacancyd.k8s.companion) until SIGTERM."""
    from vacancyd.config.load import load_companion_config
    from vacancyd.k8s.companion import run_companion

    if not _configure_logging(args):
        return 2
    try:
        settings = load_companion_config(args.config)
    except ConfigError as exc:
        print(f"vacancyd companion: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(run_companion(settings))


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a config file and the secret files it names.

    When the only problems are secret files that do not exist yet, they are warnings (exit
    0) unless ``--strict``: a config can be checked before its tokens are put in place. Any
    other problem is an error (exit 1), and then every problem is listed, missing files too.
    Under the systemd unit (``$CREDENTIALS_DIRECTORY`` set) secret files are read from the
    service's credentials. ``--service`` runs the same check as the service will (its user,
    its credentials); ``--signal PID`` sends SIGHUP to PID after a successful check (the
    unit's ``ExecReload=``). A ``headless`` presence on a machine with a local graphical
    session is warned about.
    """
    if args.service:
        return _check_config_as_service(args)
    from vacancyd.config.secrets import (
        credentials_directory,
        missing_secret_files,
        read_secrets,
        without_missing_files,
    )

    credentials = credentials_directory()
    # systemd shows a unit's credentials to its main process only; under ExecReload= the
    # directory is named but hidden. The daemon re-checks its secrets itself on SIGHUP.
    hidden = credentials is not None and not os.access(credentials, os.R_OK | os.X_OK)
    missing: list[tuple[str, Path]] = []
    try:
        settings = load_config(args.file)
        try:
            if hidden:
                print(
                    f"{args.file}: secret files not checked here: this process cannot see the "
                    f"service's credentials ({credentials}); the daemon checks them on SIGHUP",
                    file=sys.stderr,
                )
            else:
                read_secrets(settings, str(args.file), credentials)
        except ConfigError as everything:
            missing = missing_secret_files(settings, credentials)
            if args.strict or not missing:
                raise
            try:
                read_secrets(
                    without_missing_files(settings, credentials), str(args.file), credentials
                )
            except ConfigError:
                raise everything from None
        _check_tls_files(settings, str(args.file))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    for where, path in missing:
        print(
            f"{args.file}: warning: {where}: {path} does not exist yet; create it before "
            "`vacancyd run` (which refuses to start without it)",
            file=sys.stderr,
        )
    from vacancyd.config.advice import config_warnings

    for advice in config_warnings(settings):
        print(f"{args.file}: warning: {advice}", file=sys.stderr)
    headless = _headless_warning(settings)
    if headless:
        print(f"{args.file}: warning: {headless}", file=sys.stderr)
    print(
        f"{args.file}: OK ({len(settings.resource)} resource(s), "
        f"{len(settings.upstream)} upstream(s); API on {settings.server.listen})"
        + (f"; {len(missing)} secret file(s) still to create" if missing else "")
    )
    if args.signal is not None:
        import signal

        try:
            os.kill(args.signal, signal.SIGHUP)
        except OSError as exc:
            print(f"vacancyd check-config: cannot signal {args.signal}: {exc}", file=sys.stderr)
            return 1
        print(f"sent SIGHUP to {args.signal}")
    return 0


def _check_tls_files(settings: Settings, source: str) -> None:
    """Load the API's TLS certificate and key as the daemon will; raises ConfigError."""
    server = settings.server
    if server.tls_cert_file is None or server.tls_key_file is None:
        return
    from vacancyd.web.tls import TlsError, TlsFiles, server_context

    try:
        server_context(
            TlsFiles(server.tls_cert_file, server.tls_key_file, server.tls_client_ca_file)
        )
    except TlsError as exc:
        raise ConfigError(source, [f"server.tls_cert_file / tls_key_file: {exc}"]) from exc


def _headless_warning(settings: Settings) -> str | None:
    """The warning for ``presence = "headless"`` where logind lists a local graphical
    session; None when there is none or logind cannot be asked."""
    if settings.owner.presence != "headless":
        return None
    from vacancyd.collectors.logind import LogindError, local_sessions
    from vacancyd.core.presence import headless_warning

    try:
        sessions = asyncio.run(local_sessions(settings.owner.bus_address))
    except LogindError:
        return None
    return headless_warning(sessions)


def _check_config_as_service(args: argparse.Namespace) -> int:
    from vacancyd.runtime.service import SERVICE_USER, ServiceError, check_as_service

    if os.geteuid() != 0:
        print("vacancyd check-config --service: needs root (run it with sudo)", file=sys.stderr)
        return 1
    if not args.file.is_absolute():
        args.file = args.file.absolute()
    try:
        done = check_as_service(args.file, strict=args.strict)
    except ServiceError as exc:
        print(f"vacancyd check-config --service: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode == 0:
        print(f"(checked as the service: user {SERVICE_USER}, secret files as credentials)")
    return done.returncode
