"""``vacancyd measure``: load each configured model once and write down what it really takes.

For every model of the chosen upstreams (the footprint table's models, or ``--model``):

* Ollama: unless it is already loaded with the context asked for, load it with a one-token
  ``POST /api/generate`` carrying ``options.num_ctx``, then read ``GET /api/ps``. On an
  upstream whose resource is a GPU, its ``size_vram`` is the on-card footprint, and a model
  whose ``size_vram`` is smaller than its ``size`` spilled part of itself to system memory:
  it does not fit, and is reported, not written. On a memory (or cpu) resource the model
  runs from system memory, so its whole ``size`` is the footprint. What this command loaded
  it unloads again (``keep_alive: 0``), also when interrupted.
* OpenAI-compatible servers (``openai``, ``llamacpp``, ``vllm``): the GPU's free memory
  (NVML) before and after a one-token completion; the drop is the footprint. A server that
  had loaded the model already shows no drop, which is reported: measure such a server by
  starting it.

Each footprint is rounded up to whole MiB plus ``--headroom-mib``. The result is printed as
TOML ``[upstream.models.footprint_mib]`` tables the config accepts (with ``--output``,
written to a file atomically: on any failure or interruption nothing is written), and, with
``--profile``, as a JSON profile (see :mod:`vacancyd.runtime.profiles`).

It refuses to run while the owner is present or borrowed work is active, as the running
daemon's ``/status`` reports them (measuring then would take the owner's memory or charge a
borrower's load to the model).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp
from yarl import URL

from vacancyd.adapters.ollama import canonical_model, parse_ps_models
from vacancyd.config.model import Settings, UpstreamSettings
from vacancyd.core.observations import ProbeError
from vacancyd.core.residency import ResidentModel

#: Headroom added to each measured footprint unless ``--headroom-mib`` says otherwise (MiB).
DEFAULT_HEADROOM_MIB = 500
#: How long one model may take to load (seconds).
LOAD_TIMEOUT_S = 600.0
OPENAI_ADAPTERS = ("openai", "llamacpp", "vllm")


class MeasureError(Exception):
    """Measuring cannot start or go on (the reason is for a person)."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """One model's result. ``footprint_mib`` is None when nothing is to be written, and
    ``note`` then says why (spilled to system memory, not found, no drop seen...)."""

    upstream: str
    model: str
    footprint_mib: int | None
    measured_mib: float | None
    num_ctx: int | None
    digest: str | None = None
    note: str = ""


def footprint_from(vram_mib: float, total_mib: float | None, headroom_mib: int) -> int | None:
    """What to configure for a model that took ``vram_mib`` on the card, or None when it
    spilled (``vram_mib`` below ``total_mib``: part of it is in system memory)."""
    if total_mib is not None and vram_mib + 1 < total_mib:
        return None
    return math.ceil(vram_mib) + headroom_mib


def lender_refusal(doc: Mapping[str, Any], upstreams: Sequence[str]) -> str | None:
    """Why measuring must not start now, from the daemon's ``/status``; None when it may."""
    presence = doc.get("presence") or {}
    veto = presence.get("veto") or {}
    if veto.get("active"):
        return "the owner is using this machine (the owner veto is active)"
    if presence.get("refuses", True) and not presence.get("evidence_complete", False):
        return "owner presence is not known clearly"
    for name in upstreams:
        up = (doc.get("upstreams") or {}).get(name) or {}
        if up.get("active_work"):
            return f"borrowed work is active on upstream {name!r}"
    return None


def render_toml(results: Sequence[Measurement], headroom_mib: int) -> str:
    """The footprint tables for the config, one per upstream, with notes as comments."""
    lines = [f"# vacancyd measure: measured footprint plus {headroom_mib} MiB headroom, MiB"]
    by_upstream: dict[str, list[Measurement]] = {}
    for m in results:
        by_upstream.setdefault(m.upstream, []).append(m)
    for upstream, items in by_upstream.items():
        lines += [
            "",
            f'# [[upstream]] name = "{upstream}": replaces its [upstream.models.footprint_mib]',
            "[upstream.models.footprint_mib]",
        ]
        for m in items:
            if m.footprint_mib is None:
                lines.append(f'# "{m.model}": not written: {m.note}')
            else:
                ctx = f", num_ctx {m.num_ctx}" if m.num_ctx else ""
                source = (
                    "from a profile"
                    if m.measured_mib is None
                    else f"measured {m.measured_mib:.0f} MiB"
                )
                lines.append(f'"{m.model}" = {m.footprint_mib}  # {source}{ctx}')
    return "\n".join(lines) + "\n"


Progress = Callable[[str], None]


def _say(out: TextIO) -> Progress:
    def say(line: str) -> None:
        print(f"vacancyd measure: {line}", file=out, flush=True)

    return say


class OllamaMeasurer:
    """Loads, reads and unloads models on one Ollama server."""

    def __init__(
        self, session: aiohttp.ClientSession, target: URL, say: Progress, on_gpu: bool = True
    ) -> None:
        self.session = session
        self.target = target
        self.say = say
        #: The upstream's resource is a GPU (footprint from ``size_vram``); else system
        #: memory (footprint from ``size``).
        self.on_gpu = on_gpu
        self.loaded_by_us: set[str] = set()

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        try:
            async with self.session.request(
                method, self.target.with_path(path), json=body, allow_redirects=False
            ) as resp:
                text = await resp.text(errors="replace")
                try:
                    return resp.status, json.loads(text) if text else None
                except ValueError:
                    return resp.status, text
        except (aiohttp.ClientError, OSError) as exc:
            raise MeasureError(f"{self.target} cannot be reached ({exc})") from exc

    async def ps(self) -> dict[str, ResidentModel]:
        status, payload = await self._call("GET", "/api/ps")
        if status != 200:
            raise MeasureError(f"GET /api/ps on {self.target} answered {status}")
        try:
            return {m.name: m for m in parse_ps_models(payload, time.time())}
        except ProbeError as exc:
            raise MeasureError(f"{self.target}: {exc}") from exc

    async def measure(self, upstream: str, model: str, num_ctx: int, headroom: int) -> Measurement:
        name = canonical_model(model)
        resident = (await self.ps()).get(name)
        if resident is None or resident.context_length != num_ctx:
            if resident is not None:
                return Measurement(
                    upstream,
                    name,
                    None,
                    None,
                    num_ctx,
                    resident.digest,
                    f"loaded by someone else with context {resident.context_length}; not "
                    "touched (unload it and measure again)",
                )
            self.say(f"{upstream}: loading {name} with num_ctx {num_ctx} ...")
            self.loaded_by_us.add(name)
            status, payload = await self._call(
                "POST",
                "/api/generate",
                {
                    "model": name,
                    "prompt": "hi",
                    "stream": False,
                    "options": {"num_ctx": num_ctx, "num_predict": 1},
                },
            )
            if status == 404:
                self.loaded_by_us.discard(name)
                return Measurement(upstream, name, None, None, num_ctx, None, "no such model")
            if status != 200:
                error = payload.get("error") if isinstance(payload, dict) else payload
                raise MeasureError(f"{upstream}: loading {name} answered {status}: {error}")
            resident = (await self.ps()).get(name)
            if resident is None:
                raise MeasureError(f"{upstream}: {name} loaded but /api/ps does not list it")
        if not self.on_gpu:
            return self._in_memory(upstream, name, num_ctx, headroom, resident)
        vram, size = resident.size_vram_mib, resident.size_mib
        if vram is None:
            raise MeasureError(f"{upstream}: /api/ps gives no size_vram for {name}")
        footprint = footprint_from(vram, size, headroom)
        note = ""
        if footprint is None:
            note = (
                f"spilled to system memory ({vram:.0f} of {size or 0:.0f} MiB on the GPU): "
                "it does not fit this card with this context"
            )
            self.say(f"{upstream}: {name}: {note}")
        else:
            self.say(f"{upstream}: {name} takes {vram:.0f} MiB -> footprint {footprint} MiB")
        return Measurement(upstream, name, footprint, vram, num_ctx, resident.digest, note)

    def _in_memory(
        self, upstream: str, name: str, num_ctx: int, headroom: int, resident: ResidentModel
    ) -> Measurement:
        """A model on a memory resource: all of ``size`` is in system memory, wherever the
        server put it (``size_vram`` is 0 on a CPU-only host)."""
        size = resident.size_mib
        if size is None:
            raise MeasureError(f"{upstream}: /api/ps gives no size for {name}")
        footprint = math.ceil(size) + headroom
        self.say(
            f"{upstream}: {name} takes {size:.0f} MiB of system memory -> footprint {footprint} MiB"
        )
        return Measurement(upstream, name, footprint, size, num_ctx, resident.digest)

    async def unload_ours(self) -> None:
        """Unload what this measurer loaded and wait (briefly) until it is gone."""
        for name in sorted(self.loaded_by_us):
            self.say(f"unloading {name}")
            try:
                await self._call("POST", "/api/generate", {"model": name, "keep_alive": 0})
                for _ in range(50):
                    if name not in await self.ps():
                        break
                    await asyncio.sleep(0.1)
            except MeasureError as exc:
                self.say(f"could not unload {name}: {exc}")
        self.loaded_by_us.clear()


async def measure_openai(
    session: aiohttp.ClientSession,
    target: URL,
    upstream: str,
    model: str,
    free_mib: Callable[[], Any],
    headroom: int,
    say: Progress,
) -> Measurement:
    """A one-token completion, with the GPU's free memory read before and after it."""
    before = await free_mib()
    say(f"{upstream}: {model}: {before:.0f} MiB free; sending a one-token completion ...")
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        async with session.post(target / "v1" / "chat" / "completions", json=body) as resp:
            text = await resp.text(errors="replace")
            if resp.status == 404:
                return Measurement(upstream, model, None, None, None, None, "no such model")
            if resp.status != 200:
                raise MeasureError(f"{upstream}: completion answered {resp.status}: {text[:200]}")
    except (aiohttp.ClientError, OSError) as exc:
        raise MeasureError(f"{target} cannot be reached ({exc})") from exc
    after = await free_mib()
    drop = before - after
    if drop < 64:
        return Measurement(
            upstream,
            model,
            None,
            drop,
            None,
            None,
            f"free memory dropped by {drop:.0f} MiB only: the server had the model loaded "
            "already; note free memory with the server stopped, then start it, to measure it",
        )
    footprint = math.ceil(drop) + headroom
    say(f"{upstream}: {model} took {drop:.0f} MiB -> footprint {footprint} MiB")
    return Measurement(upstream, model, footprint, drop, None, None)


def models_for(up: UpstreamSettings, chosen: Sequence[str]) -> list[str]:
    return list(chosen) if chosen else list(up.models.footprint_mib)


async def run_measure(
    settings: Settings,
    *,
    upstreams: Sequence[str],
    models: Sequence[str],
    num_ctx: int,
    headroom_mib: int,
    lender_status: Mapping[str, Any],
    free_mib: Callable[[str], Any] | None = None,
    out: TextIO = sys.stderr,
) -> list[Measurement]:
    """Measure; raises :class:`MeasureError`, also when there is nothing to measure (no
    upstream chosen, or none of them has a model listed or an adapter that can be measured;
    the message says why for each). Ollama models it loaded are unloaded again whatever
    happens (including cancellation)."""
    say = _say(out)
    chosen = [u for u in settings.upstream if not upstreams or u.name in upstreams]
    unknown = sorted(set(upstreams) - {u.name for u in settings.upstream})
    if unknown:
        raise MeasureError(f"no upstream named {', '.join(unknown)} in the configuration")
    why = lender_refusal(lender_status, [u.name for u in chosen])
    if why is not None:
        raise MeasureError(f"not measuring now: {why}")
    if not chosen:
        raise MeasureError("nothing to measure: the configuration declares no [[upstream]]")
    results: list[Measurement] = []
    #: Why each upstream that measured nothing was skipped.
    skipped: list[str] = []
    async with aiohttp.ClientSession(
        trust_env=False, timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S, connect=5)
    ) as session:
        for up in chosen:
            names = models_for(up, models)
            if not names:
                why = (
                    f"{up.name}: no models listed (give --model, or fill its "
                    "[upstream.models.footprint_mib] table)"
                )
                say(why)
                skipped.append(why)
                continue
            target = URL(str(up.target))
            if up.adapter == "ollama":
                kind = next((r.kind for r in settings.resource if r.name == up.resource), "gpu")
                measurer = OllamaMeasurer(session, target, say, on_gpu=kind == "gpu")
                try:
                    for i, name in enumerate(names, 1):
                        say(f"{up.name}: model {i}/{len(names)}: {name}")
                        results.append(await measurer.measure(up.name, name, num_ctx, headroom_mib))
                        await measurer.unload_ours()
                finally:
                    await asyncio.shield(measurer.unload_ours())
            elif up.adapter in OPENAI_ADAPTERS and free_mib is not None:
                for name in names:
                    results.append(
                        await measure_openai(
                            session,
                            target,
                            up.name,
                            name,
                            functools.partial(free_mib, up.resource),
                            headroom_mib,
                            say,
                        )
                    )
            else:
                why = f"{up.name}: the {up.adapter!r} adapter cannot be measured this way"
                say(f"{why}; skipped")
                skipped.append(why)
    if not results:
        raise MeasureError("nothing to measure: " + "; ".join(skipped))
    return results
