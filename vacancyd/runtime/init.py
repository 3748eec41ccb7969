"""``vacancyd init``: find the local inference servers and GPUs, write a safe starting config.

Each candidate address (the servers' usual local ports, or those given with ``--server``) is
asked, in this order, the question only one kind of server answers:

1. Ollama: ``GET /api/version`` -> ``{"version": str}``; its models from ``GET /api/tags``;
2. ComfyUI: ``GET /system_stats`` -> ``{"system": {...}, "devices": [...]}``;
3. llama-server: ``GET /props`` -> an object with ``default_generation_settings``; its
   model from ``GET /v1/models``;
4. vLLM: ``GET /version`` -> ``{"version": str}``; its models from ``GET /v1/models``, and
   whether its sleep routes exist from ``GET /is_sleeping``;
5. any OpenAI-compatible server: ``GET /v1/models`` -> ``{"data": [{"id": ...}]}``.

Every request has the probe deadline (``--probe-timeout``), and each address all of its
requests together at most four times that, so a server that accepts a connection and never
answers costs the deadline, not a hang. GPUs come from NVML, else ``nvidia-smi``.

The file written has safe defaults: the API on loopback, bearer tokens (generated into files
readable only by their owner, mode 0600, next to the config) for every listener, presence
``auto``, one upstream per server found with its adapter and models, GPU resources with
memory kept free for the owner, and comments saying what to check next. An existing config is
never overwritten without ``--force``, and an existing token file is never overwritten at
all (borrowers may hold it). ``--print`` writes the config to stdout and creates nothing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import secrets
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from vacancyd.collectors.nvidia import GpuInfo, list_gpus
from vacancyd.config import ConfigError, parse_config
from vacancyd.config.advice import config_warnings

#: The ports local inference servers listen on by default.
DEFAULT_CANDIDATES = (
    "127.0.0.1:11434",  # Ollama
    "127.0.0.1:8080",  # llama-server
    "127.0.0.1:8188",  # ComfyUI
    "127.0.0.1:8000",  # vLLM
    "127.0.0.1:1234",  # LM Studio (OpenAI-compatible)
)
DEFAULT_CONFIG = Path("/etc/vacancyd/vacancyd.toml")
#: The first proxy listener's port; later ones count up.
FIRST_PROXY_PORT = 9481
#: Footprint estimate from a model's size on disk: this factor, rounded up to 256 MiB.
FOOTPRINT_FACTOR = 1.2


class InitError(Exception):
    """``vacancyd init`` cannot go on; the message says what and where."""


@dataclass
class Found:
    """One server found: where, what kind, its version, models (name -> MiB on disk or
    None) and notes for the config's comments."""

    address: str
    adapter: str
    version: str | None = None
    models: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sleep_mode: bool | None = None


@dataclass
class Discovery:
    servers: list[Found]
    missed: list[str]  # "ADDRESS: why" for candidates that were not taken
    gpus: list[GpuInfo]
    gpu_source: str
    gpu_error: str | None


async def _get(
    session: aiohttp.ClientSession, base: str, path: str, timeout_s: float
) -> tuple[int, Any]:
    """(status, JSON or None) of one GET within ``timeout_s``; raises OSError-like errors."""
    async with asyncio.timeout(timeout_s):
        async with session.get(base + path, allow_redirects=False) as resp:
            raw = await resp.content.read(1024 * 1024)
            try:
                return resp.status, json.loads(raw) if raw else None
            except ValueError:
                return resp.status, None


def _model_ids(payload: Any) -> dict[str, float | None]:
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return {}
    return {
        str(m["id"]): None for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
    }


async def identify(session: aiohttp.ClientSession, address: str, timeout_s: float) -> Found:
    """What serves ``address`` (``HOST:PORT``). Raises LookupError saying why nothing."""
    base = f"http://{address}"

    async def get(path: str) -> tuple[int, Any]:
        try:
            return await _get(session, base, path, timeout_s)
        except aiohttp.ClientConnectorError as exc:
            raise LookupError(f"nothing listens ({type(exc.os_error).__name__})") from None
        except TimeoutError:
            raise LookupError(f"GET {path} got no answer within {timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise LookupError(f"GET {path} failed: {exc.__class__.__name__}") from None

    status, body = await get("/api/version")
    if status == 200 and isinstance(body, dict) and isinstance(body.get("version"), str):
        found = Found(address, "ollama", body["version"])
        status, tags = await get("/api/tags")
        for m in tags.get("models", []) if status == 200 and isinstance(tags, dict) else []:
            if isinstance(m, dict) and isinstance(m.get("name"), str):
                size = m.get("size")
                mib = size / 1024 / 1024 if isinstance(size, int) and size > 0 else None
                found.models[m["name"]] = mib
        return found
    status, body = await get("/system_stats")
    if (
        status == 200
        and isinstance(body, dict)
        and isinstance(body.get("system"), dict)
        and isinstance(body.get("devices"), list)
    ):
        version = body["system"].get("comfyui_version")
        return Found(address, "comfyui", version if isinstance(version, str) else None)
    status, body = await get("/props")
    if status == 200 and isinstance(body, dict) and "default_generation_settings" in body:
        found = Found(address, "llamacpp", body.get("build_info") or None)
        status, models = await get("/v1/models")
        found.models = _model_ids(models) if status == 200 else {}
        return found
    status, body = await get("/version")
    if status == 200 and isinstance(body, dict) and isinstance(body.get("version"), str):
        found = Found(address, "vllm", body["version"])
        status, models = await get("/v1/models")
        found.models = _model_ids(models) if status == 200 else {}
        status, _ = await get("/is_sleeping")
        found.sleep_mode = status == 200
        return found
    status, body = await get("/v1/models")
    if status == 200 and _model_ids(body):
        return Found(address, "openai", models=_model_ids(body))
    raise LookupError(f"answers, but not like any server vacancyd knows (GET /v1/models: {status})")


async def discover(candidates: list[str], timeout_s: float, *, gpus: bool = True) -> Discovery:
    """Probe every candidate at once (each within 4 × ``timeout_s``) and list the GPUs."""
    servers: list[Found] = []
    missed: list[str] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        trust_env=False, connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:

        async def one(address: str) -> Found | str:
            try:
                async with asyncio.timeout(4 * timeout_s):
                    return await identify(session, address, timeout_s)
            except LookupError as exc:
                return f"{address}: {exc}"
            except TimeoutError:
                return f"{address}: no complete answer within {4 * timeout_s:g} s"

        for result in await asyncio.gather(*(one(a) for a in candidates)):
            if isinstance(result, Found):
                servers.append(result)
            else:
                missed.append(result)
    found_gpus: list[GpuInfo] = []
    source: str = "none"
    error: str | None = "not looked for"
    if gpus:
        try:
            async with asyncio.timeout(max(10.0, timeout_s)):
                found_gpus, source, error = await asyncio.to_thread(list_gpus, 5.0)
        except TimeoutError:
            error = "the GPU inventory did not finish within 10 s"
    return Discovery(servers, missed, found_gpus, source, error)


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def _footprint(mib: float) -> int:
    return int(-(-mib * FOOTPRINT_FACTOR // 256) * 256)


def render_config(
    found: Discovery,
    *,
    token_dir: Path,
    state_dir: Path,
    host: str,
    when: dt.datetime,
) -> str:
    """The commented starting config for what ``found`` lists (pure: no I/O)."""
    lines = _found_lines(found, host=host, when=when)
    lines += _server_lines(token_dir=token_dir, state_dir=state_dir)
    resources, primary, whole_card = _resource_lines(found.gpus)
    lines += resources
    names: dict[str, int] = {}
    for i, s in enumerate(found.servers):
        n = names[s.adapter] = names.get(s.adapter, 0) + 1
        name = s.adapter if n == 1 else f"{s.adapter}-{n}"
        lines += _upstream_lines(
            s, name=name, port=FIRST_PROXY_PORT + i, primary=primary, whole_card=whole_card
        )
    if not found.servers:
        lines += [
            "# No inference server was found. Start one and run `vacancyd init --force`, or",
            "# add an [[upstream]] by hand (docs/configuration.md).",
            "",
        ]
    return "\n".join(lines)


def _found_lines(found: Discovery, *, host: str, when: dt.datetime) -> list[str]:
    """The config's opening comment: who wrote it, what to do next, and what init found."""
    lines = [
        f"# vacancyd configuration written by `vacancyd init` on {host} at "
        f"{when.strftime('%Y-%m-%d %H:%M %Z')}.",
        "# Every key is described in docs/configuration.md. Check this file with",
        "#   vacancyd check-config THIS_FILE",
        "# Next: measure each model's footprint (docs/configuration.md, \"Measuring",
        '# footprints") and correct [upstream.models]; then consider a lending schedule and',
        '# the battery and exclusive-app keys (docs/presence.md, "The owner\'s controls").',
        "#",
        "# What init found:",
    ]
    for s in found.servers:
        lines.append(
            f"#   {s.address}: {s.adapter}"
            + (f" {s.version}" if s.version else "")
            + (f", models: {', '.join(s.models)}" if s.models else "")
        )
    for m in found.missed:
        lines.append(f"#   {m} (not included)")
    if found.gpus:
        for g in found.gpus:
            lines.append(
                f"#   GPU {g.index}: {g.uuid} at {g.pci_bus_id}, {g.total_mib:.0f} MiB "
                f"(from {found.gpu_source})"
            )
    else:
        lines.append(f"#   no GPU ({found.gpu_error}); upstreams are gated on system memory")
    return lines


def _server_lines(*, token_dir: Path, state_dir: Path) -> list[str]:
    """``state_dir``, ``[server]`` with its two token files, and ``[owner]``."""
    return [
        "",
        f"state_dir = {_toml_str(str(state_dir))}",
        "",
        "[server]",
        "# The API (status, metrics, admin) stays on loopback; use an SSH tunnel to reach it.",
        'listen = "127.0.0.1:9470"',
        "",
        "# These files stay root-only: under the systemd unit, `vacancyd install-service`",
        "# passes each one to the service as a credential named after the file, so keep",
        "# their file names distinct and run it again after changing them (docs/install.md).",
        "[[server.tokens]]",
        'name = "admin"               # vacancyd status / pause / resume: --token-file this',
        f"token_file = {_toml_str(str(token_dir / 'admin.token'))}",
        'scopes = ["admin"]',
        "",
        "[[server.tokens]]",
        'name = "borrow"              # give this one to borrowers',
        f"token_file = {_toml_str(str(token_dir / 'borrow.token'))}",
        'scopes = ["borrow"]',
        "",
        "[owner]",
        "# logind on Linux (the desktop's lock and idle state); see docs/presence.md.",
        'presence = "auto"',
        "release_after_s = 60",
        "# lend_on_battery = false      # laptops lend on mains power only (the default)",
        '# exclusive_apps = [{ name = "steam", scope = "gpu" }]',
        "",
    ]


def _resource_lines(gpus: list[GpuInfo]) -> tuple[list[str], str, int]:
    """(the ``[[resource]]`` tables, the primary resource's name, the MiB charged for a model
    of unknown size). That charge is the primary GPU's whole lendable memory, so such a model
    is lent only while that card is otherwise free; 0 without a GPU (then one ``ram``
    resource)."""
    if not gpus:
        return (
            ["[[resource]]", 'name = "ram"', 'kind = "memory"', "min_free_mib = 2048", ""],
            "ram",
            0,
        )
    lines: list[str] = []
    for g in gpus:
        keep = _keep_free_mib(g.total_mib)
        lines += [
            "[[resource]]",
            f'name = "gpu{g.index}"',
            'kind = "gpu"',
            f"device = {_toml_str(g.uuid)}   # stable across reboots and driver updates",
            f"min_free_mib = {keep}             # always left free for the owner",
            "# GPU pressure is on: the owner's GPU load is learned for 30 minutes",
            "# (docs/calibration.md) before this GPU is lent.",
            "",
        ]
    total = gpus[0].total_mib
    whole_card = int((total - _keep_free_mib(total)) // 256 * 256)
    return lines, f"gpu{gpus[0].index}", whole_card


def _upstream_lines(s: Found, *, name: str, port: int, primary: str, whole_card: int) -> list[str]:
    """One found server's ``[[upstream]]`` table and its ``[upstream.models]``."""
    lines = [
        "[[upstream]]",
        f'name = "{name}"',
        f'adapter = "{s.adapter}"',
        f'listen = "0.0.0.0:{port}"   # borrowers connect here, with the borrow token',
        f'target = "http://{s.address}"',
        f'resource = "{primary}"',
        'on_owner_return = "drain"     # or "cancel", "finish" (docs/reclaim.md)',
    ]
    if s.adapter in ("ollama", "comfyui"):
        lines.append("yield_on_veto = true          # unload its models on reclaim")
    elif s.adapter == "vllm":
        if s.sleep_mode:
            lines.append("yield_on_veto = true          # sleep mode: sleep on reclaim")
        else:
            lines += [
                "# yield_on_veto = true        # needs the server started with",
                "#                             # VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode",
            ]
    sized = {m: mib for m, mib in s.models.items() if mib is not None}
    if sized:
        lines += [
            "",
            f"[upstream.models]   # size on disk + {FOOTPRINT_FACTOR - 1:.0%}: measure them",
            f"default_mib = {max(_footprint(v) for v in sized.values())}",
            "",
            "# `vacancyd measure` prints a table with this header: it replaces this one",
            "[upstream.models.footprint_mib]",
            *(f"{_toml_str(m)} = {_footprint(v)}" for m, v in sized.items()),
        ]
    elif s.models and whole_card:
        lines += [
            "",
            "[upstream.models]",
            f"# footprints of {', '.join(s.models)} are unknown: until you measure them",
            "# (vacancyd measure), each is charged the whole lendable card, so it is lent",
            "# only while the card is otherwise free.",
            f"default_mib = {whole_card}",
        ]
    elif s.models:
        lines += [
            "",
            "[upstream.models]",
            f"# WARNING: footprints of {', '.join(s.models)} are unknown. With 0, a model",
            "# is charged nothing and only the resource's min_free_mib protects the owner:",
            "# measure them (vacancyd measure) and set default_mib before lending.",
            "default_mib = 0",
        ]
    lines.append("")
    return lines


def _keep_free_mib(total_mib: float) -> int:
    """MiB of a GPU kept free for the owner: 10 % of it, at least 512, at most 2048."""
    return int(min(2048, max(512, total_mib * 0.1)))


def _writable_dir(path: Path) -> None:
    """Create ``path`` if needed and check it can be written; raises InitError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InitError(f"cannot create {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InitError(f"{path} is not writable (run as a user who may write there)")


def _write_token(path: Path) -> bool:
    """Create a token file (mode 0600) unless one exists; True when created."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise InitError(f"cannot create {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def write_config(text: str, path: Path, *, force: bool) -> list[str]:
    """Write the token files and then the config (atomically). Returns what was done, one
    line each. Raises InitError (an existing file without ``force``, an unwritable place)."""
    if path.exists() and not force:
        raise InitError(f"{path} exists; not overwriting it (use --force to replace it)")
    token_dir = path.parent / "tokens"
    _writable_dir(path.parent)
    _writable_dir(token_dir)
    try:
        token_dir.chmod(0o700)
    except OSError as exc:
        raise InitError(f"cannot restrict {token_dir}: {exc.strerror or exc}") from None
    done = []
    for name in ("admin", "borrow"):
        token = token_dir / f"{name}.token"
        done.append(f"created {token} (mode 0600)" if _write_token(token) else f"kept {token}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise InitError(f"cannot write {path}: {exc.strerror or exc}") from None
    done.append(f"wrote {path}")
    return done


def run_init(
    path: Path,
    *,
    candidates: list[str],
    timeout_s: float,
    state_dir: Path,
    force: bool,
    to_stdout: bool,
    gpus: bool = True,
) -> tuple[str, list[str]]:
    """Discover, render, check and (unless ``to_stdout``) write. Returns (config text,
    report lines). Raises InitError."""
    if not to_stdout and path.exists() and not force:
        raise InitError(f"{path} exists; not overwriting it (use --force to replace it)")
    found = asyncio.run(discover(candidates, timeout_s, gpus=gpus))
    text = render_config(
        found,
        token_dir=path.parent / "tokens",
        state_dir=state_dir,
        host=socket.gethostname(),
        when=dt.datetime.now().astimezone(),
    )
    try:
        settings = parse_config(text, "<vacancyd init>")
    except ConfigError as exc:  # a bug here, never the user's: say so plainly
        raise InitError(
            f"the generated config does not validate (please report this): {exc}"
        ) from exc
    report = [
        f"found {s.adapter} at {s.address}" + (f" ({len(s.models)} model(s))" if s.models else "")
        for s in found.servers
    ] + [f"skipped {m}" for m in found.missed]
    report.append(
        f"{len(found.gpus)} GPU(s) from {found.gpu_source}"
        if found.gpus
        else f"no GPU: {found.gpu_error}"
    )
    report += [f"warning: {advice}" for advice in config_warnings(settings)]
    if not to_stdout:
        report += write_config(text, path, force=force)
        report.append(f"next: vacancyd check-config {path}, then measure footprints")
    return text, report
