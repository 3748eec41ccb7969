"""The whole configuration file: every table together and the checks that span tables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from vacancyd.config.model.base import (
    FOLLOWED_SHUTDOWN_DELAY_S,
    FrozenModel,
    is_loopback,
    split_listen,
)
from vacancyd.config.model.borrowers import DEFAULT_USAGE_RETENTION_DAYS, BorrowerSettings
from vacancyd.config.model.kubernetes import KubernetesSettings
from vacancyd.config.model.owner import OwnerSettings, ScheduleSettings
from vacancyd.config.model.resources import CollectorSettings, ResourceSettings
from vacancyd.config.model.server import ServerSettings, TelemetrySettings
from vacancyd.config.model.upstreams import PoolSettings, UpstreamSettings


class Settings(FrozenModel):
    """The whole configuration file."""

    server: ServerSettings = ServerSettings()
    owner: OwnerSettings = OwnerSettings()
    collectors: CollectorSettings = CollectorSettings()
    state_dir: Path = Path("/var/lib/vacancyd")
    resource: list[ResourceSettings] = []
    upstream: list[UpstreamSettings] = []
    pool: list[PoolSettings] = []
    kubernetes: KubernetesSettings | None = None
    schedule: ScheduleSettings | None = None
    telemetry: TelemetrySettings = TelemetrySettings()
    borrower: list[BorrowerSettings] = []
    #: Days a finished job's row is kept in the usage ledger (docs/borrowers.md).
    usage_retention_days: int = Field(DEFAULT_USAGE_RETENTION_DAYS, ge=1, le=3650)
    #: What one kWh costs the owner, for ``vacancyd usage`` (None: no cost shown).
    energy_price_per_kwh: float | None = Field(None, ge=0, le=1_000_000)
    #: The label printed after a cost (``EUR``, ``$``); only with ``energy_price_per_kwh``.
    energy_currency: str = Field("", max_length=16, pattern=r"^[^\x00-\x1f\x7f]*$")

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        names = [r.name for r in self.resource]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"resource names must be unique; repeated: {', '.join(dupes)}")
        unames = [u.name for u in self.upstream] + [p.name for p in self.pool]
        dupes = sorted({n for n in unames if unames.count(n) > 1})
        if dupes:
            raise ValueError(
                f"upstream and pool names must be unique; repeated: {', '.join(dupes)}"
            )
        listens = [
            listen
            for listen in (
                self.server.listen,
                *(u.listen for u in self.upstream),
                *(p.listen for p in self.pool),
            )
            if split_listen(listen)[1] != 0
        ]
        dupes = sorted({n for n in listens if listens.count(n) > 1})
        if dupes:
            raise ValueError(f"listen addresses must be unique; repeated: {', '.join(dupes)}")
        gpus = [r.device_key for r in self.resource if r.kind == "gpu"]
        if len(set(gpus)) != len(gpus):
            raise ValueError("two gpu resources select the same device")
        for i, up in enumerate(self.upstream):
            for dep in (up.resource, *up.also_requires):
                if dep not in names:
                    raise ValueError(
                        f"upstream[{i}] ({up.name}) names resource {dep!r}, which no "
                        f"[[resource]] declares (declared: {', '.join(names) or 'none'})"
                    )
        self._check_exclusivity()
        self._check_pools()
        self._check_borrowers()
        if self.owner.present_max_model_mib is None:
            opted = [u.name for u in self.upstream if u.lend_while_present]
            if opted:
                raise ValueError(
                    "lend_while_present needs [owner] present_max_model_mib (the largest "
                    f"footprint lent while the owner is present): {', '.join(opted)}"
                )
        if not self.server.tokens and not self.server.allow_unauthenticated_remote:
            remote = (
                [
                    f"server.listen = {self.server.listen!r}"
                    for _ in [0]
                    if not is_loopback(split_listen(self.server.listen)[0])
                ]
                + [
                    f"upstream {u.name!r} listen = {u.listen!r}"
                    for u in self.upstream
                    if not is_loopback(split_listen(u.listen)[0])
                ]
                + [
                    f"pool {p.name!r} listen = {p.listen!r}"
                    for p in self.pool
                    if not is_loopback(split_listen(p.listen)[0])
                ]
            )
            if remote:
                raise ValueError(
                    "a non-loopback listener needs [[server.tokens]] (or the conspicuous "
                    "server.allow_unauthenticated_remote = true): " + "; ".join(remote)
                )
        return self

    def _check_exclusivity(self) -> None:
        by_name = {u.name: (i, u) for i, u in enumerate(self.upstream)}
        listed = {other for u in self.upstream for other in u.exclusive_of}
        for i, up in enumerate(self.upstream):
            for other in up.exclusive_of:
                if other not in by_name:
                    raise ValueError(
                        f"upstream[{i}] ({up.name}) exclusive_of names {other!r}, which no "
                        f"[[upstream]] declares"
                    )
                _, them = by_name[other]
                if them.resource != up.resource:
                    raise ValueError(
                        f"upstream[{i}] ({up.name}) is exclusive of {other!r}, but they are on "
                        f"different resources ({up.resource!r} and {them.resource!r}); "
                        "exclusivity shares one card, so both must name the same resource"
                    )
            if up.exclusive_of and up.name in listed:
                raise ValueError(
                    f"upstream[{i}] ({up.name}) both lists upstreams in exclusive_of and is "
                    "listed in another's; only one side of an exclusivity takes the card"
                )

    def _check_pools(self) -> None:
        by_name = {u.name: u for u in self.upstream}
        for i, pool in enumerate(self.pool):
            missing = [m for m in pool.members if m not in by_name]
            if missing:
                raise ValueError(
                    f"pool[{i}] ({pool.name}) names {', '.join(map(repr, missing))}, which no "
                    "[[upstream]] declares"
                )
            adapters = sorted({by_name[m].adapter for m in pool.members})
            if len(adapters) > 1:
                raise ValueError(
                    f"pool[{i}] ({pool.name}) mixes adapters ({', '.join(adapters)}); its "
                    "members must be servers of one kind"
                )
            if adapters == ["comfyui"]:
                raise ValueError(
                    f"pool[{i}] ({pool.name}) pools comfyui servers; a ComfyUI result is read "
                    "back from the server that ran the prompt, which a pool cannot route"
                )
            for m in pool.members:
                if by_name[m].exclusive_of or any(m in u.exclusive_of for u in self.upstream):
                    raise ValueError(
                        f"pool[{i}] ({pool.name}) member {m!r} takes part in an exclusivity; "
                        "a pool member must be a server of its own"
                    )

    def _check_borrowers(self) -> None:
        names = [b.name for b in self.borrower]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"borrower names must be unique; repeated: {', '.join(dupes)}")
        known = {u.name for u in self.upstream} | {p.name for p in self.pool}
        for i, borrower in enumerate(self.borrower):
            for name in borrower.upstreams or ():
                if name not in known:
                    raise ValueError(
                        f"borrower[{i}] ({borrower.name}) upstreams names {name!r}, which no "
                        f"[[upstream]] or [[pool]] declares (declared: "
                        f"{', '.join(sorted(known)) or 'none'})"
                    )

    @property
    def stale_after_default_s(self) -> float:
        return max(5.0, 3 * self.collectors.poll_s)

    @property
    def shutdown_delay_s(self) -> float:
        """``[server] shutdown_delay_s`` in force (seconds): as set, else 2 with
        ``[kubernetes]`` host publishing, else 0; never more than the grace."""
        delay = self.server.shutdown_delay_s
        if delay is None:
            delay = FOLLOWED_SHUTDOWN_DELAY_S if self.kubernetes is not None else 0.0
        return min(delay, self.server.shutdown_grace_s)

    @property
    def presence_max_age_s(self) -> float:
        """Presence older than four general polls, at least 15 s, is stale (docs/architecture.md
        2)."""
        return max(15.0, 4 * self.collectors.poll_s)
