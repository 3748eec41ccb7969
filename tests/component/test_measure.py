"""``vacancyd measure`` and ``vacancyd profiles`` against the look-alike Ollama on a fake GPU:
what fits is written, what spills or does not exist is reported and not written, what it
loaded is unloaded again (also on Ctrl-C, which writes nothing), and it refuses to run while
the owner is here or borrowed work runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import running_daemon, serve_app
from tests.support.fake_ollama import FakeOllama, ModelSpec
from tests.support.gpu import Gpu, Scenario
from vacancyd.config import parse_config
from vacancyd.runtime import measure, profiles

FITS = ModelSpec(weights_mib=3_000, kv_mib_per_1k=100, digest="a1" * 32)
HUGE = ModelSpec(weights_mib=30_000, kv_mib_per_1k=100, digest="b2" * 32)
IDLE: dict[str, Any] = {
    "presence": {"veto": {"active": False}, "refuses": True, "evidence_complete": True},
    "upstreams": {"up": {"active_work": []}},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(
    target: str, api: int = 0, footprints: Mapping[str, int] | None = None, on_gpu: bool = True
) -> str:
    """One Ollama upstream ``up`` on the GPU ``gpu0`` (``on_gpu``; else on system memory,
    ``ram``); ``footprints`` (MiB by model, 1 MiB each for ``small``,
    ``huge`` and ``ghost`` by default) are what ``vacancyd measure`` is asked to measure."""
    if footprints is None:
        footprints = {"small": 1, "huge": 1, "ghost": 1}
    if not on_gpu:
        return daemon_toml(
            upstream("up", target, adapter="ollama", models={"footprint_mib": footprints}),
            server={"listen": f"127.0.0.1:{api}"},
        )
    return daemon_toml(
        upstream(
            "up", target, adapter="ollama", resource="gpu0", models={"footprint_mib": footprints}
        ),
        resources=(gpu("gpu0", 0),),
        server={"listen": f"127.0.0.1:{api}"},
    )


def fake(nvml: Scenario, **kw: Any) -> FakeOllama:
    nvml.gpus = [Gpu(total_mib=16_384, used_mib=512)]
    nvml.write()
    return FakeOllama(
        models=("small:latest", "huge:latest"),
        specs={"small:latest": FITS, "huge:latest": HUGE},
        scenario=nvml,
        **kw,
    )


async def test_measure_writes_what_fits_reports_the_rest_and_unloads(nvml: Scenario) -> None:
    ollama = fake(nvml)
    async with serve_app(ollama.app()) as target:
        settings = parse_config(config(target), "<test>")
        results = await measure.run_measure(
            settings,
            upstreams=[],
            models=[],
            num_ctx=8192,
            headroom_mib=500,
            lender_status=IDLE,
            out=sys.stderr,
        )
    by_model = {m.model: m for m in results}
    small = by_model["small:latest"]
    assert small.measured_mib == pytest.approx(3_800) and small.footprint_mib == 4_300
    assert small.digest == FITS.digest and small.num_ctx == 8192
    assert by_model["huge:latest"].footprint_mib is None
    assert "spilled to system memory" in by_model["huge:latest"].note
    assert by_model["ghost:latest"].note == "no such model"
    assert ollama.loads == [("small:latest", 8192), ("huge:latest", 8192)]
    assert ollama.loaded == {}  # everything it loaded is unloaded again
    assert nvml.gpus[0].used_mib == 512
    text = measure.render_toml(results, 500)
    assert '"small:latest" = 4300' in text
    assert '# "huge:latest": not written: spilled' in text
    assert '# "ghost:latest": not written: no such model' in text
    assert "[upstream.models.footprint_mib]" in text


async def test_on_a_memory_resource_the_whole_size_is_the_footprint() -> None:
    """A CPU-only host (``size_vram`` 0) measured on a memory resource: ``size`` is what the
    model takes, not a spill to report."""
    ollama = FakeOllama(models=("small:latest",), specs={"small:latest": FITS}, cpu_only=True)
    async with serve_app(ollama.app()) as target:
        toml = daemon_toml(
            upstream("up", target, adapter="ollama", models={"footprint_mib": {"small": 1}})
        )
        settings = parse_config(toml, "<test>")
        results = await measure.run_measure(
            settings,
            upstreams=[],
            models=[],
            num_ctx=4096,
            headroom_mib=100,
            lender_status=IDLE,
        )
    (small,) = results
    assert small.footprint_mib == 3_000 + 400 + 100, small  # weights + 4096 tokens of cache
    assert small.note == ""
    assert ollama.loaded == {}


async def test_a_model_the_owner_loaded_is_read_and_left_alone(nvml: Scenario) -> None:
    ollama = fake(nvml)
    async with serve_app(ollama.app()) as target:
        import aiohttp

        async with (
            aiohttp.ClientSession() as s,
            s.post(
                target + "/api/generate", json={"model": "small", "options": {"num_ctx": 4096}}
            ) as r,
        ):
            assert r.status == 200
        settings = parse_config(config(target), "<test>")
        (result,) = await measure.run_measure(
            settings,
            upstreams=["up"],
            models=["small"],
            num_ctx=4096,
            headroom_mib=0,
            lender_status=IDLE,
        )
    assert result.footprint_mib == 3_400
    assert "small:latest" in ollama.loaded and not ollama.unload_requests


@pytest.mark.parametrize(
    ("status", "why"),
    [
        ({"presence": {"veto": {"active": True}}}, "owner is using this machine"),
        ({"presence": {"refuses": True, "evidence_complete": False}}, "not known clearly"),
        (
            {
                "presence": {"veto": {"active": False}, "evidence_complete": True},
                "upstreams": {"up": {"active_work": [{"job": 1}]}},
            },
            "borrowed work is active",
        ),
    ],
)
async def test_measure_refuses_while_the_owner_is_here_or_work_runs(
    status: dict[str, Any], why: str
) -> None:
    settings = parse_config(config("http://127.0.0.1:9"), "<test>")
    with pytest.raises(measure.MeasureError, match=why):
        await measure.run_measure(
            settings, upstreams=[], models=[], num_ctx=4096, headroom_mib=0, lender_status=status
        )


async def test_an_upstream_that_is_down_is_a_clear_error() -> None:
    port = free_port()
    settings = parse_config(config(f"http://127.0.0.1:{port}"), "<test>")
    with pytest.raises(measure.MeasureError, match="cannot be reached"):
        await measure.run_measure(
            settings, upstreams=[], models=[], num_ctx=4096, headroom_mib=0, lender_status=IDLE
        )
    with pytest.raises(measure.MeasureError, match="no upstream named nope"):
        await measure.run_measure(
            settings,
            upstreams=["nope"],
            models=[],
            num_ctx=4096,
            headroom_mib=0,
            lender_status=IDLE,
        )


async def test_nothing_to_measure_is_an_error_naming_why() -> None:
    """No model listed and none asked for: an error saying so, not an empty table."""
    settings = parse_config(config("http://127.0.0.1:9", footprints={}), "<test>")
    with pytest.raises(measure.MeasureError, match=r"nothing to measure: up: no models listed"):
        await measure.run_measure(
            settings, upstreams=[], models=[], num_ctx=4096, headroom_mib=0, lender_status=IDLE
        )


async def test_the_command_fails_when_there_is_nothing_to_measure(tmp_path: Path) -> None:
    path = tmp_path / "vacancyd.toml"
    toml = config("http://127.0.0.1:9", api=free_port(), footprints={}, on_gpu=False)
    path.write_text(toml, encoding="utf-8")
    out = tmp_path / "footprints.toml"
    async with running_daemon(path.read_text(encoding="utf-8")) as d:
        await d.wait_ready()
        proc = await cli("measure", "--config", str(path), "--output", str(out))
        stdout, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1, err.decode()
    assert b"nothing to measure: up: no models listed" in err
    assert b"--model" in err and stdout == b""
    assert not out.exists()


async def cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vacancyd",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_the_command_writes_toml_and_a_profile_and_ctrl_c_writes_nothing(
    nvml: Scenario, tmp_path: Path
) -> None:
    ollama = fake(nvml)
    async with serve_app(ollama.app()) as target:
        path = tmp_path / "vacancyd.toml"
        path.write_text(config(target, api=free_port(), footprints={"small": 1}), encoding="utf-8")
        async with running_daemon(path.read_text(encoding="utf-8")) as d:
            await d.wait_ready()
            out, profile = tmp_path / "footprints.toml", tmp_path / "profile.json"
            proc = await cli(
                "measure", "--config", str(path), "--output", str(out), "--profile", str(profile)
            )
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            assert b"loading small:latest" in err  # progress
            assert '"small:latest" = 3900' in out.read_text(encoding="utf-8")
            (entry,) = json.loads(profile.read_text(encoding="utf-8"))["profiles"]
            assert entry["digest"] == FITS.digest and entry["footprint_mib"] == 3900
            assert ollama.loaded == {}

            # Ctrl-C while the model loads: it is unloaded again and nothing is written.
            ollama.load_delay_s = 30.0
            stopped = tmp_path / "interrupted.toml"
            proc = await cli("measure", "--config", str(path), "--output", str(stopped))
            await d.wait_until(lambda: "small:latest" in ollama.loaded, 30)
            proc.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 130, err.decode()
            assert b"nothing written" in err
            assert not stopped.exists()
            assert not [p for p in os.listdir(tmp_path) if p.startswith(".interrupted")]
            await d.wait_until(lambda: ollama.loaded == {}, 10)
            assert ollama.unload_requests[-1] == "small:latest"


async def test_profiles_apply_only_to_the_same_build(nvml: Scenario, tmp_path: Path) -> None:
    ollama = fake(nvml)
    async with serve_app(ollama.app()) as target:
        settings = parse_config(config(target, footprints={"small": 4300}), "<test>")
        (up,) = settings.upstream
        exported = await profiles.export_profiles(up)
        assert [(p.model, p.digest, p.footprint_mib) for p in exported] == [
            ("small:latest", FITS.digest, 4300)
        ]
        other = profiles.Profile("huge:latest", "ff" * 32, 20_000, None, "ollama")
        missing = profiles.Profile("ghost:latest", "cc" * 32, 100, None, "ollama")
        applied, skipped = await profiles.import_profiles(up, [*exported, other, missing])
    assert [(m.model, m.footprint_mib) for m in applied] == [("small:latest", 4300)]
    assert any("another build" in s for s in skipped)
    assert any("not pulled" in s for s in skipped)
    text = json.dumps(profiles.to_json(exported))
    assert profiles.from_json(text, "p.json") == exported
    for bad, why in (
        ("{", "not valid JSON"),
        ('{"kind": "other"}', "not a vacancyd footprint profile"),
        ('{"kind": "vacancyd-footprints", "version": 9, "profiles": []}', "version 9"),
        (
            '{"kind": "vacancyd-footprints", "version": 1, "profiles": [{"model": "m", '
            '"footprint_mib": -5}]}',
            "footprint_mib",
        ),
    ):
        with pytest.raises(ValueError, match=why):
            profiles.from_json(bad, "p.json")
