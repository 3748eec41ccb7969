"""The fake libnvidia-ml's temperature, energy and power-limit calls, through pynvml's own
code: the shapes and error codes vacancyd's thermal and power code is tested against
(tests/fakes/fake_nvml.c) are NVML's.
"""

from __future__ import annotations

import pynvml
import pytest

from tests.support.gpu import Gpu, Scenario


def _handle(index: int = 0) -> object:
    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def test_temperature_and_energy(nvml: Scenario) -> None:
    nvml.gpus = [Gpu(temp_c=71, energy_mj=123_456_789_012)]
    nvml.write()
    handle = _handle()
    assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 71
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) == 123_456_789_012
    nvml.gpus = [Gpu(temp_c=64, energy_mj=123_456_799_012)]
    nvml.write()
    assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 64
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) == 123_456_799_012


def test_a_card_without_the_counters_answers_not_supported(nvml: Scenario) -> None:
    handle = _handle()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetPowerManagementLimit(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, 200_000)


def test_injected_errors(nvml: Scenario) -> None:
    nvml.gpus = [Gpu(temp_c=50, energy_mj=1, power_mw=(300_000, 100_000, 350_000))]
    nvml.errors = {"temp": 15, "energy": 999, "powerget": 999, "powerset": 3}
    nvml.write()
    handle = _handle()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, 200_000)


def test_power_limit_get_set_and_its_refusals(nvml: Scenario) -> None:
    nvml.gpus = [Gpu(power_mw=(300_000, 100_000, 350_000))]
    nvml.euid = 0
    nvml.write()
    handle = _handle()
    assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == 300_000
    assert pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) == 300_000
    assert pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle) == [100_000, 350_000]
    pynvml.nvmlDeviceSetPowerManagementLimit(handle, 150_000)
    assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == 150_000
    assert pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) == 300_000
    nvml.write()  # the limit outlives a scenario rewrite, as the driver keeps it
    assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == 150_000
    assert nvml.power_limit_mw() == 150_000
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, 50_000)  # below the minimum
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, 400_000)  # above the maximum
    nvml.euid = 1000  # not root: the driver refuses
    nvml.write()
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, 300_000)
    assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == 150_000
    nvml.limits_path.unlink()  # the driver reloaded
    assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == 300_000


def test_limits_are_per_gpu(nvml: Scenario) -> None:
    nvml.gpus = [
        Gpu(0, power_mw=(300_000, 100_000, 350_000)),
        Gpu(1, "GPU-b", "00000000:02:00.0", power_mw=(200_000, 100_000, 250_000)),
    ]
    nvml.euid = 0
    nvml.write()
    pynvml.nvmlDeviceSetPowerManagementLimit(_handle(1), 120_000)
    pynvml.nvmlDeviceSetPowerManagementLimit(_handle(0), 250_000)
    assert pynvml.nvmlDeviceGetPowerManagementLimit(_handle(1)) == 120_000
    assert nvml.power_limit_mw(0) == 250_000
    assert nvml.power_limit_mw(1) == 120_000
