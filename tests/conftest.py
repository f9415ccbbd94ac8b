"""Shared fixtures: a tiny GPT and its data, and an autouse check that no test leaves a
thread, a hook or a torch function mode behind."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.nn.modules import module as nn_module

from nbwatch.demo import TinyGPT, collate, masked_cross_entropy

# Tiny models gain nothing from a second thread, and on a shared 2-core machine an
# OpenMP pool per test process turns contention into 100× slower steps.
torch.set_num_threads(1)


# alive for the whole session: playwright's executor, tqdm's monitor, jupyter_core's runner
FOREIGN_THREADS = ("asyncio_", "tqdm_monitor", "MainThread - runner")


@pytest.fixture(autouse=True)
def no_leftovers():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 10
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()
                 and not t.name.startswith(FOREIGN_THREADS)]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not extra, f"test left threads running: {[t.name for t in extra]}"
    assert not nn_module._global_forward_hooks, "test left a global forward hook"
    assert not nn_module._global_forward_pre_hooks, "test left a global forward pre-hook"
    assert not torch._C._is_torch_function_mode_enabled(), "test left a torch function mode"


def until(cond, timeout: float = 60.0, what: str = "condition", poll: float = 0.02):
    """Wait for `cond()` to be truthy and return its value; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def make_batches(n: int = 16, batch: int = 4, T: int = 24, seed: int = 0) -> list[dict]:
    """Variable-length random 'sentences' padded per batch, as the demo collates them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(6, T + 2, (batch,), generator=g).tolist()
        out.append(collate([torch.randint(1, 60, (L,), generator=g).tolist() for L in lengths]))
    return out


def own_step(mon, model, opt, batch, scheduler=None, clip=None):
    """One step of a loop of the user's own on a demo batch (`clip()`: the loop's own clip,
    before the optimizer's step), logged with its mask and logits (`mon.log`); returns the
    loss."""
    logits = model(batch["input_ids"])
    loss = masked_cross_entropy(logits, batch["labels"], batch["mask"])
    loss.backward()
    if clip is not None:
        clip()
    opt.step()
    if scheduler is not None:
        scheduler.step()
    opt.zero_grad(set_to_none=True)
    mon.log(loss=loss, mask=batch["mask"], logits=logits)
    return loss


def tiny_step(model, batch):
    return {"logits": model(batch["input_ids"]), "labels": batch["labels"], "mask": batch["mask"]}


@pytest.fixture
def tiny():
    """(model, optimizer, batches) small enough for a test to run 50 steps in a second."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, make_batches()


def lightning_fit(tmp_path, net: torch.nn.Module, loss_of, batches: list, run_dir,
                  max_steps: int = 3, **kw) -> None:
    """A Lightning fit of `net` on `batches` (in order, one a step, or `accumulate_grad_batches`
    in `kw`), its training step `loss_of(net, batch)`, AdamW, nbwatch's callback writing
    `run_dir` (the other `kw` are its options)."""
    L = pytest.importorskip("lightning")
    from nbwatch.lightning import NbwatchCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return loss_of(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    accumulate = kw.pop("accumulate_grad_batches", 1)
    L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=str(tmp_path),
              enable_checkpointing=False, accumulate_grad_batches=accumulate,
              callbacks=[NbwatchCallback(run_dir=run_dir, **kw)]).fit(
        Module(), torch.utils.data.DataLoader(batches, batch_size=None))
