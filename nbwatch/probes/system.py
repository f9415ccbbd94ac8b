"""System figures: NVML per GPU where there is one, psutil otherwise, sampled every
`system_interval` s (1 s by default) onto the run's wall-clock timeline.

`read_nvml` and `read_host` are pure readers (the NVML module is passed in, so tests use a
fake one); `SystemSampler` is the thread that calls them and hands figures to a callback.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger("nbwatch.system")
GB = 1024**3
FINAL_MIN = 0.1  # s: a shorter last window reads CPU time in too coarse ticks


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


class CpuMeter:
    """CPU utilisation (% of all cores) since the previous reading, from this meter's own
    baseline: `psutil.cpu_percent(interval=None)` keeps one per process, so another caller
    (a second run's sampler, the user's own code) would shorten every window to a sliver."""

    def __init__(self, psutil: ModuleType):
        self._psutil = psutil
        self._last = psutil.cpu_times()

    @staticmethod
    def _busy_total(t: Any) -> tuple[float, float]:
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        return total - t.idle - getattr(t, "iowait", 0.0), total  # psutil's own accounting

    def percent(self) -> float:
        now = self._psutil.cpu_times()
        (b0, t0), (b1, t1) = self._busy_total(self._last), self._busy_total(now)
        self._last = now
        if t1 - t0 <= 0:
            return 0.0
        return float(min(max((b1 - b0) / (t1 - t0) * 100.0, 0.0), 100.0))


def read_host(psutil: ModuleType, torch_cuda: Any | None = None,
              cpu: CpuMeter | None = None) -> dict[str, float]:
    """CPU util % (since `cpu`'s previous reading; else since psutil's last call), RAM
    used/total GB, this process's RSS, and CUDA peak memory if CUDA exists."""
    vm = psutil.virtual_memory()
    out = {
        "system/cpu/util": cpu.percent() if cpu is not None
        else float(psutil.cpu_percent(interval=None)),
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
        self._cpu = CpuMeter(psutil)  # each reading covers the interval before it
        self._read_at = time.monotonic()

    def start(self) -> SystemSampler:
        self._thread.start()
        return self

    def read(self) -> dict[str, float]:
        figures = read_host(self._psutil, self._cuda, self._cpu)
        if self._nvml is not None:
            figures.update(read_nvml(self._nvml, self._handles))
        return figures

    def _loop(self) -> None:
        failed = False
        due = time.monotonic()
        while True:  # on a fixed grid of `interval`: a slow reading does not shift the rest
            due += self.interval
            if self._stop.wait(max(due - time.monotonic(), 0.0)):
                break
            now = time.monotonic()
            if now - due > self.interval / 2:  # woke late (a stall): restart the grid here,
                due = now                      # rather than catch up with a burst
            try:
                self._emit()
            except Exception:  # a sampler error must not stop training; say so once
                if not failed:
                    log.exception("nbwatch system sampler failed; system figures may be missing")
                failed = True

    def _emit(self) -> None:
        figures = self.read()
        self._read_at = time.monotonic()
        self.emit(figures)

    def stop(self) -> None:
        """Stop the thread, after one last reading of the time since the previous one (if
        at least `FINAL_MIN` s): a run shorter than one interval still has a sample."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if (self._thread.ident is not None and not self._thread.is_alive()
                and time.monotonic() - self._read_at >= FINAL_MIN):
            with contextlib.suppress(Exception):  # the store may have failed: it said so
                self._emit()
        close_nvml(self._nvml)
        self._nvml, self._handles = None, []  # NVML closed: no handles left
