"""A loop of the user's own under Hugging Face accelerate: the prepared optimizer and
scheduler (`AcceleratedOptimizer`, `AcceleratedScheduler`) given to `Monitor` as they come,
gradient accumulation (`accelerator.accumulate`), `accelerator.backward` and
`accelerator.clip_grad_norm_`, one `mon.log()` per real optimizer update. A real
`Accelerator` on the CPU and a real (tiny) Llama built from its config."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import nbwatch  # noqa: E402
from nbwatch.checkpoint import load  # noqa: E402

ACCUM, BATCHES, MAX_NORM, WARMUP, LR = 4, 24, 0.05, 10, 1e-3


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps its state in process-wide singletons: each test its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def prepared(seed: int = 0):
    """(accelerator, model, optimizer, loader, scheduler), as `accelerator.prepare` gives
    them, on a 2-layer Llama with hidden size 32."""
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(0, 64, (2, 12), generator=g) for _ in range(BATCHES)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched


class AccelerateLoop:
    """The loop of accelerate's docs, with `mon.log` once per real update; it notes what
    accelerate returned and the LR each update used."""

    def __init__(self, acc, model, opt, loader, sched, mon, scale_at: int | None = None):
        self.acc, self.model, self.opt, self.loader, self.sched = acc, model, opt, loader, sched
        self.mon, self.scale_at = mon, scale_at
        self.norms: list[float] = []  # accelerator.clip_grad_norm_'s return, per update
        self.lrs: list[float] = []  # the LR the update used
        self.micro = 0

    def __call__(self) -> None:
        acc, model, opt, sched = self.acc, self.model, self.opt, self.sched
        for ids in self.loader:
            with acc.accumulate(model):
                self.micro += 1
                loss = model(input_ids=ids, labels=ids).loss * 1e3  # large norms: clipped
                acc.backward(loss)
                if acc.sync_gradients:
                    self.norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
                    self.lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                step = self.mon.log(loss=loss)
                if step == self.scale_at:
                    self.mon.scale_lr(0.5)  # applied at the next log()


def test_accumulation_and_clipping_record_one_step_per_update_before_the_clip(tmp_path):
    acc, model, opt, loader, sched = prepared()
    assert type(opt).__name__ == "AcceleratedOptimizer"
    assert type(sched).__name__ == "AcceleratedScheduler"
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    loop = AccelerateLoop(acc, model, opt, loader, sched, mon, scale_at=3)
    mon.run(loop)
    mon.wait()

    updates = BATCHES // ACCUM
    assert loop.micro == BATCHES and len(loop.norms) == updates
    assert mon.state == "finished" and mon.step == updates
    df = mon.df
    assert list(df.index) == list(range(1, updates + 1))
    # the pre-clip norm is the one accelerate returned; after the clip, at most max_norm
    assert df["grad_norm/global"].tolist() == pytest.approx(loop.norms, rel=1e-5)
    assert min(loop.norms) > 10 * MAX_NORM  # every update was clipped
    assert (df["grad_norm/clipped"] <= MAX_NORM * (1 + 1e-5)).all()
    assert df["grad_norm/clipped"].tolist() == pytest.approx([MAX_NORM] * updates, rel=1e-4)
    per_layer = [c for c in df if c.startswith("grad_norm/")
                 and c not in ("grad_norm/global", "grad_norm/clipped")]
    assert len(per_layer) >= 10
    # per-layer norms are before the clip too: they add up (in squares) to the global one
    assert (df[per_layer] ** 2).sum(axis=1).pow(0.5).tolist() == pytest.approx(
        loop.norms, rel=1e-5)

    # the LR each update used; the scheduler steps once per update (not per micro-batch),
    # and the cut asked after step 3 (applied at the next log()) holds from step 5 on
    assert df["lr"].tolist() == pytest.approx(loop.lrs, rel=1e-12)
    factor = [1.0 if s <= 4 else 0.5 for s in range(1, updates + 1)]
    assert df["lr"].tolist() == pytest.approx(
        [LR * schedule(s - 1) * f for s, f in zip(range(1, updates + 1), factor)], rel=1e-9)
    assert sched.scheduler.last_epoch == updates

    ckpt = load(sorted((tmp_path / "r" / "checkpoints").glob("step_*.pt"))[-1])
    assert ckpt["scheduler"]["last_epoch"] == updates  # the wrapped scheduler's state
    assert ckpt["optimizer"]["state"]  # the wrapped optimizer's (AdamW moments)
    assert mon.events.message.str.contains("clips its gradients itself").any()


def test_a_resumed_accelerate_run_goes_on_from_its_checkpoint(tmp_path):
    acc, model, opt, loader, sched = prepared()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    mon.run(AccelerateLoop(acc, model, opt, loader, sched, mon))
    mon.wait()
    first = mon.df

    acc, model, opt, loader, sched = prepared(seed=1)  # other weights, a fresh schedule
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False,
                          resume=True)
    assert mon.step == BATCHES // ACCUM
    assert sched.scheduler.last_epoch == BATCHES // ACCUM  # restored through the wrapper
    loop = AccelerateLoop(acc, model, opt, loader, sched, mon)
    mon.run(loop)
    mon.wait()
    df = mon.df
    assert list(df.index) == list(range(1, 2 * BATCHES // ACCUM + 1))
    assert df["lr"].loc[: BATCHES // ACCUM].tolist() == first["lr"].tolist()
    assert df["lr"].loc[BATCHES // ACCUM + 1:].tolist() == pytest.approx(loop.lrs, rel=1e-12)
    assert loop.lrs[0] == pytest.approx(LR * schedule(BATCHES // ACCUM), rel=1e-12)


def test_wrapped_and_plain_optimizer_and_scheduler_mix(tmp_path):
    """The scheduler built on the plain optimizer before prepare, the optimizer prepared:
    one optimizer, accepted; a scheduler of another optimizer: refused."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(plain, 1)
    model, opt = acc.prepare(model, plain)
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "a", display=False) as mon:
        for _ in range(2):
            model(torch.ones(3, 4)).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.log()
    assert mon.df["lr"].tolist() == pytest.approx([0.1, 0.01], rel=1e-12)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    with pytest.raises(ValueError, match="another optimizer"):
        nbwatch.Monitor(model, opt, acc.prepare(other), run_dir=tmp_path / "b", display=False)


def test_the_grad_scaler_of_accelerates_optimizer_is_taken(tmp_path):
    """accelerate's fp16 optimizer steps through its GradScaler, which skips the step on an
    overflow: the Monitor takes that scaler (none given), so `log()` after a skipped
    update records an overflow instead of refusing a log without an optimizer step. (On
    the CPU accelerate makes no scaler: its wrapper is built here with a CPU GradScaler.)"""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126)  # overflows at first
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), scaler=scaler)
    skipped, scales = [], []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for _ in range(8):
            loss = model(torch.randn(4, 8)).square().mean() * 100
            scaler.scale(loss).backward()
            opt.step()
            skipped.append(opt.step_was_skipped)
            scales.append(scaler.get_scale())
            opt.zero_grad()
            mon.log(loss=loss)
    df = mon.df
    assert skipped[0] and not skipped[-1]
    assert len(df) == 8 and df.loc[1, "amp/overflow"] == 1.0
    # each step 0 or 1 (a rate to plot), and the loss scale its update() left, as fp16
    # trainers log it (Megatron, fairseq, DeepSpeed)
    assert df["amp/overflow"].tolist() == [float(s) for s in skipped]
    assert df["amp/scale"].tolist() == scales
    assert scaler.get_scale() < 2.0**126
