"""Model footprints: ``vacancyd measure`` (load each model once and read what it takes) and
``vacancyd profiles export | import``."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import urllib.error
from pathlib import Path
from typing import Any

from vacancyd.cli.apiclient import _client_tls, _fetch_status, _http_refusal, _target, _unreachable
from vacancyd.cli.common import _load
from vacancyd.config import ConfigError, Settings


def _write_text(path: Path, text: str) -> None:
    """Write an output file atomically (``vacancyd.runtime.durable.write_text``)."""
    from vacancyd.runtime import durable

    durable.write_text(path, text)


def _free_mib_probe(settings: Settings) -> Any:
    """An async ``free_mib(resource)`` reading the GPU (NVML, nvidia-smi) as the daemon does."""
    from vacancyd.runtime.build import capacity_probe

    probes: dict[str, Any] = {}
    gpus: dict[str, Any] = {}

    async def free_mib(resource: str) -> float:
        res = next(r for r in settings.resource if r.name == resource)
        probe = probes.setdefault(resource, capacity_probe(res, settings, gpus))
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
