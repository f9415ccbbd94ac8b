"""The step path on a real accelerator: CUDA where there is one, else the CPU in a GPU's
order (`DEFER_ON_CPU`), so that CI keeps these tests true and a GPU session
(benchmarks/gpu_session.sh) runs them as they are. On CUDA each steady step is also
watched by torch's own sync detector (`torch.cuda.set_sync_debug_mode`), in every
thread: a device→host wait anywhere on the step path fails the test with the line that
made it, whether or not it went through a tensor method the CPU audit patches."""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo, masked_cross_entropy
from nbwatch.probes.logit_rows import logit_parts
from nbwatch.recorder import host_copy
from nbwatch.recorder.host_copy import HostCopy
from tests.recorder.test_host_copy import Audit, has_histograms

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
PACKAGE = Path(nbwatch.__file__).parent
STEPS, STEADY = 30, range(5, 26)  # no eval, checkpoint or start-up step among the steady


class Syncs:
    """CUDA syncs while `on`, any thread, each named by the innermost nbwatch line under
    it ("user" where none is: the test's own loop). A no-op without CUDA."""

    def __init__(self) -> None:
        self.on = False
        self.where: list[str] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Syncs:
        if not CUDA:
            return self
        self._show = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if "synchroniz" not in str(message):
                return self._show(message, category, *args, **kwargs)
            if self.on:
                here = [f for f in traceback.extract_stack()
                        if PACKAGE in Path(f.filename).parents]
                with self._lock:
                    self.where.append(f"{here[-1].filename}:{here[-1].lineno}"
                                      if here else "user")
            return None

        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._show
            self._filters.__exit__(*exc)

    def check(self) -> None:
        nbwatch_syncs = [w for w in self.where if w != "user"]
        assert not nbwatch_syncs, "nbwatch synced on the step path:\n" + "\n".join(
            sorted(set(nbwatch_syncs)))


@pytest.fixture
def audit(monkeypatch):
    """The CPU's audit of tensor reads (the GPU's order, on any device)."""
    return Audit().install(monkeypatch.setattr)


def on_device(demo, fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    model = demo.model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused, foreach=not fused)
    batches = [{k: v.to(DEVICE) for k, v in b.items()}  # staged: a copy in is a sync
               for b in itertools.islice(itertools.cycle(demo.train), 8)]
    return model, opt, batches


def autocast():
    return torch.autocast(DEVICE.type, dtype=torch.bfloat16)


def test_a_copy_lands_on_the_host_as_the_device_held_it(monkeypatch):
    """Groups of mixed widths leave in one copy per device, into pinned memory behind an
    event on CUDA, and read back as the device held them."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", True)
    torch.manual_seed(0)
    groups = {"loss": [torch.randn((), device=DEVICE)],
              "norms": [torch.rand(5, device=DEVICE), torch.rand(3, device=DEVICE)],
              "half": [torch.randn(4, device=DEVICE, dtype=torch.bfloat16)],
              "lengths": [torch.randint(0, 1000, (6,), device=DEVICE)]}
    copy = HostCopy.launch(7, groups)
    (share,) = copy.shares
    if CUDA:
        assert share.host.is_pinned() and share.event is not None
        torch.cuda.synchronize()
        assert copy.ready()
    got = copy.read()
    for name, parts in groups.items():
        want = torch.cat([p.reshape(-1).float() for p in parts]).cpu().tolist()
        assert got[name] == pytest.approx(want, rel=1e-6), name
    assert copy.sizes == {"loss": 1, "norms": 8, "half": 4, "lengths": 6}


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_an_own_loop_records_its_norms_clip_and_skip_without_a_sync(tmp_path, audit, fused):
    """nanoGPT's loop on the device (bf16 autocast, AdamW, nbwatch's clip at 1.0,
    histograms every 5 steps), step 22's loss NaN: `grad_norm/global` is the loop's own
    norm of each step, `grad_norm/clipped` ≤ 1, step 22 is skipped (a fused AdamW leaves
    the weights as they were; a foreach one keeps them finite), and no steady step syncs
    or reads a tensor outside `host_copy`."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, max_steps=STEPS)
    model, opt, batches = on_device(demo, fused)
    params = list(model.parameters())
    own: list[torch.Tensor] = []
    with Syncs() as syncs, nbwatch.Monitor(
            model, opt, run_dir=tmp_path / "r", display=False, hist_every=5, clip=1.0,
            alerts={"nonfinite": {"actions": ["skip_step"]}}) as mon:
        for i in range(1, STEPS + 1):
            syncs.on = audit.on = i in STEADY
            b = batches[i % len(batches)]
            with autocast():
                logits = model(b["input_ids"])
                loss = masked_cross_entropy(logits, b["labels"], b["mask"])
            if i == 22:
                loss = loss * math.nan
            loss.backward()
            own.append(torch.nn.utils.get_total_norm([p.grad for p in params]))
            if i == 22:
                before = [p.detach().clone() for p in params]
            opt.step()
            if i == 22:
                after = [p.detach().clone() for p in params]
            opt.zero_grad(set_to_none=True)
            mon.log(loss=loss, mask=b["mask"], logits=logits)
        syncs.on = audit.on = False
    syncs.check()
    assert not audit.reads, "nbwatch read a tensor on the step path:\n" + "\n".join(
        dict.fromkeys(audit.reads))
    assert all(at > s for s, at in audit.read_at)  # each step read at a later boundary
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == list(range(1, STEPS + 1))
    mine = torch.stack(own).cpu().tolist()
    good = [s for s in df.index if s != 22]
    assert df.loc[good, "grad_norm/global"].tolist() == pytest.approx(
        [mine[s - 1] for s in good], rel=1e-5)
    assert (df.loc[good, "grad_norm/clipped"] <= 1.0 + 1e-5).all()
    assert df.loc[22, "skipped"] == 1.0 and df["skipped"].fillna(0).sum() == 1
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.equal(x, y) for x, y in zip(before, after)) == fused
    has_histograms(tmp_path / "r", 5)  # binned on the device, read with their copy


def test_start_trains_on_the_device_without_a_sync(tmp_path, audit):
    """`start()`'s runner thread on the device: every step recorded with its norms, and
    no steady step syncs or reads a tensor outside `host_copy`."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, max_steps=STEPS)
    model, opt, batches = on_device(demo, fused=False)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, hist_every=5)

    def step_fn(m, b):
        syncs.on = audit.on = mon.step + 1 in STEADY
        with autocast():
            return demo.step_fn(m, b)

    with Syncs() as syncs:
        mon.start(step_fn, itertools.cycle(batches), max_steps=STEPS, display=False).wait()
        syncs.on = audit.on = False
    assert mon.state == "finished", mon.error
    syncs.check()
    assert not audit.reads, "\n".join(dict.fromkeys(audit.reads))
    df = mon.df
    assert df.index.tolist() == list(range(1, STEPS + 1))
    assert df[["loss/train", "grad_norm/global"]].notna().all().all()


@pytest.mark.skipif(not CUDA, reason="a GPU's memory")
def test_preflight_keeps_its_copy_of_the_model_and_optimizer_in_host_memory(tmp_path):
    """`preflight()` saves the model and optimizer to restore them after its trial: a copy
    on the GPU held the weights (and a trained optimizer's moments) twice through the
    trial, where a model that trains in the GPU's memory could fail, and its peak-memory
    check counted them."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # 128 MiB
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 2048, device="cuda")
    model(x).pow(2).mean().backward()
    opt.step()  # its moments: twice the weights more
    opt.zero_grad(set_to_none=True)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    torch.cuda.synchronize()
    before, seen = torch.cuda.memory_allocated(), []

    def step_fn(m, b):
        if not seen:
            seen.append(torch.cuda.memory_allocated())
        return m(b).pow(2).mean()

    mon.preflight(step_fn, itertools.repeat(x), steps=3)
    assert seen[0] - before < 0.1 * weights, (seen[0] - before) / weights


def test_start_weighs_the_logits_by_a_host_batchs_mask_the_step_fn_moved(tmp_path):
    """A step_fn that moves the loader's CPU batch to the device itself and returns only
    its loss: `train_logits/*` come from the output layer's hook, over the rows the
    batch's (host) attention_mask marks real, as `logit_parts` gives them on the device
    (the mask and the logits on two devices failed step 1)."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, max_steps=6)
    model = demo.model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    host = []
    for b in itertools.islice(itertools.cycle(demo.train), 6):
        mask = torch.ones_like(b["input_ids"])
        mask[:, 20:] = 0  # right padding
        host.append({"input_ids": b["input_ids"], "attention_mask": mask})
    want = []
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)

    def step_fn(m, b):
        b = {k: v.to(DEVICE) for k, v in b.items()}
        with autocast():
            logits = m(b["input_ids"])
        want.append(logit_parts(logits.detach(), b["attention_mask"]))
        return masked_cross_entropy(logits[:, :-1], b["input_ids"][:, 1:],
                                    b["attention_mask"][:, 1:])

    mon.start(step_fn, host, max_steps=6, display=False, dry_run=False).wait()
    assert mon.state == "finished", mon.error
    df = mon.df.loc[2:]  # the hook is set at step 1's take: from step 2
    assert df["train_logits/log_z"].tolist() == pytest.approx(
        [float(lz) for lz, _ in want[1:]], rel=1e-5)
    assert df["train_logits/max_abs"].tolist() == pytest.approx(
        [float(top) for _, top in want[1:]], rel=1e-5)


def test_a_grad_scalers_overflow_is_its_own_skip(tmp_path, monkeypatch):
    """float16 autocast under a GradScaler, step 10's loss infinite: the scaler skips
    it (`amp/overflow`), nbwatch's norms are the unscaled ones, the weights stay finite."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", True)
    try:
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10)
    except (AttributeError, RuntimeError, TypeError) as e:  # pragma: no cover: old torch
        pytest.skip(f"no GradScaler on {DEVICE.type}: {e}")
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, max_steps=16)
    model, opt, batches = on_device(demo, fused=False)
    params = list(model.parameters())
    own = []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False,
                         scaler=scaler, alerts={"nonfinite": {"actions": []}}) as mon:
        for i in range(1, 17):
            b = batches[i % len(batches)]
            with torch.autocast(DEVICE.type, dtype=torch.float16) if CUDA \
                    else contextlib.nullcontext():
                loss = masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            if i == 10:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            own.append(torch.nn.utils.get_total_norm([p.grad for p in params])
                       / scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            mon.log(loss=loss)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == list(range(1, 17))
    assert df.loc[10, "amp/overflow"] == 1.0 and df["amp/overflow"].fillna(0).sum() == 1
    mine = torch.stack(own).cpu().tolist()
    good = [s for s in df.index if s != 10]
    assert df.loc[good, "grad_norm/global"].tolist() == pytest.approx(
        [mine[s - 1] for s in good], rel=1e-4)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("first", ["packed", "padded"])
def test_a_step_of_device_and_host_micro_batches_waits_for_nothing(tmp_path, audit, first):
    """Accumulation over a micro-batch staged on the device (packed, or padded) and a
    padded one left on the host: the step counts both (documents and rows: tokens,
    lengths, samples) and no steady step syncs. The host rows' lengths went up to the
    device with a pageable copy that waited for the stream; two padded ones on two
    devices failed the step."""
    from tests.test_packing import packed, padded_rows

    torch.manual_seed(0)
    model = make_demo(d=16, layers=1, heads=2, ctx=16).model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pack = {k: v.to(DEVICE) for k, v in (packed([7, 3, 12, 6]) if first == "packed"
                                         else padded_rows()).items()}
    pad = padded_rows()  # 2 rows of 8, 13 real tokens

    def loss_of(b):
        ids = b["input_ids"].to(DEVICE, non_blocking=True)[:, :16]
        return torch.nn.functional.cross_entropy(model(ids)[0, :-1], ids[0, 1:]) / 2

    with Syncs() as syncs, nbwatch.Monitor(model, opt, run_dir=tmp_path / "r",
                                           display=False, hist_every=5) as mon:
        for i in range(1, STEPS + 1):
            syncs.on = audit.on = i in STEADY
            losses = [loss_of(pack), loss_of(pad)]
            for one in losses:
                one.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.log(loss=losses, batch=[pack, pad])
        syncs.on = audit.on = False
    syncs.check()
    assert not audit.reads, "\n".join(dict.fromkeys(audit.reads))
    df = nbwatch.open_run(tmp_path / "r").df
    # the documents (or the device's rows), then the host's rows
    lengths = [7, 3, 12, 6, 8, 5] if first == "packed" else [8, 5, 8, 5]
    assert (df["tokens/real"] == sum(lengths)).all()
    assert (df["data/seq_len_max"] == max(lengths)).all()
    assert df["data/seq_len_mean"].tolist() == pytest.approx(
        [sum(lengths) / len(lengths)] * STEPS)
    steps, edges, counts = nbwatch.open_run(tmp_path / "r").histograms("data/seq_len")
    # each histogram holds the steps since the one before
    assert [int(c.sum()) for c in counts] == [
        len(lengths) * int(n) for n in np.diff([0, *steps])]
    assert all(e[-1] == max(lengths) for e in edges)
