"""``vacancyd run``: the daemon as a process, from its start to its exit code, with its
signals (SIGTERM/SIGINT stop and drain, a second one hurries; SIGHUP reloads the TLS files and
checks the configuration again) and its systemd notifications (:mod:`vacancyd.runtime.daemon`
is the daemon itself)."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from vacancyd.config.load import ConfigError, load_config
from vacancyd.config.model import Settings
from vacancyd.config.secrets import credentials_directory, read_secrets
from vacancyd.runtime import memory, sdnotify
from vacancyd.runtime.daemon import EXIT_CONFIG, Daemon
from vacancyd.runtime.listeners import EXIT_ADDRESS_BUSY, AddressBusyError, StartupError
from vacancyd.web.framing import lenient_parser_problem

#: The daemon's process-level lines log as the daemon's (docs/observability.md).
log = logging.getLogger("vacancyd.runtime.daemon")


async def recheck_config(path: Path | None) -> bool:
    """SIGHUP: read and validate the configuration file again (secrets included) and log the
    result. Returns whether it is valid. Never raises: the running configuration is kept
    either way, because vacancyd applies a configuration only at start (listeners, budgets
    and policies are built from it once); a restart applies a changed file."""
    if path is None:
        log.info("SIGHUP: running on the embedded default configuration; nothing to re-read")
        return True

    def check() -> None:
        read_secrets(load_config(path), str(path), credentials_directory())

    try:
        await asyncio.to_thread(check)
    except ConfigError as exc:
        log.error("SIGHUP: %s\nthe running configuration is kept", exc)
        return False
    except Exception as exc:
        log.error("SIGHUP: cannot check %s (%r); the running configuration is kept", path, exc)
        return False
    log.info(
        "SIGHUP: %s is valid; configuration changes take effect when vacancyd is restarted "
        "(systemctl restart vacancyd); the running configuration is kept",
        path,
    )
    return True


async def run_daemon(settings: Settings, config_path: Path | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit code.

    SIGHUP re-reads and validates ``config_path`` and logs the verdict
    (:func:`recheck_config`); it never stops the daemon.
    """
    parser_problem = lenient_parser_problem()
    if parser_problem is not None:
        log.error("%s", parser_problem)
        return EXIT_CONFIG
    memory.pin_malloc_thresholds()  # request bodies' memory goes back after a storm
    daemon = Daemon(settings)
    loop = asyncio.get_running_loop()
    # The first SIGTERM/SIGINT starts the drain; a second one (either) ends it now.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)

    async def hangup() -> bool:
        await daemon.reload_tls()
        return await recheck_config(config_path)

    def on_hangup() -> None:
        daemon.supervisor.spawn(hangup(), name="SIGHUP config check", essential=False)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        try:
            await daemon.start()
        except AddressBusyError as exc:
            log.error("%s", exc)
            return EXIT_ADDRESS_BUSY
        except (StartupError, ConfigError) as exc:
            log.error("%s", exc)
            return EXIT_CONFIG
        line = daemon.service_status()
        sdnotify.notify(f"READY=1\nSTATUS={line}")
        if sdnotify.enabled():
            daemon.supervisor.spawn(
                sdnotify.status_updates(daemon.service_status, sent=line),
                name="service status",
                essential=False,
            )
        ping_s = sdnotify.watchdog_interval_s()
        if ping_s is not None:
            daemon.supervisor.spawn(sdnotify.watchdog(ping_s), name="watchdog", essential=False)
        code = await daemon.wait()
        if code:
            log.error("%s", daemon.supervisor.failure)
        else:
            log.info("stopping on signal")
        return code
    finally:
        sdnotify.notify("STOPPING=1")
        await daemon.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
