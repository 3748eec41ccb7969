"""Helpers for reclaim tests: a one-upstream daemon config and owner-return edges."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from vacancyd.state import PresenceReading

OWNER = PresenceReading(owner_signal=True, evidence_complete=True, detail="test: owner is back")


def config(
    target: str, *, adapter: str, policy: str = "drain", extra: str = "", release_s: float = 3600
) -> str:
    """One memory-gated upstream named ``up`` behind a loopback-trusting daemon.

    Presence is headless (nobody there) and polled every 0.1 s; the veto engaged by
    :func:`owner_returns` releases ``release_s`` seconds after it. ``extra``: more keys of
    the ``[[upstream]]`` table, as TOML lines.
    """
    return (
        daemon_toml(
            upstream("up", target, adapter=adapter, on_owner_return=policy),
            owner={"release_after_s": release_s},
        )
        + extra
        + "\n"
    )


@asynccontextmanager
async def lender(
    app: web.Application | None, *, target: str | None = None, **kw: object
) -> AsyncIterator[tuple[RunningDaemon, aiohttp.ClientSession]]:
    """Serve ``app`` (or use ``target``), start a daemon in front of it, yield (daemon, client)."""
    if app is None:
        assert target is not None
        async with running_daemon(config(target, **kw)) as d:  # type: ignore[arg-type]
            await d.wait_ready()
            async with aiohttp.ClientSession() as client:
                yield d, client
        return
    async with serve_app(app) as url:
        async with running_daemon(config(url, **kw)) as d:  # type: ignore[arg-type]
            await d.wait_ready()
            async with aiohttp.ClientSession() as client:
                yield d, client


def owner_returns(d: RunningDaemon) -> None:
    """The owner comes back: a presence reading with the owner's signal, taken in by the
    owner controls as the presence loop hands it over (the owner's return starts there)."""
    d.daemon.owner.record_presence(OWNER, d.state.clock())


def reclaim_view(d: RunningDaemon, name: str = "up") -> dict[str, object]:
    view = d.state.reclaim_views.get(name)
    return dict(view) if view is not None else {}
