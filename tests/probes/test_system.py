import types

import psutil

from nbwatch.probes.system import SystemSampler, read_host, read_nvml
from tests.conftest import until


def fake_nvml(n=2):
    class NVMLError(Exception):
        pass

    def handle(i):
        return i

    m = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40 + h, memory=5),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(h + 1) * 2**30,
                                                                total=80 * 2**30),
        nvmlDeviceGetTemperature=lambda h, kind: 60 + h,
        nvmlDeviceGetPowerUsage=lambda h: 250_000,
    )
    return m, [handle(i) for i in range(n)]


def test_nvml_figures_per_gpu():
    nvml, handles = fake_nvml()
    f = read_nvml(nvml, handles)
    assert f["system/gpu0/util"] == 40 and f["system/gpu1/util"] == 41
    assert f["system/gpu1/mem_used_gb"] == 2.0 and f["system/gpu0/mem_total_gb"] == 80.0
    assert f["system/gpu1/temp_c"] == 61 and f["system/gpu0/power_w"] == 250.0


def test_nvml_board_without_power_reading_still_reports_the_rest():
    nvml, handles = fake_nvml(1)

    def no_power(h):
        raise nvml.NVMLError("not supported")

    nvml.nvmlDeviceGetPowerUsage = no_power
    f = read_nvml(nvml, handles)
    assert "system/gpu0/power_w" not in f and f["system/gpu0/util"] == 40


def test_host_figures_without_gpu():
    f = read_host(psutil, None)
    assert 0 <= f["system/cpu/util"] <= 100
    assert 0 < f["system/ram/used_gb"] <= f["system/ram/total_gb"]
    assert f["system/proc/rss_gb"] > 0


def test_sampler_thread_emits_and_stops():
    got = []
    s = SystemSampler(got.append, interval=0.05).start()
    try:
        until(lambda: len(got) >= 2, 10, "two samples")
    finally:
        s.stop()
    assert len(got) >= 2 and "system/cpu/util" in got[0]
