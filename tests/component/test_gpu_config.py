"""GPU configuration keys (docs/configuration.md "[[resource]] (GPU keys)"), the calibration
cache's atomic writes and corrupt-file handling, and several GPUs as separate resources
 in a running daemon."""

from __future__ import annotations

import json
import os
from pathlib import Path

import aiohttp
import pytest

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.gpu import Gpu, Scenario
from vacancyd.config import ConfigError, parse_config
from vacancyd.config.policies import pressure_policy
from vacancyd.runtime import calibration


def gpu_toml(*resources: str) -> str:
    return "".join(
        f'[[resource]]\nname = "g{i}"\nkind = "gpu"\n{r}\n' for i, r in enumerate(resources)
    )


@pytest.mark.parametrize(
    "device",
    ["0", "3", '"GPU-0123abcd-0000-0000-0000-000000000000"', '"0000:01:00.0"', '"01:00.0"'],
)
def test_device_forms_are_accepted(device: str) -> None:
    settings = parse_config(gpu_toml(f"device = {device}"))
    assert settings.resource[0].device is not None


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (gpu_toml('device = "nonsense"'), "not an index"),
        (gpu_toml("device = 0", 'device = "0000:00:00.0"', "device = 0"), "same device"),
        (gpu_toml('device = "01:00.0"', 'device = "0000:01:00.0"'), "same device"),
        ('[[resource]]\nname = "ram"\nkind = "memory"\n[resource.pressure]\n', "only to kind"),
        (gpu_toml("[resource.pressure]\nfixed_threshold = 0.5\nthreshold_cap = 0.3"), "above"),
        (gpu_toml("[resource.pressure]\npoll_ms = 5"), "poll_ms"),
        (gpu_toml("[resource.pressure]\nsurprise = 1"), "surprise"),
    ],
)
def test_bad_gpu_config_is_refused(toml: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(toml)


def test_pressure_defaults_and_off_switch() -> None:
    settings = parse_config(gpu_toml("", "device = 1\n[resource.pressure]\nenabled = false"))
    on = pressure_policy(settings.resource[0])
    assert on is not None
    assert on.poll_s == 2.0 and on.max_gap_s == 20.0
    assert on.learner.cap == 0.30 and on.learner.fixed is None
    assert pressure_policy(settings.resource[1]) is None
    assert settings.state_dir == Path("/var/lib/vacancyd")


def test_calibration_cache_is_written_atomically(tmp_path: Path) -> None:
    calibration.save_calibration(tmp_path, "g0", {"version": 1, "gpu": "GPU-a"})
    calibration.save_calibration(tmp_path, "g0", {"version": 1, "gpu": "GPU-b"})
    files = os.listdir(tmp_path / "calibration")
    assert files == ["g0.json"]  # no temporary file left behind
    assert calibration.load_calibrations(tmp_path, ["g0", "g1"]) == {
        "g0": {"version": 1, "gpu": "GPU-b"}
    }


def test_unwritable_state_dir_raises_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        calibration.save_calibration(blocker, "g0", {})


@pytest.mark.parametrize("content", ["{oops", "[1, 2]", "\x00\xff"])
def test_corrupt_cache_is_ignored(tmp_path: Path, content: str) -> None:
    path = calibration.cache_path(tmp_path, "g0")
    path.parent.mkdir()
    path.write_text(content, encoding="utf-8", errors="surrogateescape")
    assert calibration.load_calibrations(tmp_path, ["g0"]) == {}


async def test_two_gpus_are_two_resources(nvml: Scenario, tmp_path: Path) -> None:
    """Several GPUs: pressure on one GPU refuses only the upstream that names it."""
    nvml.gpus = [
        Gpu(0, "GPU-aaaaaaaa-0000-0000-0000-000000000000", "00000000:01:00.0"),
        Gpu(1, "GPU-bbbbbbbb-0000-0000-0000-000000000000", "00000000:02:00.0", 8192, 100),
    ]
    nvml.write()
    a, _ = openai_like_app()
    b, _ = openai_like_app()
    async with serve_app(a) as ta, serve_app(b) as tb:
        toml = daemon_toml(
            upstream("on-big", ta, resource="big"),
            upstream("on-small", tb, resource="small"),
            resources=(
                gpu(
                    "big",
                    "GPU-aaaaaaaa-0000-0000-0000-000000000000",
                    pressure={
                        "poll_ms": 100,
                        "fixed_threshold": 0.2,
                        "engage_after_s": 0,
                        "release_after_s": 60,
                    },
                ),
                gpu("small", "0000:02:00.0", pressure={"poll_ms": 100, "fixed_threshold": 0.2}),
            ),
            collectors={"poll_s": 0.2},
            state_dir=tmp_path,
        )
        async with running_daemon(toml) as d:
            await d.wait_ready()
            nvml.sample(4_000_000, 90, gpu=0)
            nvml.write()
            await d.wait_until(lambda: d.state.pressure["big"].tracker.engaged)
            async with aiohttp.ClientSession() as s:
                codes = {}
                for name in ("on-big", "on-small"):
                    async with s.post(
                        d.proxy_url(name) + "/v1/chat/completions",
                        json={"model": "m", "messages": []},
                    ) as r:
                        codes[name] = (r.status, (await r.json()).get("error", {}).get("code"))
                async with s.get(d.api_url + "/status") as r:
                    doc = await r.json()
            assert codes == {"on-big": (503, "resource_pressured"), "on-small": (200, None)}
            assert doc["resources"]["small"]["total_mib"] == 8192
            assert doc["resources"]["small"]["pressure"]["gpu"].startswith("GPU-bbbbbbbb")
            assert not d.state.pressure["small"].tracker.engaged
        saved = (
            json.loads(calibration.cache_path(tmp_path, "big").read_text())
            if (calibration.cache_path(tmp_path, "big").exists())
            else None
        )
        assert saved is None  # a fixed threshold has nothing to save
