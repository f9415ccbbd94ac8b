"""`benchmarks/gpu_check.py` is what a session with a GPU runs first, and CI never has
one: its code runs here on small shapes in the GPU's order (decided on the device, read
a step later), so that the script works the first time it meets a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import nbwatch

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_every_loop_on_small_shapes_in_the_gpus_order(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick",
         "--gpu-order", "--only", "gpt2,trainer,foreach,clip", "--steps", "6",
         "--trace", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "FAILED" not in out, out[-3000:]
    rows = [line.split("|")[1:4] for line in proc.stdout.splitlines()
            if line.startswith("| ") and "bare ms/step" not in line]
    got = {(w.strip(), v.strip()) for w, _, v in rows}
    assert got == {("gpt2", "log"), ("gpt2", "start"), ("trainer", "callback"),
                   ("foreach", "log"), ("foreach", "start"), ("clip", "log")}, proc.stdout
    for line in proc.stdout.splitlines():  # each watched run recorded its own time
        if line.startswith("| ") and "bare ms/step" not in line:
            own, _, step = line.rsplit("|", 2)[-2].split("·")
            assert float(own) > 0 and float(step) > 0, line
    for name in ("gpt2", "foreach", "clip"):  # each own loop's traces, bare and watched
        for v in ("bare", "log"):
            assert (tmp_path / f"{name}-{v}.json").stat().st_size > 0
            assert "Optimizer.step" in (tmp_path / f"{name}-{v}.txt").read_text()


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules["gpu_check"])
    return sys.modules["gpu_check"]


def test_the_sync_count_blames_nbwatch_only_for_syncs_under_its_code():
    """A sync the loop makes itself (the Trainer checks each step's loss for NaN on the
    host) is the loop's, not nbwatch's, also where nbwatch's runner calls the loop's
    step_fn; one made under nbwatch's code is nbwatch's; other warnings are shown."""
    gc = _script()

    def defined_in(path: Path) -> Any:
        ns: dict[str, Any] = {}
        exec(compile("def call(f):\n    return f()\n", str(path), "exec"), ns)
        return ns["call"]

    in_nbwatch = defined_in(Path(nbwatch.__file__).parent / "recorder" / "_fake.py")
    in_script = defined_in(Path(gc.__file__))

    def sync() -> None:
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    with pytest.warns(UserWarning, match="other"), gc.SyncCounter(cuda=False) as counter:
        counter.on = True
        sync()  # the loop's own
        in_nbwatch(sync)  # under nbwatch's code
        in_nbwatch(lambda: in_script(sync))  # start() calling the script's step_fn
        other = threading.Thread(target=in_nbwatch, args=(sync,))  # any thread
        other.start()
        other.join()
        warnings.warn("other", UserWarning, stacklevel=1)
        counter.on = False
        sync()  # outside the window
    assert (counter.count, counter.loop) == (2, 2)


def test_each_run_folder_goes_once_measured(tmp_path):
    """Every watched run ends with a final checkpoint (1.5 GB for GPT-2 124M): a workload
    keeps none of its runs' folders, the Trainer's output folders neither."""
    gc = _script()
    said: list[str] = []
    for w in gc.workloads(quick=True):
        if w.name in ("tiny", "trainer"):
            w.rounds = 1
            gc.measure(w, "cpu", 2, tmp_path / w.name, said.append)
            assert w.times and w.own, w.name
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["tiny", "trainer"], (left, said)  # the workloads' folders, empty


def test_the_packed_and_padded_workloads_record_their_rows_figures(tmp_path, monkeypatch):
    """The `packed` and `padded` workloads measure the data figures' path on a GPU: their
    watched runs, in the GPU's order and with the documents' lengths counted as an
    accelerator counts them, record tokens and lengths as counted by hand from the same
    batches (each document of a packed row a sample, each padded row its mask's sum)."""
    from nbwatch.probes import data as data_probe
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", True)
    monkeypatch.setattr(data_probe, "EXACT_ON_CPU", False)
    gc = _script()
    kinds = [w for w in gc.workloads(quick=True) if w.rows != "ids"]
    assert sorted(w.rows for w in kinds) == ["packed", "padded"]
    for w in kinds:
        w.model = w.make()
        gc.own_loop(w, "cpu", 4, tmp_path / w.name, True, None)
        df = nbwatch.open_run(tmp_path / w.name).df
        data = gc.batches(w, "cpu")
        for step in df.index[df["tokens/real"].notna()]:
            b = data[(step - 1) % len(data)]
            if w.rows == "packed":
                tokens = b["input_ids"].numel()
                docs = int((b["position_ids"] == 0).sum())
            else:
                tokens = int(b["attention_mask"].sum())
                docs = len(b["attention_mask"])
            assert df.loc[step, "tokens/real"] == tokens, (w.name, step)
            assert df.loc[step, "data/seq_len_mean"] == pytest.approx(tokens / docs), (w.name, step)
        assert df["tokens/real"].notna().sum() >= 10, w.name
