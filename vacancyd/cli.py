"""Command line: ``vacancyd run | check-config | status | open | pause | resume | measure |
profiles export|import | init | companion | k8s mark-stale|cleanup | install-service |
remove-service | --version``."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vacancyd import __version__
from vacancyd.config import ConfigError, Settings, load_config, load_default_config
from vacancyd.core.status import (
    OwnerControlsStatus,
    ResourceStatus,
    StatusDocument,
    UpstreamStatus,
)

DEFAULT_URL = "http://127.0.0.1:9470"  # vacancyd.runtime.apitarget.DEFAULT_URL


def _load(path: Path | None) -> Settings:
    return load_default_config() if path is None else load_config(path)


def _configure_logging(args: argparse.Namespace) -> bool:
    """Set up logging from --log-level/--log-format; False (after saying why) when invalid."""
    from vacancyd.runtime import logging as vlogging

    try:
        vlogging.configure(args.log_level, args.log_format)
    except ValueError as exc:
        print(f"vacancyd: {exc}", file=sys.stderr)
        return False
    return True


def _say(args: argparse.Namespace, level: str, message: str) -> None:
    """One line on stderr in the chosen log format (JSON lines stay JSON)."""
    if args.log_format == "json":
        line = json.dumps({"level": level, "name": "vacancyd", "message": message})
    else:
        line = f"vacancyd: {message}"
    print(line, file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from vacancyd.runtime import eventloop
    from vacancyd.runtime.daemon import run_daemon

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
    logging.getLogger(__name__).info("event loop: %s", loop_name)
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


def cmd_k8s(args: argparse.Namespace) -> int:
    """``vacancyd k8s mark-stale`` and ``vacancyd k8s cleanup`` (vacancyd.k8s.maintenance).

    Prints one JSON line per pass ({"action", "changed", "unchanged", "errors"}). Exit 0
    when every object was handled, 1 when some failed, 2 when no API server could be used.
    ``mark-stale --every S`` repeats the pass every S seconds until SIGTERM (exit 0).
    """
    if not _configure_logging(args):
        return 2
    return asyncio.run(_k8s(args))


async def _k8s(args: argparse.Namespace) -> int:
    import signal

    from vacancyd.k8s import maintenance
    from vacancyd.k8s.api import K8sApiError
    from vacancyd.k8s.client import KubeClient

    try:
        api = await KubeClient.connect(args.kubeconfig, args.context)
    except K8sApiError as exc:
        _say(args, "ERROR", f"k8s {args.action}: {exc}")
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        while True:
            try:
                if args.action == "cleanup":
                    outcome = await maintenance.cleanup(
                        api,
                        args.namespace,
                        args.node,
                        lenders=args.lender,
                        stand_down_s=args.stand_down_s,
                    )
                else:
                    outcome = await maintenance.mark_stale(api, args.node, args.stale_after_s)
            except K8sApiError as exc:
                _say(args, "ERROR", f"k8s {args.action}: {exc} ({exc.hint})")
                if getattr(args, "every", None) is None:
                    return 2
            else:
                print(json.dumps(maintenance.summary(args.action, outcome)), flush=True)
                for error in outcome.errors:
                    _say(args, "ERROR", f"k8s {args.action}: {error}")
                if getattr(args, "every", None) is None:
                    return 0 if outcome.ok else 1
            try:
                async with asyncio.timeout(args.every):
                    await stop.wait()
                return 0
            except TimeoutError:
                pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await api.close()


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


def _opener(tls: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    # The daemon is a local service: never route this through an HTTP proxy.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if tls is not None:
        handlers.append(urllib.request.HTTPSHandler(context=tls))
    return urllib.request.build_opener(*handlers)


def _client_tls(args: argparse.Namespace, what: str) -> ssl.SSLContext | int | None:
    """The TLS context for talking to the API: trusting ``--ca-file`` (else
    ``$VACANCYD_CA_FILE``) when given, else the system's CAs (None). An exit code (2) after
    saying what was wrong when the bundle cannot be used."""
    from vacancyd.web.tls import CA_FILE_ENV, TlsError, client_context

    ca_file = getattr(args, "ca_file", None) or os.environ.get(CA_FILE_ENV) or None
    if ca_file is None:
        return None
    source = "--ca-file" if getattr(args, "ca_file", None) else f"${CA_FILE_ENV}"
    try:
        return client_context(Path(ca_file))
    except TlsError as exc:
        print(f"vacancyd {what}: {source}: {exc}", file=sys.stderr)
        return 2


def _unreachable(what: str, url: str, exc: BaseException, failed: str = "cannot reach") -> str:
    """The message for a failed call: a refused certificate says which problem it has and
    how to trust a private CA."""
    from vacancyd.web.tls import CA_FILE_ENV, verify_failure

    why = verify_failure(exc)
    if why is not None:
        return (
            f"vacancyd {what}: cannot verify the TLS certificate of {url}: {why}; if the "
            f"daemon's certificate is self-signed or from a private CA, pass --ca-file (or "
            f"set {CA_FILE_ENV}) with that certificate or CA"
        )
    return f"vacancyd {what}: {failed} {url}: {exc}"


def _fetch_status(
    url: str, token: str | None, timeout_s: float = 5.0, tls: ssl.SSLContext | None = None
) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/status")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with _opener(tls).open(request, timeout=timeout_s) as resp:
        data = json.load(resp)
    if not isinstance(data, dict) or not {"version", "resources", "upstreams"} <= data.keys():
        raise ValueError("the answer is not a vacancyd /status document (is this vacancyd's API?)")
    return data


def _yes(flag: object) -> str:
    return "yes" if flag else "no"


def format_sessions(
    sessions: Sequence[Mapping[str, Any]], exempt_upstreams: Sequence[str] = ()
) -> list[str]:
    """Lines for the sessions presence saw (see vacancyd.core.presence for the fields) and
    the upstreams exempt from owner presence."""
    lines = []
    for s in sessions:
        if s.get("kind") == "unknown":
            lines.append(f"  session {s.get('id')} [unknown]: {s.get('why')}")
            continue
        state = ", ".join(
            word
            for word, on in (
                ("remote" if s.get("remote") else "local", True),
                ("locked" if s.get("locked") else "unlocked", True),
                ("active", s.get("active")),
                (
                    f"idle {s['idle_for_s']:.0f}s" if s.get("idle_for_s") is not None else "idle",
                    s.get("idle"),
                ),
            )
            if on
        )
        lines.append(
            f"  session {s.get('id')} [{s.get('kind')} {s.get('type') or '-'}] {state}: "
            f"{'OWNER' if s.get('owner') else 'not the owner'} ({s.get('why')})"
        )
    if exempt_upstreams:
        lines.append(f"  exempt from owner presence: {', '.join(exempt_upstreams)}")
    return lines


def format_owner_controls(oc: OwnerControlsStatus | None) -> list[str]:
    """Lines for the owner's controls (see vacancyd.control.owner for the fields)."""
    if oc is None:
        return []
    lines = [f"HELD ({hold.kind}): {hold.detail}" for hold in oc.holds]
    sched: Any = oc.controls.get("schedule")
    if sched:
        change = sched.get("next_change_local")
        lines.append(
            f"schedule ({sched.get('timezone')}): {'open' if sched.get('open') else 'closed'}"
            + (f", {'closes' if sched.get('open') else 'opens'} at {change}" if change else "")
        )
    if oc.controls.get("pause_persist_error"):
        lines.append(f"  pause not saved: {oc.controls['pause_persist_error']}")
    return lines


def format_status(doc: StatusDocument) -> str:
    """Render a status document for a person (``StatusDocument.from_json`` reads one from
    ``/status``)."""
    lines = [
        f"vacancyd {doc.version}, up {doc.uptime_s or 0:.0f} s, "
        f"{'ready' if doc.ready else 'NOT READY: ' + '; '.join(doc.not_ready)}",
        f"lending: {'on' if doc.lending_enabled else 'OFF'}",
    ]
    lines.extend(format_owner_controls(doc.owner_controls))
    p = doc.presence
    lines.append(
        f"presence: source={p.source} sampled={_yes(p.sampled)} "
        f"age={'-' if p.age_s is None else f'{p.age_s:.1f}s'} "
        f"evidence_complete={_yes(p.evidence_complete)} "
        f"veto={'ACTIVE' if p.veto.active else 'released'}"
        + (f" (releases in {p.veto.release_in_s:.0f}s)" if p.veto.release_in_s else "")
    )
    if p.detail:
        lines.append(f"  {p.detail}")
    lines.extend(format_sessions(p.sessions, p.exempt_upstreams))
    lines.append("resources:")
    for name, r in doc.resources.items():
        lines.extend(_format_resource(name, r))
    lines.append("upstreams:")
    for name, u in doc.upstreams.items():
        lines.extend(_format_upstream(name, u))
    if doc.pools:
        lines.append("pools:")
    for name, pool in doc.pools.items():
        ls = pool.listener
        lines.append(
            f"  {name} on {'?' if ls is None else ls.address} "
            f"{'bound' if ls is not None and ls.bound else 'NOT BOUND'} -> "
            f"{', '.join(pool.members)}: "
            f"{'lendable' if pool.lendable else 'no member lendable'}"
        )
    return "\n".join(lines)


def _format_resource(name: str, r: ResourceStatus) -> list[str]:
    cap = ""
    if r.free_mib is not None:
        cap = f" free={r.free_mib:.0f}/{r.total_mib or 0:.0f} MiB"
    if r.utilization_ratio is not None:
        cap += f" util={r.utilization_ratio:.0%}"
    state = "lendable" if r.lendable else f"not lendable ({r.why_not})"
    lines = [
        f"  {name} [{r.kind}] {'on' if r.enabled else 'OFF'} "
        f"{r.quality.value}{'' if r.age_s is None else f' {r.age_s:.1f}s old'}{cap}: {state}"
    ]
    if r.error:
        lines.append(f"    error: {r.error}")
    pr = r.pressure
    if pr is not None:
        thr, load = pr.threshold_ratio, pr.owner_load_ratio
        lines.append(
            f"    GPU pressure: {pr.quality.value} "
            f"{'ENGAGED' if pr.engaged else 'clear'} "
            f"owner={'-' if load is None else f'{load:.0%}'} "
            f"threshold={'-' if thr is None else f'{thr:.0%}'} "
            + (
                "calibrated"
                if pr.calibrated
                else f"calibrating ({pr.calibration_observed_s or 0:.0f}"
                f"/{pr.calibration_needed_s or 0:.0f} s)"
            )
            + (f": {pr.detail}" if pr.detail else "")
        )
    if r.held_by is not None:
        h = r.held_by
        lines.append(f"    held by job {h.job} ({h.upstream}, {h.phase})")
    return lines


def _format_upstream(name: str, u: UpstreamStatus) -> list[str]:
    ls = u.listener
    verdict = (
        "lendable"
        if u.lendable
        else (f"refusing {u.refusal.reason} ({u.refusal.detail})" if u.refusal else "?")
    )
    lines = [
        f"  {name} [{u.adapter}] on {'?' if ls is None else ls.address} "
        f"{'bound' if ls is not None and ls.bound else 'NOT BOUND'} -> resource {u.resource}"
        f"{' + ' + ', '.join(u.also_requires) if u.also_requires else ''}: {verdict}"
    ]
    if ls is not None and ls.state == "listens_on_network":
        lines.append(f"    WARNING: its server can be reached without the gate: {ls.state_detail}")
    server = u.server
    if server is not None:
        lines.append(
            f"    server: {server.quality.value} idle={_yes(server.idle)}"
            + (f" error: {server.error}" if server.error else "")
        )
    work = u.active_work
    sharing = u.sharing
    slots = ""
    if sharing is not None:
        slots = f" of {sharing.max_concurrent} slot(s), {sharing.waiting} waiting"
        if sharing.exclusive_of or sharing.excluded_by:
            slots += f", card {sharing.card}"
    lines.append(
        f"    active work: {len(work)}{slots}"
        + "".join(f"\n      job {w.job} {w.phase} model={w.model} {w.age_s:.0f}s" for w in work)
    )
    rec = u.reclaim
    if rec is not None:
        lines.append(
            f"    reclaim: {rec.phase} ({rec.trigger}, policy "
            f"{rec.policy}, {len(rec.edge_triggers)} edge(s)"
            + (f", outcome {rec.outcome}" if rec.outcome else "")
            + ")"
        )
    if u.unseen_gpu_work:
        lines.append(f"    unseen GPU work: {u.unseen_gpu_work}")
    return lines


def _target(args: argparse.Namespace, scope: str, what: str) -> Any:
    """The API and token for ``vacancyd WHAT`` (vacancyd.runtime.apitarget), or an exit code
    (2) after saying what was wrong."""
    from vacancyd.runtime.apitarget import TargetError, resolve

    try:
        return resolve(
            scope=scope,
            command=what,
            url=args.url,
            token=args.token,
            token_file=args.token_file,
            config=args.config,
        )
    except TargetError as exc:
        print(f"vacancyd {what}: {exc}", file=sys.stderr)
        return 2


def _http_refusal(what: str, url: str, exc: urllib.error.HTTPError, target: Any, scope: str) -> str:
    """One line for an HTTP error answer; a 401/403 says which token was sent and what to do."""
    from vacancyd.runtime.apitarget import unauthorized_hint

    detail = exc.read().decode("utf-8", "replace")[:500]
    try:
        detail = json.loads(detail)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    line = f"vacancyd {what}: {url} answered {exc.code}: {detail}"
    if exc.code in (401, 403):
        line += f"; {unauthorized_hint(target, scope, what)}"
    return line


def cmd_status(args: argparse.Namespace) -> int:
    target = _target(args, "read", "status")
    if isinstance(target, int):
        return target
    url = target.url
    tls = _client_tls(args, "status")
    if isinstance(tls, int):
        return tls
    try:
        raw = _fetch_status(url, target.token, tls=tls)
        # Read into the typed document: a wrong value is named by its path.
        doc = StatusDocument.from_json(raw)
    except urllib.error.HTTPError as exc:
        print(_http_refusal("status", url, exc, target, "read"), file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        print(
            _unreachable("status", f"{url}/status", exc, "cannot read"),
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(raw, indent=2))
    else:
        print(format_status(doc))
    return 0


def _invoking_user() -> tuple[int, int] | None:
    """(uid, gid) of the user who ran ``sudo``, when this runs as root under sudo."""
    if os.geteuid() != 0:
        return None
    try:
        return int(os.environ["SUDO_UID"]), int(os.environ["SUDO_GID"])
    except (KeyError, ValueError):
        return None


def _launch_browser(url: str, user: tuple[int, int] | None) -> bool:
    """Hand ``url`` to the desktop's browser, as ``user`` when given (never a browser
    running as root); False when none could be started."""
    import shutil
    import subprocess
    import webbrowser

    if user is None:
        return webbrowser.open(url)
    opener = shutil.which("xdg-open")
    if opener is None:
        return False
    uid, gid = user
    runtime = f"/run/user/{uid}"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "XDG_RUNTIME_DIR": runtime,
        "DBUS_SESSION_BUS_ADDRESS": f"unix:path={runtime}/bus",
    }
    for key in ("DISPLAY", "WAYLAND_DISPLAY", "XAUTHORITY", "LANG"):
        if key in os.environ:
            env[key] = os.environ[key]
    try:
        subprocess.Popen(
            [opener, url],
            user=uid,
            group=gid,
            extra_groups=[],
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        return False
    return True


def cmd_open(args: argparse.Namespace) -> int:
    """Open the status page in the browser, logged in by a single-use link (no secret to
    paste; vacancyd.web.logins)."""
    target = _target(args, "read", "open")
    if isinstance(target, int):
        return target
    tls = _client_tls(args, "open")
    if isinstance(tls, int):
        return tls
    user = _invoking_user()
    body: dict[str, Any] = {} if user is None else {"for_uid": user[0]}
    try:
        answer = _post(target.url + "/login/ticket", target.token, body, tls=tls)
    except urllib.error.HTTPError as exc:
        print(_http_refusal("open", target.url, exc, target, "read"), file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        print(_unreachable("open", target.url + "/login/ticket", exc), file=sys.stderr)
        return 1
    link = target.url + str(answer["path"])
    seconds = f"{float(answer.get('expires_in_s', 60)):.0f}"
    if not args.print and _launch_browser(link, user):
        print(f"vacancyd open: opened the status page in your browser ({target.url}/)")
        return 0
    print(link)
    print(
        f"vacancyd open: open this link in your browser within {seconds} s; it works once"
        + (" and only for your user" if user is not None or os.geteuid() != 0 else ""),
        file=sys.stderr,
    )
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


def _post(
    url: str,
    token: str | None,
    body: dict[str, Any],
    timeout_s: float = 10.0,
    tls: ssl.SSLContext | None = None,
) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with _opener(tls).open(request, timeout=timeout_s) as resp:
        return json.load(resp)


def _admin_call(args: argparse.Namespace, what: str, path: str, body: dict[str, Any]) -> Any:
    target = _target(args, "admin", what)
    if isinstance(target, int):
        return target
    url = target.url
    tls = _client_tls(args, what)
    if isinstance(tls, int):
        return tls
    try:
        return _post(url + path, target.token, body, tls=tls)
    except urllib.error.HTTPError as exc:
        print(_http_refusal(what, url, exc, target, "admin"), file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        print(_unreachable(what, url + path, exc), file=sys.stderr)
        return 1


def cmd_pause(args: argparse.Namespace) -> int:
    from vacancyd.core.pause import parse_duration

    body: dict[str, Any] = {}
    if args.for_ is not None:
        try:
            parse_duration(args.for_)  # say what is wrong before calling the daemon
        except ValueError as exc:
            print(f"vacancyd pause: --for: {exc}", file=sys.stderr)
            return 2
        body["for"] = args.for_
    if args.until is not None:
        body["until"] = args.until
    if args.until_idle:
        body["until_idle"] = True
    if args.reason:
        body["reason"] = args.reason
    answer = _admin_call(args, "pause", "/admin/pause", body)
    if isinstance(answer, int):
        return answer
    pause = answer.get("pause") or {}
    print(f"vacancyd: {pause.get('detail', 'paused')}")
    if not answer.get("persisted", True):
        print(
            f"vacancyd pause: warning: the pause was not saved and ends if the daemon restarts: "
            f"{answer.get('persist_error')}",
            file=sys.stderr,
        )
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    answer = _admin_call(args, "resume", "/admin/resume", {})
    if isinstance(answer, int):
        return answer
    print("vacancyd: lending resumed" if answer.get("resumed") else "vacancyd: was not paused")
    if answer.get("persist_error"):
        print(f"vacancyd resume: warning: {answer['persist_error']}", file=sys.stderr)
    return 0


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


def _write_text(path: Path, text: str) -> None:
    """Write an output file atomically (``vacancyd.runtime.durable.write_text``)."""
    from vacancyd.runtime import durable

    durable.write_text(path, text)


def _free_mib_probe(settings: Settings) -> Any:
    """An async ``free_mib(resource)`` reading the GPU (NVML, nvidia-smi) as the daemon does."""
    from vacancyd.runtime.daemon import _capacity_probe

    probes: dict[str, Any] = {}
    gpus: dict[str, Any] = {}

    async def free_mib(resource: str) -> float:
        res = next(r for r in settings.resource if r.name == resource)
        probe = probes.setdefault(resource, _capacity_probe(res, settings, gpus))
        reading = await asyncio.to_thread(probe)
        if reading.free_mib is None:
            from vacancyd.runtime.measure import MeasureError

            raise MeasureError(f"resource {resource!r} reports no free memory")
        return float(reading.free_mib)

    return free_mib


def cmd_measure(args: argparse.Namespace) -> int:
    from vacancyd.runtime import measure, profiles
    from vacancyd.runtime.apitarget import DEFAULT_CONFIG

    if args.config is None and DEFAULT_CONFIG.is_file():
        args.config = DEFAULT_CONFIG  # the lender's config, as `vacancyd init` wrote it
    try:
        settings = _load(args.config)
    except ConfigError as exc:
        print(f"vacancyd measure: {exc}", file=sys.stderr)
        return 2
    target = _target(args, "read", "measure")
    if isinstance(target, int):
        return target
    tls = _client_tls(args, "measure")
    if isinstance(tls, int):
        return tls
    try:
        lender = _fetch_status(target.url, target.token, tls=tls)
    except urllib.error.HTTPError as exc:
        print(_http_refusal("measure", target.url, exc, target, "read"), file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        failed = _unreachable("measure", "the daemon's /status", exc, "cannot read")
        print(
            f"{failed}; it must run, so that measuring never starts while the owner is here "
            "or borrowed work runs",
            file=sys.stderr,
        )
        return 1
    try:
        results = asyncio.run(
            measure.run_measure(
                settings,
                upstreams=args.upstream or [],
                models=args.model or [],
                num_ctx=args.num_ctx,
                headroom_mib=args.headroom_mib,
                lender_status=lender,
                free_mib=_free_mib_probe(settings),
            )
        )
    except KeyboardInterrupt:
        print(
            "vacancyd measure: interrupted; what it loaded was unloaded, nothing written",
            file=sys.stderr,
        )
        return 130
    except measure.MeasureError as exc:
        print(f"vacancyd measure: {exc}", file=sys.stderr)
        return 1
    text = measure.render_toml(results, args.headroom_mib)
    if args.output is not None:
        _write_text(args.output, text)
        print(f"vacancyd measure: wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    if args.profile is not None:
        adapters = {u.name: u.adapter for u in settings.upstream}
        doc = profiles.to_json(profiles.from_measurements(results, adapters))
        _write_text(args.profile, json.dumps(doc, indent=2) + "\n")
        print(f"vacancyd measure: wrote profile {args.profile}", file=sys.stderr)
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    from vacancyd.runtime import measure, profiles

    try:
        settings = _load(args.config)
    except ConfigError as exc:
        print(f"vacancyd profiles: {exc}", file=sys.stderr)
        return 2
    ups = [u for u in settings.upstream if not args.upstream or u.name in args.upstream]
    if not ups:
        print(f"vacancyd profiles: no upstream named {', '.join(args.upstream)}", file=sys.stderr)
        return 2
    try:
        if args.action == "export":
            found: list[profiles.Profile] = []
            for up in ups:
                found += asyncio.run(profiles.export_profiles(up))
            text = json.dumps(profiles.to_json(found), indent=2) + "\n"
        else:
            try:
                entries = profiles.from_json(args.file.read_text(encoding="utf-8"), str(args.file))
            except OSError as exc:
                print(f"vacancyd profiles: cannot read {args.file}: {exc}", file=sys.stderr)
                return 2
            except ValueError as exc:
                print(f"vacancyd profiles: {exc}", file=sys.stderr)
                return 2
            applied: list[measure.Measurement] = []
            for up in ups:
                done, skipped = asyncio.run(profiles.import_profiles(up, entries))
                applied += done
                for why in skipped:
                    print(f"vacancyd profiles: {up.name}: skipped {why}", file=sys.stderr)
            text = measure.render_toml(applied, 0).replace(
                "measured footprint plus 0 MiB headroom", "imported footprints"
            )
    except measure.MeasureError as exc:
        print(f"vacancyd profiles: {exc}", file=sys.stderr)
        return 1
    if args.output is not None:
        _write_text(args.output, text)
    else:
        print(text, end="")
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vacancyd", description="Lend an idle GPU without costing its owner."
    )
    parser.add_argument("--version", action="version", version=f"vacancyd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

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

    companion = sub.add_parser(
        "companion",
        help="follow lenders over HTTP and publish them to Kubernetes (runs in the cluster)",
    )
    companion.add_argument("--config", type=Path, required=True, help="companion TOML file")
    companion.add_argument("--log-level", default="info", help="debug, info, warning, error")
    companion.add_argument("--log-format", default="plain", choices=["plain", "json"])
    companion.set_defaults(func=cmd_companion)

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

    status = sub.add_parser("status", help="show a running daemon's state")
    _add_api_args(status, "read")
    status.add_argument("--json", action="store_true", help="print the raw /status JSON")
    status.set_defaults(func=cmd_status)

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

    opener = sub.add_parser(
        "open",
        help="open the status page in your browser, logged in by a single-use link",
    )
    _add_api_args(opener, "read")
    opener.add_argument(
        "--print", action="store_true", help="print the link instead of opening a browser"
    )
    opener.set_defaults(func=cmd_open)

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

    resume = sub.add_parser("resume", help="end a pause")
    _add_api_args(resume, "admin")
    resume.set_defaults(func=cmd_resume)

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
    return parser


#: Exit status when the reader of our output went away (``vacancyd status | head``), as the
#: Python documentation recommends for a closed pipe.
BROKEN_PIPE_EXIT = 1


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Returns its exit status; a reader that closes our standard output
    early (``vacancyd status | head -1``) ends the command quietly with
    :data:`BROKEN_PIPE_EXIT`, never with a traceback."""
    try:
        try:
            args = build_parser().parse_args(argv)  # --help prints, then exits
            code: int = args.func(args)
        finally:
            sys.stdout.flush()  # a buffered tail meets the closed pipe here, not at exit
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE_EXIT
    return code


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that flushing it at interpreter exit does not
    hit the closed pipe again (the recipe in Python's ``signal`` documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
