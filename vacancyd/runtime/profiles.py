"""Footprint profiles: measured footprints as JSON, keyed by model name and digest, so a
fleet of identical lenders shares one measurement (``vacancyd profiles export|import``).

Format::

    {"version": 1, "kind": "vacancyd-footprints",
     "profiles": [{"model": "llama3.2:latest", "digest": "sha..." | null,
                   "footprint_mib": 3900, "num_ctx": 8192 | null, "adapter": "ollama"}]}

Import applies an entry only where it describes the same model: for Ollama the local model
of that name must have the same digest (a different build or quantisation under the same
name has another footprint); entries without a digest (other servers) apply by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from vacancyd.adapters.ollama import canonical_model
from vacancyd.config.model import UpstreamSettings
from vacancyd.runtime.measure import MeasureError, Measurement

VERSION = 1
KIND = "vacancyd-footprints"


@dataclass(frozen=True, slots=True)
class Profile:
    model: str
    digest: str | None
    footprint_mib: int
    num_ctx: int | None
    adapter: str


def to_json(profiles: Sequence[Profile]) -> dict[str, Any]:
    return {
        "version": VERSION,
        "kind": KIND,
        "profiles": [
            {
                "model": p.model,
                "digest": p.digest,
                "footprint_mib": p.footprint_mib,
                "num_ctx": p.num_ctx,
                "adapter": p.adapter,
            }
            for p in profiles
        ],
    }


def from_json(text: str, where: str) -> list[Profile]:
    """Parse a profile file; raises ValueError naming ``where`` and what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ValueError(f"{where} is not a vacancyd footprint profile (no kind {KIND!r})")
    if data.get("version") != VERSION:
        raise ValueError(
            f"{where} has profile version {data.get('version')!r}; this vacancyd reads {VERSION}"
        )
    raw = data.get("profiles")
    if not isinstance(raw, list):
        raise ValueError(f"{where}: 'profiles' is not a list")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: profiles[{i}] is not an object")
        model, digest, mib = entry.get("model"), entry.get("digest"), entry.get("footprint_mib")
        num_ctx, adapter = entry.get("num_ctx"), entry.get("adapter", "")
        if not isinstance(model, str) or not model:
            raise ValueError(f"{where}: profiles[{i}].model is not a model name")
        if digest is not None and not isinstance(digest, str):
            raise ValueError(f"{where}: profiles[{i}].digest is not a string or null")
        if not isinstance(mib, int) or isinstance(mib, bool) or mib <= 0:
            raise ValueError(f"{where}: profiles[{i}].footprint_mib is not a positive MiB count")
        if num_ctx is not None and (not isinstance(num_ctx, int) or num_ctx <= 0):
            raise ValueError(f"{where}: profiles[{i}].num_ctx is not a positive integer or null")
        out.append(Profile(model, digest, mib, num_ctx, str(adapter)))
    return out


def from_measurements(results: Sequence[Measurement], adapters: Mapping[str, str]) -> list[Profile]:
    return [
        Profile(m.model, m.digest, m.footprint_mib, m.num_ctx, adapters.get(m.upstream, ""))
        for m in results
        if m.footprint_mib is not None
    ]


async def ollama_digests(target: URL) -> dict[str, str]:
    """Canonical model name -> digest from ``GET /api/tags``. Raises MeasureError."""
    try:
        async with (
            aiohttp.ClientSession(
                trust_env=False, timeout=aiohttp.ClientTimeout(total=10)
            ) as session,
            session.get(target.with_path("/api/tags")) as resp,
        ):
            if resp.status != 200:
                raise MeasureError(f"GET /api/tags on {target} answered {resp.status}")
            payload = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise MeasureError(f"cannot list the models of {target}: {exc}") from exc
    models = payload.get("models") if isinstance(payload, dict) else None
    if not isinstance(models, list):
        raise MeasureError(f"GET /api/tags on {target} did not return {{'models': [...]}}")
    out = {}
    for entry in models:
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            digest = entry.get("digest")
            if isinstance(digest, str):
                out[canonical_model(entry["name"])] = digest
    return out


async def export_profiles(up: UpstreamSettings) -> list[Profile]:
    """The upstream's configured footprints as profiles (Ollama: with the local digests)."""
    digests = await ollama_digests(URL(str(up.target))) if up.adapter == "ollama" else {}
    out = []
    for model, mib in up.models.footprint_mib.items():
        name = canonical_model(model) if up.adapter == "ollama" else model
        out.append(Profile(name, digests.get(name), mib, None, up.adapter))
    return out


async def import_profiles(
    up: UpstreamSettings, profiles: Sequence[Profile]
) -> tuple[list[Measurement], list[str]]:
    """(the entries that apply to ``up``, as results to render; why the others do not)."""
    digests = await ollama_digests(URL(str(up.target))) if up.adapter == "ollama" else {}
    applied: list[Measurement] = []
    skipped: list[str] = []
    for p in profiles:
        name = canonical_model(p.model) if up.adapter == "ollama" else p.model
        if up.adapter == "ollama":
            local = digests.get(name)
            if local is None:
                skipped.append(f"{name}: not pulled on this host")
                continue
            if p.digest is None or p.digest != local:
                skipped.append(
                    f"{name}: this host has another build of it (digest {local[:12]}, the "
                    f"profile's {str(p.digest)[:12]})"
                )
                continue
        applied.append(Measurement(up.name, name, p.footprint_mib, None, p.num_ctx, p.digest))
    return applied, skipped
