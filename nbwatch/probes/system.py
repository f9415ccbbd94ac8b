"""System figures: NVML per GPU where there is one, psutil otherwise, sampled at ~1 Hz.

`read_nvml` and `read_host` are pure readers (the NVML module is passed in, so tests use a
fake one); `SystemSampler` is the thread that calls them and hands figures to a callback.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger("nbwatch.system")
GB = 1024**3


def open_nvml() -> tuple[ModuleType | None, list[Any]]:
    """(pynvml, device handles), or (None, []) where there is no NVIDIA driver or package."""
    try:
        import pynvml
    except ImportError:
        return None, []
    try:
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    except pynvml.NVMLError:  # no driver / no GPU: fall back to psutil
        return None, []


def close_nvml(nvml: ModuleType | None) -> None:
    """Undo one open_nvml() (NVML counts its inits)."""
    if nvml is not None:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def gpu_names(nvml: ModuleType | None, handles: list[Any]) -> list[str]:
    if nvml is None:
        return []
    names = []
    for h in handles:
        name = nvml.nvmlDeviceGetName(h)
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


def read_nvml(nvml: ModuleType, handles: list[Any]) -> dict[str, float]:
    """Util %, memory used/total GB, temperature °C and power W of each GPU."""
    out: dict[str, float] = {}
    for i, h in enumerate(handles):
        p = f"system/gpu{i}"
        util = nvml.nvmlDeviceGetUtilizationRates(h)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        out[f"{p}/util"] = float(util.gpu)
        out[f"{p}/mem_used_gb"] = mem.used / GB
        out[f"{p}/mem_total_gb"] = mem.total / GB
        try:
            out[f"{p}/temp_c"] = float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
            out[f"{p}/power_w"] = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        except nvml.NVMLError:  # not every board reports these
            pass
    return out


def read_host(psutil: ModuleType, torch_cuda: Any | None = None) -> dict[str, float]:
    """CPU util %, RAM used/total GB, this process's RSS, and CUDA peak memory if CUDA exists."""
    vm = psutil.virtual_memory()
    out = {
        "system/cpu/util": float(psutil.cpu_percent(interval=None)),
        "system/ram/used_gb": (vm.total - vm.available) / GB,
        "system/ram/total_gb": vm.total / GB,
        "system/proc/rss_gb": psutil.Process().memory_info().rss / GB,
    }
    if torch_cuda is not None and torch_cuda.is_available():
        for i in range(torch_cuda.device_count()):
            out[f"system/gpu{i}/max_allocated_gb"] = torch_cuda.max_memory_allocated(i) / GB
    return out


class SystemSampler:
    """Daemon thread: every `interval` s, read the system figures and pass them to `emit`."""

    def __init__(self, emit: Callable[[dict[str, float]], None], interval: float = 1.0):
        import psutil
        import torch

        self.emit = emit
        self.interval = interval
        self._psutil = psutil
        self._cuda = torch.cuda
        self._nvml, self._handles = open_nvml()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbwatch-system", daemon=True)
        psutil.cpu_percent(interval=None)  # first call primes the counter

    def start(self) -> SystemSampler:
        self._thread.start()
        return self

    def read(self) -> dict[str, float]:
        figures = read_host(self._psutil, self._cuda)
        if self._nvml is not None:
            figures.update(read_nvml(self._nvml, self._handles))
        return figures

    def _loop(self) -> None:
        failed = False
        while not self._stop.wait(self.interval):
            try:
                self.emit(self.read())
            except Exception:  # a sampler error must not stop training; say so once
                if not failed:
                    log.exception("nbwatch system sampler failed; system figures may be missing")
                failed = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        close_nvml(self._nvml)
        self._nvml = None
