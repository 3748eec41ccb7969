"""The argparse tree of the ``vacancyd`` command: one small function per subcommand, each
adding its parser and pointing it at the ``cmd_*`` function that runs it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from vacancyd import __version__
from vacancyd.cli.common import DEFAULT_URL
from vacancyd.cli.daemon import cmd_check_config, cmd_companion, cmd_run
from vacancyd.cli.footprints import cmd_measure, cmd_profiles
from vacancyd.cli.install import cmd_init, cmd_install_service, cmd_remove_service
from vacancyd.cli.k8s import cmd_k8s
from vacancyd.cli.owner import cmd_open, cmd_pause, cmd_resume, cmd_status
from vacancyd.cli.usage import add_usage

if TYPE_CHECKING:
    #: What ``add_subparsers`` returns; each ``_add_*`` function adds its subcommand to it.
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _add_api_args(p: argparse.ArgumentParser, scope: str) -> None:
    p.add_argument("--url", help=f"API base URL (default: from --config, else {DEFAULT_URL})")
    p.add_argument(
        "--token",
        help=f"bearer token with the {scope} scope (visible to other users in ps: prefer "
        "--token-file or the VACANCYD_TOKEN environment variable)",
    )
    p.add_argument("--token-file", type=Path, help=f"file holding the {scope}-scope token")
    p.add_argument(
        "--config",
        type=Path,
        help="take the API address and a token with the needed scope from this config "
        "(default: /etc/vacancyd/vacancyd.toml when it exists and --url is not given)",
    )
    p.add_argument(
        "--ca-file",
        type=Path,
        help="PEM CA bundle to trust for an https:// API (a self-signed certificate or a "
        "private CA; default: $VACANCYD_CA_FILE, else the system's CAs)",
    )


def _ascii_int(text: str) -> int:
    """An argparse type: a whole number in ASCII digits (``int()`` takes any script's)."""
    from vacancyd.core.numbers import parse_int

    try:
        return parse_int(text, "value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ascii_decimal(text: str) -> float:
    """An argparse type: a decimal in ASCII digits, no sign, exponent, nan or inf."""
    from vacancyd.core.numbers import parse_decimal

    try:
        return parse_decimal(text, "value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds(text: str) -> float:
    from vacancyd.core.numbers import parse_decimal

    try:
        value = parse_decimal(text, "seconds")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0 and at most 86400")
    return value


def _add_run(sub: Subparsers) -> None:
    """``vacancyd run``: the daemon."""
    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", type=Path, help="TOML config (default: the embedded default)")
    run.add_argument("--log-level", default="info", help="debug, info, warning, error")
    run.add_argument("--log-format", default="plain", choices=["plain", "json"])
    run.add_argument(
        "--event-loop",
        choices=["auto", "asyncio", "uvloop"],
        help="asyncio event loop (default: $VACANCYD_EVENT_LOOP, else auto: uvloop when installed)",
    )
    run.set_defaults(func=cmd_run)


def _add_companion(sub: Subparsers) -> None:
    """``vacancyd companion``: the in-cluster companion."""
    companion = sub.add_parser(
        "companion",
        help="follow lenders over HTTP and publish them to Kubernetes (runs in the cluster)",
    )
    companion.add_argument("--config", type=Path, required=True, help="companion TOML file")
    companion.add_argument("--log-level", default="info", help="debug, info, warning, error")
    companion.add_argument("--log-format", default="plain", choices=["plain", "json"])
    companion.set_defaults(func=cmd_companion)


def _add_k8s(sub: Subparsers) -> None:
    """``vacancyd k8s mark-stale | cleanup``."""
    k8s = sub.add_parser(
        "k8s", help="upkeep of what vacancyd published to Kubernetes (stale conditions, cleanup)"
    )
    k8s_sub = k8s.add_subparsers(dest="action", required=True)

    def _cluster_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--kubeconfig",
            type=Path,
            help="kubeconfig (default: in-cluster in a Pod, else $KUBECONFIG or ~/.kube/config)",
        )
        p.add_argument("--context", help="kubeconfig context (default: its current one)")
        p.add_argument("--log-level", default="info", help="debug, info, warning, error")
        p.add_argument("--log-format", default="plain", choices=["plain", "json"])
        p.set_defaults(func=cmd_k8s)

    stale = k8s_sub.add_parser(
        "mark-stale",
        help="mark Vacancy* Node conditions Unknown (PublisherStale) when no heartbeat came",
    )
    stale.add_argument(
        "--node", action="append", required=True, help="a Node to check (repeat for more)"
    )
    stale.add_argument(
        "--stale-after-s",
        type=_positive_seconds,
        default=180.0,
        help="seconds without a heartbeat after which a condition is stale (default 180: "
        "three of the publishers' default 60 s heartbeats)",
    )
    stale.add_argument(
        "--every", type=_positive_seconds, help="repeat every this many seconds until SIGTERM"
    )
    _cluster_args(stale)

    clean = k8s_sub.add_parser(
        "cleanup",
        help="delete vacancyd's EndpointSlices and remove its Vacancy* Node conditions",
    )
    clean.add_argument("--namespace", required=True, help="namespace of the EndpointSlices")
    clean.add_argument(
        "--node", action="append", default=[], help="a Node to clean (repeat for more)"
    )
    clean.add_argument(
        "--lender",
        action="append",
        default=[],
        help="only this lender's EndpointSlices (repeat for more; default: every lender's)",
    )
    clean.add_argument(
        "--stand-down-s",
        type=_ascii_decimal,
        default=5.0,
        help="first tell running publishers to stop writing and wait this long (default 5: "
        "they look every 2 s); 0: remove at once",
    )
    _cluster_args(clean)


def _add_check_config(sub: Subparsers) -> None:
    """``vacancyd check-config FILE``."""
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("file", type=Path)
    check.add_argument(
        "--strict",
        action="store_true",
        help="a token or credential file that is missing is an error",
    )
    check.add_argument(
        "--service",
        action="store_true",
        help="check it as the systemd service will see it: as its user, with the secret "
        "files passed as credentials (needs root)",
    )
    check.add_argument(
        "--signal",
        type=_ascii_int,
        metavar="PID",
        help="after a successful check, send SIGHUP to PID (the unit's ExecReload)",
    )
    check.set_defaults(func=cmd_check_config)


def _add_services(sub: Subparsers) -> None:
    """``vacancyd install-service`` and ``vacancyd remove-service``."""
    for verb, helptext, func in (
        (
            "install-service",
            "install, enable and start the systemd unit (converges)",
            cmd_install_service,
        ),
        (
            "remove-service",
            "stop, disable and remove the systemd unit (keeps the config)",
            cmd_remove_service,
        ),
    ):
        svc = sub.add_parser(verb, help=helptext)
        svc.add_argument(
            "--config",
            type=Path,
            default=Path("/etc/vacancyd/vacancyd.toml"),
            help="config file the service runs with (default /etc/vacancyd/vacancyd.toml; "
            "`vacancyd init` writes it)",
        )
        svc.add_argument(
            "--root",
            type=Path,
            default=Path("/"),
            help="install below this directory instead of / (images): files only, never "
            "systemctl; no root needed",
        )
        if verb == "install-service":
            svc.add_argument(
                "--no-start", action="store_true", help="on a first install, do not start it"
            )
        svc.set_defaults(func=func)


def _add_status(sub: Subparsers) -> None:
    """``vacancyd status``."""
    status = sub.add_parser("status", help="show a running daemon's state")
    _add_api_args(status, "read")
    status.add_argument("--json", action="store_true", help="print the raw /status JSON")
    status.set_defaults(func=cmd_status)


def _add_pause(sub: Subparsers) -> None:
    """``vacancyd pause``."""
    pause = sub.add_parser(
        "pause",
        help="pause lending (until resumed, until a time, for a while, or until you are next "
        "away); borrowed work is handed back as when you return",
    )
    how = pause.add_mutually_exclusive_group()
    how.add_argument("--until", help="HH:MM (next occurrence) or an ISO 8601 date and time")
    how.add_argument("--for", dest="for_", metavar="DURATION", help="e.g. 45m, 2h, 1h30m, 1d")
    how.add_argument(
        "--until-idle", action="store_true", help="until you have next left this machine"
    )
    pause.add_argument("--reason", help="a note shown in /status")
    _add_api_args(pause, "admin")
    pause.set_defaults(func=cmd_pause)


def _add_open(sub: Subparsers) -> None:
    """``vacancyd open``."""
    opener = sub.add_parser(
        "open",
        help="open the status page in your browser, logged in by a single-use link",
    )
    _add_api_args(opener, "read")
    opener.add_argument(
        "--print", action="store_true", help="print the link instead of opening a browser"
    )
    opener.set_defaults(func=cmd_open)


def _add_init(sub: Subparsers) -> None:
    """``vacancyd init``."""
    init = sub.add_parser(
        "init",
        help="find the local inference servers and GPUs and write a starting config",
    )
    init.add_argument(
        "--config",
        type=Path,
        default=Path("/etc/vacancyd/vacancyd.toml"),
        help="where to write it (default /etc/vacancyd/vacancyd.toml; tokens go in tokens/ "
        "beside it)",
    )
    init.add_argument("--force", action="store_true", help="replace an existing config")
    init.add_argument(
        "--print", action="store_true", help="write the config to stdout; create nothing"
    )
    init.add_argument(
        "--server",
        action="append",
        metavar="HOST:PORT",
        help="probe this address (repeatable; default: the usual local ports of Ollama, "
        "llama-server, ComfyUI, vLLM and LM Studio)",
    )
    init.add_argument(
        "--probe-timeout",
        type=_ascii_decimal,
        default=2.0,
        help="seconds per probe request (default 2)",
    )
    init.add_argument(
        "--state-dir", type=Path, default=Path("/var/lib/vacancyd"), help="state_dir to write"
    )
    init.add_argument("--no-gpus", action="store_true", help="do not look for GPUs")
    init.set_defaults(func=cmd_init)


def _add_resume(sub: Subparsers) -> None:
    """``vacancyd resume``."""
    resume = sub.add_parser("resume", help="end a pause")
    _add_api_args(resume, "admin")
    resume.set_defaults(func=cmd_resume)


def _add_measure(sub: Subparsers) -> None:
    """``vacancyd measure``."""
    measure = sub.add_parser(
        "measure",
        help="load each configured model once, read what it takes, print the footprint table",
    )
    _add_api_args(measure, "read")
    measure.add_argument("--upstream", action="append", help="only this upstream (repeatable)")
    measure.add_argument("--model", action="append", help="only this model (repeatable)")
    measure.add_argument(
        "--num-ctx", type=_ascii_int, default=4096, help="context to load Ollama models with (4096)"
    )
    measure.add_argument(
        "--headroom-mib", type=_ascii_int, default=500, help="MiB added to each footprint (500)"
    )
    measure.add_argument("--output", type=Path, help="write the TOML here instead of stdout")
    measure.add_argument("--profile", type=Path, help="also write a JSON footprint profile")
    measure.set_defaults(func=cmd_measure)


def _add_profiles(sub: Subparsers) -> None:
    """``vacancyd profiles export | import``."""
    prof = sub.add_parser("profiles", help="export or import footprint profiles (JSON)")
    prof_sub = prof.add_subparsers(dest="action", required=True)
    export = prof_sub.add_parser("export", help="the configured footprints, with digests")
    imp = prof_sub.add_parser("import", help="footprints from a profile, as config TOML")
    imp.add_argument("file", type=Path)
    for p in (export, imp):
        p.add_argument("--config", type=Path, help="the lender's config")
        p.add_argument("--upstream", action="append", help="only this upstream (repeatable)")
        p.add_argument("--output", type=Path, help="write here instead of stdout")
        p.set_defaults(func=cmd_profiles)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``vacancyd`` argument parser; each subcommand's namespace carries ``func``."""
    parser = argparse.ArgumentParser(
        prog="vacancyd", description="Lend an idle GPU without costing its owner."
    )
    parser.add_argument("--version", action="version", version=f"vacancyd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_run,
        _add_companion,
        _add_k8s,
        _add_check_config,
        _add_services,
        _add_status,
        add_usage,
        _add_pause,
        _add_open,
        _add_init,
        _add_resume,
        _add_measure,
        _add_profiles,
    ):
        add(sub)
    return parser
