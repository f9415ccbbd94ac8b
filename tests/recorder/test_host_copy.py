"""The step path reads no device value outside `host_copy` (recorder/host_copy.py), and a
step's figures are read at a later boundary, in every loop. CI has no GPU: these tests
run the accelerator's order on the CPU (`DEFER_ON_CPU`) with torch's reading methods
patched during steady steps, and name any nbwatch line that reads a tensor itself (on a
GPU each would be a sync: the host waiting for the device)."""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nbwatch
from nbwatch.demo import make_demo
from nbwatch.recorder import host_copy, step_end
from tests.conftest import own_step

PACKAGE = Path(nbwatch.__file__).parent
FRAMEWORKS = {"transformers", "lightning", "accelerate"}  # their own reads: a bare fit's too
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__")
# Host figures by construction: CPU masks and logits rows a step keeps for its record
# (probes/late.py), CPU masks read in place (`host_figures`), a packed step's documents'
# counts once they came with its copy (`LengthCounts.lengths`), and the CRC of CPU token
# ids (recorder/batches.py): a GPU tensor never is one of those. A file, or a file's
# function ("file:function").
# The ranks' exchange goes over nbwatch's own gloo group: host objects by construction.
HOST_ONLY = {"probes/late.py", "probes/logit_rows.py", "probes/data.py:host_figures",
             "probes/data.py:lengths", "recorder/batches.py", "distributed.py"}


class Audit:
    """Reads of a tensor on the step path, by the nbwatch line that made them, and when
    each step's figures were read."""

    def __init__(self) -> None:
        self.on = False
        self.reads: list[str] = []
        self.read_at: list[tuple[int, int]] = []  # (step, the run's step when read)

    def install(self, set_attr) -> Audit:
        """The GPU's order on the CPU, and the watch on torch's reading methods, set with
        `set_attr` (a test's `monkeypatch.setattr`, or `setattr` in a script)."""
        set_attr(host_copy, "DEFER_ON_CPU", True)
        for name in READS:
            real = getattr(torch.Tensor, name)

            def read(t, *a, _real=real, _name=name, **k):
                if self.on and not host_copy.reading():
                    where = _reader(sys._getframe(1))
                    if where is not None:
                        self.reads.append(f"{_name} at {where}")
                return _real(t, *a, **k)

            set_attr(torch.Tensor, name, read)
        complete = step_end.complete

        def completing(rec, step, *args, **kw):
            if self.on:
                self.read_at.append((step, rec.step))
            return complete(rec, step, *args, **kw)

        set_attr(step_end, "complete", completing)
        return self

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps({"reads": self.reads, "read_at": self.read_at}))


def _host_only(rel: str, frame) -> bool:
    return rel in HOST_ONLY or f"{rel}:{frame.f_code.co_name}" in HOST_ONLY


def _reader(frame) -> str | None:
    """The innermost caller that is nbwatch's or the user's: nbwatch's line (None: the
    user's own read, the optimizer's own (a bare loop's too), or one of nbwatch's
    host-only figures)."""
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.parent.name == "optim" and path.parent.parent.name == "torch":
            return None
        if "site-packages" in path.parts and path.parts[path.parts.index(
                "site-packages") + 1] in FRAMEWORKS:
            return None
        if PACKAGE in path.parents:
            rel = path.relative_to(PACKAGE).as_posix()
            return None if _host_only(rel, frame) else f"{rel}:{frame.f_lineno}"
        if "site-packages" not in path.parts and "lib" not in path.parts[-3:-1] \
                and not str(path).startswith(sys.prefix) and "<" not in str(path):
            return None  # the user's code (this test) reads: not nbwatch's
        frame = frame.f_back
    return None


@pytest.fixture
def audit(monkeypatch):
    return Audit().install(monkeypatch.setattr)


STEPS, STEADY = 30, range(5, 26)  # steady: no eval or checkpoint step


def window(a: Audit, step: int) -> None:
    """At the start of step `step + 1`: the audit on for the steady steps."""
    a.on = step + 1 in STEADY


def check(a: Audit) -> None:
    check_reads(a.reads, a.read_at)


def check_reads(reads: list[str], read_at: list) -> None:
    assert not reads, "nbwatch read a tensor on the step path:\n" + "\n".join(
        dict.fromkeys(reads))
    assert len(read_at) >= len(STEADY) - 2, read_at
    assert all(at > s for s, at in read_at), read_at  # each one read a step later


def monitor(tmp_path, demo, hist_every=10**6, **kw):
    return nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                           display=False, hist_every=hist_every, **kw)


def has_histograms(run_dir, every: int, lengths: bool = True) -> None:
    """Every histogram step in the window was recorded: its weight histograms (computed
    on the device, read with its copy), its update ratios and (`lengths`: the loop gave
    a mask) its sequence lengths."""
    run = nbwatch.open_run(run_dir)
    due = [s for s in STEADY if s % every == 0]
    ratios = [c for c in run.df.columns if c.startswith("update_ratio/")]
    assert ratios and run.df.loc[due, ratios].notna().all().all()
    for name in ratios[:2]:
        steps, _, _ = run.histograms(name.replace("update_ratio/", "weight/"))
        assert set(due) <= set(steps.tolist()), (name, steps)
    if lengths:
        assert set(due) <= set(run.histograms("data/seq_len")[0].tolist())


def test_an_own_loop_reads_nothing_on_the_step_path(tmp_path, audit):
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, max_steps=STEPS)
    m, opt = demo.model, demo.optimizer
    with monitor(tmp_path, demo, hist_every=5, clip=1.0) as mon:  # histogram steps too
        for i, b in enumerate(itertools.islice(itertools.cycle(demo.train), STEPS), 1):
            window(audit, i - 1)
            own_step(mon, m, opt, b, demo.scheduler)
        audit.on = False
    check(audit)
    has_histograms(tmp_path / "r", 5)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == list(range(1, STEPS + 1))
    assert df[["loss/train", "grad_norm/global", "grad_norm/clipped"]].notna().all().all()
    assert (df["grad_norm/clipped"] <= 1.0 + 1e-5).all()  # clipped on the device


def test_an_own_loop_that_clips_itself_reads_nothing_on_the_step_path(tmp_path, audit):
    """nanoGPT's loop: `clip_grad_norm_(model.parameters(), 1.0)` of its own before each
    `optimizer.step()` (nbwatch records the norms before that clip, and divides it out)."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, max_steps=STEPS)
    m, opt = demo.model, demo.optimizer
    with monitor(tmp_path, demo) as mon:
        for i, b in enumerate(itertools.islice(itertools.cycle(demo.train), STEPS), 1):
            window(audit, i - 1)
            own_step(mon, m, opt, b, demo.scheduler,
                     clip=lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
        audit.on = False
    check(audit)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == list(range(1, STEPS + 1))
    assert df[["grad_norm/global", "grad_norm/clipped"]].notna().all().all()
    assert (df["grad_norm/clipped"] <= 0.5 + 1e-5).all()
    assert (df["grad_norm/global"] > 0.5).any()  # the norms before the loop's own clip


def test_an_own_loop_of_packed_micro_batches_reads_nothing_on_the_step_path(tmp_path, audit,
                                                                          monkeypatch):
    """Packed rows (position_ids, no attention_mask) and a padded micro-batch handed over
    as `batch=[...]`, and the micro-batches' losses as `loss=[...]`: their documents' and
    padded rows' figures (their lengths as a device counts them, by length) and mean loss
    are device figures, in the step's one copy."""
    from nbwatch.probes import data

    monkeypatch.setattr(data, "EXACT_ON_CPU", False)
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, max_steps=STEPS)
    m, opt = demo.model, demo.optimizer
    g = torch.Generator().manual_seed(0)

    def row() -> dict[str, torch.Tensor]:
        lengths = [5, 11, 16]
        return {"input_ids": torch.randint(1, 60, (1, 32), generator=g),
                "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}

    def padded() -> dict[str, torch.Tensor]:  # two rows, 32 and 20 tokens real
        mask = torch.ones(2, 32, dtype=torch.long)
        mask[1, 20:] = 0
        return {"input_ids": torch.randint(1, 60, (2, 32), generator=g), "attention_mask": mask}

    with monitor(tmp_path, demo, hist_every=5) as mon:
        for i in range(1, STEPS + 1):
            window(audit, i - 1)
            batches, losses = [row(), row(), padded()], []
            for b in batches:
                logits = m(b["input_ids"])
                loss = torch.nn.functional.cross_entropy(logits[0, :-1], b["input_ids"][0, 1:])
                (loss / 3).backward()
                losses.append(loss.detach())
            opt.step()
            demo.scheduler.step()
            opt.zero_grad(set_to_none=True)
            mon.log(loss=losses, batch=batches)
        audit.on = False
    check(audit)
    has_histograms(tmp_path / "r", 5)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == list(range(1, STEPS + 1))
    # 6 documents (64 tokens) and 2 padded rows (52 of their 64 tokens)
    assert (df["tokens/real"] == 116).all()
    assert df["data/seq_len_mean"].tolist() == pytest.approx([116 / 8] * STEPS)
    assert (df["data/seq_len_max"] == 32).all()
    _, edges, counts = nbwatch.open_run(tmp_path / "r").histograms("data/seq_len")
    every = [5, 11, 16, 5, 11, 16, 32, 20] * 5  # the 5 steps since the histogram before
    assert (np.histogram(every, bins=edges[-1])[0] == counts[-1]).all()


def test_start_reads_nothing_on_the_step_path(tmp_path, audit):
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, max_steps=STEPS)
    mon = monitor(tmp_path, demo, hist_every=5)  # histogram steps too

    def step_fn(model, batch):
        window(audit, mon.step)
        return demo.step_fn(model, batch)

    mon.start(step_fn, itertools.cycle(demo.train), max_steps=STEPS, display=False).wait()
    audit.on = False
    assert mon.state == "finished", mon.error
    check(audit)
    has_histograms(tmp_path / "r", 5)
    assert mon.df.index.tolist() == list(range(1, STEPS + 1))


def test_the_trainer_reads_nothing_on_the_step_path(tmp_path, audit):
    pytest.importorskip("transformers")
    from transformers import TrainerCallback

    import nbwatch.hf
    from tests.test_hf import make_trainer

    class Window(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            window(audit, state.global_step)

    trainer = make_trainer(tmp_path / "out", max_steps=STEPS, eval_strategy="no")
    trainer.add_callback(Window())
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "r", display=False,
                           monitor={"hist_every": 5})  # histogram steps too
    run.wait()
    audit.on = False
    assert run.state == "finished", run.error
    check(audit)
    has_histograms(tmp_path / "r", 5, lengths=False)


def test_lightning_reads_nothing_on_the_step_path(tmp_path, audit):
    pytest.importorskip("lightning.pytorch")
    import lightning.pytorch as L

    import nbwatch.lightning
    from tests.test_lightning import TinyModule, loader, make_trainer

    class Window(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            window(audit, trainer.global_step)

    torch.manual_seed(0)
    trainer = make_trainer(tmp_path / "pl", max_steps=STEPS, val_check_interval=None,
                           limit_val_batches=0, callbacks=[Window()])
    run = nbwatch.lightning.start(trainer, TinyModule(), train_dataloaders=loader(STEPS),
                                  run_dir=tmp_path / "r", display=False,
                                  monitor={"hist_every": 5})  # histogram steps too
    run.wait()
    audit.on = False
    assert run.state == "finished", run.error
    check(audit)
    has_histograms(tmp_path / "r", 5, lengths=False)


def test_torchrun_reads_nothing_on_the_step_path(tmp_path):
    """An own loop under `torchrun --nproc_per_node=2` (DDP on gloo): neither rank reads a
    tensor on the step path, and the ranks' exchange rides on the steps already read."""
    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(root / "tests" / "scripts" / "ddp_train.py"), str(run_dir), str(STEPS)],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root), "LOOP": "own", "AUDIT": "1",
                       "STEP_SLEEP": "0"},
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((run_dir / f"audit_rank{rank}.json").read_text())
        check_reads(got["reads"], got["read_at"])
    assert nbwatch.open_run(run_dir).df.index.tolist() == list(range(1, STEPS + 1))
    has_histograms(run_dir, 5)  # histogram steps in the window too


class Launches(TorchDispatchMode):
    """The ops nbwatch's own lines dispatch during steady steps: those that launch a
    kernel on a GPU (not views), and those that would make the host wait there (a read,
    an output sized by the data, host data made into a tensor: an upload)."""

    WAITS = {"aten._local_scalar_dense.default", "aten.nonzero.default",
             "aten.masked_select.default", "aten._unique2.default",
             "aten.unique_consecutive.default", "aten.unique_dim.default",
             "aten.lift_fresh.default", "aten.repeat_interleave.Tensor"}

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.launches: collections.Counter[str] = collections.Counter()
        self.waits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            where = _launcher(sys._getframe(1))
            name = str(func)
            bool_index = func is torch.ops.aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1])
            if where is not None and (name in self.WAITS or bool_index):
                self.waits.append(f"{name} at {where}")
            elif where is not None and not func.is_view:
                self.launches[where] += 1
        return func(*args, **(kwargs or {}))


def _launcher(frame) -> str | None:
    """The innermost nbwatch line under `frame`, unless it is the demo's model or the
    loss the loop calls (the user's work) or one of nbwatch's host-only figures."""
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if PACKAGE in path.parents:
            rel = path.relative_to(PACKAGE).as_posix()
            users = rel in ("demo.py", "probes/loss.py")
            return None if _host_only(rel, frame) or users else f"{rel}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def launches_a_step(tmp_path, layers: int, monkeypatch, **kw) -> tuple[float, list[str]]:
    """nbwatch's kernel launches a steady step in the GPU's order (foreach optimizer,
    clip on, the non-finite skip armed unless `kw` says otherwise), and the ops that
    would wait."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", True)
    demo = make_demo(d=32, layers=layers, heads=2, ctx=32, batch_size=4, max_steps=STEPS)
    m, opt = demo.model, torch.optim.AdamW(demo.model.parameters(), lr=1e-3, foreach=True)
    mode = Launches()
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / f"{layers}{sorted(kw)}", display=False,
                         hist_every=10**6, clip=1.0, **kw) as mon, mode:
        for i, b in enumerate(itertools.islice(itertools.cycle(demo.train), STEPS), 1):
            mode.on = i in STEADY
            own_step(mon, m, opt, b)
            mode.on = False
    return mode.launches.total() / len(STEADY), mode.waits


def test_the_step_launches_the_same_ops_whatever_the_model_depth(tmp_path, monkeypatch):
    """On a GPU each op nbwatch adds to a step costs the host a launch (~5 µs): its
    number a step must not grow with the model's parameters (~150 for GPT-2: a fill
    per gradient was ~0.75 ms a step), and none of them may wait for the device."""
    shallow, waits = launches_a_step(tmp_path, 1, monkeypatch)
    deep, deep_waits = launches_a_step(tmp_path, 6, monkeypatch)
    assert not waits + deep_waits, "would wait on a GPU:\n" + "\n".join(
        dict.fromkeys(waits + deep_waits))
    assert shallow > 0
    assert deep == shallow, (shallow, deep)


def test_the_clip_alone_launches_what_torchs_own_clip_does_and_the_copy(tmp_path, monkeypatch):
    """With the skip and the clipping rules off, a watched step with the Clip control on
    launches torch's own `clip_grad_norm_` (per-parameter norms, their total, the factor,
    one `_foreach_mul_`) and the one copy to the host: every layer's norm is watched for
    what the clip costs anyway."""
    watched, waits = launches_a_step(
        tmp_path, 2, monkeypatch, alerts={"nonfinite": False, "grad_explosion": False})
    assert not waits
    model = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4).model
    model(torch.randint(0, 8, (2, 8))).float().sum().backward()
    ops: collections.Counter[str] = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    assert watched == ops.total() + 1, (watched, ops)
