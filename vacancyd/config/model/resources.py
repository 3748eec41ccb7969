"""``[collectors]`` and ``[[resource]]``, with a GPU resource's ``pressure``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, model_validator

from vacancyd.config.model.base import FrozenModel, Name
from vacancyd.core.gpu import GpuSelector
from vacancyd.core.thermal import DEFAULT_RESUME_MARGIN_C


class CollectorSettings(FrozenModel):
    """Sampling cadence. ``poll_s`` is the general poll; probes past ``probe_timeout_s`` fail."""

    poll_s: float = Field(3.0, ge=0.1, le=300)
    probe_timeout_s: float = Field(2.0, gt=0, le=60)


class PressureSettings(FrozenModel):
    """GPU pressure for one ``kind = "gpu"`` resource.

    ``enabled``: attribute the GPU's per-process load and refuse while the owner presses it.
    ``poll_ms``: pressure sampling period (milliseconds); the gap limit is
    max(3 × poll_ms, 20 s). ``engage_after_s`` / ``release_after_s``: how long owner load must
    stay above / below the threshold before pressure engages / releases. ``threshold_cap``:
    the highest threshold (0–1 load) learning may reach. ``fixed_threshold``: a 0–1 threshold
    that replaces learning (the GPU is then lendable without calibration).
    ``calibration_s``: observed seconds before a learned threshold is trusted.
    ``rise_per_hour``: how far (0–1 load) a learned threshold may rise per observed hour.
    ``half_life_h``: observed hours after which a sample weighs half in the histogram.
    """

    enabled: StrictBool = True
    poll_ms: int = Field(2000, ge=100, le=60_000)
    engage_after_s: float = Field(4.0, ge=0, le=3600)
    release_after_s: float = Field(30.0, ge=0, le=86400)
    threshold_cap: float = Field(0.30, gt=0, le=1)
    fixed_threshold: float | None = Field(None, gt=0, le=1)
    calibration_s: float = Field(1800.0, ge=0, le=30 * 86400)
    rise_per_hour: float = Field(0.05, ge=0, le=1)
    half_life_h: float = Field(168.0, gt=0, le=24 * 365)

    @model_validator(mode="after")
    def _fixed_under_cap(self) -> PressureSettings:
        if self.fixed_threshold is not None and self.fixed_threshold > self.threshold_cap:
            raise ValueError("fixed_threshold is above threshold_cap")
        return self

    @property
    def poll_s(self) -> float:
        return self.poll_ms / 1000.0


class ResourceSettings(FrozenModel):
    """A declared resource (docs/configuration.md).

    ``device`` selects the GPU (gpu only): an NVML index (``0``), a UUID (``"GPU-…"``) or a
    PCI bus id (``"0000:01:00.0"``); unset means index 0. ``min_free_mib``: MiB that must stay
    free. ``max_utilization``: 0–1 ratio above which the resource is not lendable.
    ``stale_after_s``: default 3 × the general poll, at least 5 s. ``pressure``: GPU pressure
    settings (gpu only). ``max_temperature_c`` (gpu only, °C): new borrowed work is refused
    ``gpu_too_hot`` while the card is above it, until it is below ``temperature_resume_c``
    (default 5 °C less); ``hot_yield_after_s``: seconds above it after which running borrowed
    work is yielded by the reclaim policy (unset: never). ``lend_power_limit_w`` (gpu only,
    watts): the NVML power limit in force while borrowed work holds the card.
    """

    name: Name
    kind: Literal["gpu", "memory", "cpu"]
    enabled: StrictBool = True
    device: int | str | None = None
    min_free_mib: int = Field(0, ge=0)
    max_utilization: float | None = Field(None, ge=0, le=1)
    stale_after_s: float | None = Field(None, gt=0, le=3600)
    pressure: PressureSettings | None = None
    max_temperature_c: float | None = Field(None, gt=0, le=150)
    temperature_resume_c: float | None = Field(None, gt=0, le=150)
    hot_yield_after_s: float | None = Field(None, ge=0, le=86400)
    lend_power_limit_w: float | None = Field(None, gt=0, le=5000)

    @model_validator(mode="after")
    def _kind_rules(self) -> ResourceSettings:
        if self.kind == "cpu" and self.min_free_mib:
            raise ValueError("min_free_mib does not apply to a cpu resource (no byte capacity)")
        if self.kind != "gpu" and self.device is not None:
            raise ValueError("device applies only to kind = 'gpu'")
        if self.kind != "gpu" and self.pressure is not None:
            raise ValueError("pressure applies only to kind = 'gpu'")
        if self.kind != "gpu" and self.lend_power_limit_w is not None:
            raise ValueError("lend_power_limit_w applies only to kind = 'gpu'")
        self._thermal_rules()
        if self.kind == "gpu":
            GpuSelector.parse(self.device)  # raises ValueError with the reason
        return self

    def _thermal_rules(self) -> None:
        thermal = {
            "max_temperature_c": self.max_temperature_c,
            "temperature_resume_c": self.temperature_resume_c,
            "hot_yield_after_s": self.hot_yield_after_s,
        }
        for key, value in thermal.items():
            if value is not None and self.kind != "gpu":
                raise ValueError(f"{key} applies only to kind = 'gpu'")
            if value is not None and self.max_temperature_c is None:
                raise ValueError(f"{key} needs max_temperature_c")
        resume = self.resume_temperature_c
        if self.max_temperature_c is not None and resume is not None:
            if not 0 < resume < self.max_temperature_c:
                raise ValueError(
                    f"temperature_resume_c ({resume:g}) must be above 0 and below "
                    f"max_temperature_c ({self.max_temperature_c:g})"
                )

    @property
    def resume_temperature_c(self) -> float | None:
        """The temperature (°C) below which a hot GPU lends again: ``temperature_resume_c``,
        default ``max_temperature_c`` minus 5 °C; None without ``max_temperature_c``."""
        if self.max_temperature_c is None:
            return None
        if self.temperature_resume_c is not None:
            return self.temperature_resume_c
        return self.max_temperature_c - DEFAULT_RESUME_MARGIN_C

    @property
    def gpu_pressure(self) -> PressureSettings | None:
        """Effective pressure settings: on by default for a GPU, None when off or not a GPU."""
        if self.kind != "gpu":
            return None
        settings = self.pressure or PressureSettings()
        return settings if settings.enabled else None

    @property
    def device_key(self) -> str:
        """The GPU selector in normal form, for duplicate detection."""
        sel = GpuSelector.parse(self.device)
        return f"{sel.kind}:{sel.value.lower()}"
