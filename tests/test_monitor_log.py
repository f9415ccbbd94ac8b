"""A loop of the user's own: `Monitor.log()` once per optimizer step, run in a thread by
`Monitor.run()` or in the foreground: the figures it records (equal to what the loop
computed; eval figures, attention, a GradScaler's unscaled norms), a non-finite loss, bad
input. Steering and ending it (controls, failures, resume, attach) are in
`test_monitor_log_controls.py`. The loop is nanoGPT-style: AdamW, a LambdaLR warm-up,
masked loss; `Loop` and `setup` are shared with that file and its scripts."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.monitor.inputs import log_figures

from .conftest import make_batches, until


def setup(seed: int = 0, warmup: int = 10):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    return model, opt, sched, make_batches()


class Loop:
    """A user's training loop: computes its own figures, calls mon.log, ignores its return."""

    def __init__(self, model, opt, sched, batches, mon, delay: float = 0.0):
        self.model, self.opt, self.sched, self.batches, self.mon = model, opt, sched, batches, mon
        self.delay = delay
        self.seen: list[dict] = []

    def __call__(self, steps: int | None = None, start: int = 0) -> None:
        i = start
        while steps is None or i < start + steps:
            b = self.batches[i % len(self.batches)]
            logits = self.model(b["input_ids"])
            loss = nbwatch.masked_cross_entropy(logits, b["labels"], b["mask"])
            loss.backward()
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.model.parameters()]))
            lr = self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            m = b["mask"].float()
            self.seen.append({"loss": loss.item(), "norm": norm.item(), "lr": lr,
                              "pad": 1 - (m.sum() / m.numel()).item()})
            if self.delay:
                time.sleep(self.delay)
            self.mon.log(loss=loss, mask=b["mask"])
            i += 1


def own_steps(model, opt, sched, batches):
    """The losses of an own loop's steps, one at a time (the step taken, not yet logged)."""
    for b in itertools.cycle(batches):
        loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        yield loss, b


def test_recorded_figures_equal_what_the_loop_computed(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    loop = Loop(model, opt, sched, batches, mon)
    mon.run(loop, 25)
    mon.wait()
    assert mon.state == "finished" and mon.step == 25
    df = mon.df
    assert list(df.index) == list(range(1, 26))
    for step, seen in enumerate(loop.seen, start=1):
        row = df.loc[step]
        assert row["loss/train"] == pytest.approx(seen["loss"], rel=1e-6)
        assert row["grad_norm/global"] == pytest.approx(seen["norm"], rel=1e-5)
        assert row["lr"] == pytest.approx(seen["lr"], rel=1e-12)  # the LR the step used
        assert row["data/padding_ratio"] == pytest.approx(seen["pad"], abs=1e-6)
    assert df["lr"].iloc[0] == pytest.approx(1e-4) and df["lr"].iloc[-1] == pytest.approx(1e-3)
    per_layer = [c for c in df if c.startswith("grad_norm/") and c not in
                 ("grad_norm/global", "grad_norm/clipped")]
    assert len(per_layer) >= 6
    # per-layer norms add up (in squares) to the global norm
    assert (df[per_layer] ** 2).sum(axis=1).pow(0.5).values == pytest.approx(
        df["grad_norm/global"].values, rel=1e-5)
    assert df["update_ratio/" + per_layer[0].split("/", 1)[1]].notna().any()
    assert {"time/step", "throughput/tokens_per_s", "data/seq_len_mean"} <= set(df)
    assert mon.events.query("kind == 'checkpoint'").message.str.contains("final").any()
    run = nbwatch.open_run(tmp_path / "r")
    assert run.histograms(f"weight/{per_layer[0].split('/', 1)[1]}")[0].tolist() == [1]


def test_foreground_loop_in_a_with_block(tmp_path):
    model, opt, sched, batches = setup()
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False) as mon:
        Loop(model, opt, sched, batches, mon)(12)
        assert mon.state == "running" and mon.step == 12
    assert mon.state == "finished"
    run = nbwatch.open_run(tmp_path / "r")
    assert run.state == "finished" and len(run.df) == 12


def test_a_count_given_as_an_integer_tensor_is_recorded_exactly(tmp_path):
    """`log(tokens_seen=torch.tensor(n))`: the step's one copy stacks it with float32
    figures, which would round 123,456,789 to 123,456,792; an integer tensor goes as
    float64."""
    model, opt, sched, batches = setup()
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False) as mon:
        for i, (loss, _) in enumerate(itertools.islice(own_steps(model, opt, sched, batches),
                                                       3)):
            mon.log(loss=loss, tokens_seen=torch.tensor(123_456_789 + i), flag=torch.tensor(True))
    df = nbwatch.open_run(tmp_path / "r").df
    assert df["train/tokens_seen"].tolist() == [123_456_789, 123_456_790, 123_456_791]
    assert (df["train/flag"] == 1.0).all()


def test_an_accumulating_loop_gives_each_micro_batchs_mask(tmp_path):
    """`log(mask=[m1, m2, m3])` under gradient accumulation: tokens, lengths, padding and
    samples/s count every micro-batch of the step, as start(accumulate=3) does; a bad
    entry in one of them is refused at the first step."""
    model, opt, sched, batches = setup()
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False) as mon:
        for step in range(4):
            micro = batches[3 * step:3 * step + 3]
            for b in micro:
                nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"],
                                             b["mask"]).div(3).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                with pytest.raises(ValueError, match="mask holds 2 besides 0 and 1"):
                    mon.log(mask=[micro[0]["mask"], micro[1]["mask"] * 2, micro[2]["mask"]])
            mon.log(loss=1.0, mask=[b["mask"] for b in micro])
    df = nbwatch.open_run(tmp_path / "r").df
    for step in range(4):
        masks = [b["mask"] for b in batches[3 * step:3 * step + 3]]
        real = sum(float(m.sum()) for m in masks)
        assert df.loc[step + 1, "tokens/real"] == real
        assert df.loc[step + 1, "data/padding_ratio"] == pytest.approx(
            1 - real / sum(m.numel() for m in masks))
        assert df.loc[step + 1, "data/seq_len_max"] == max(float(m.sum(1).max()) for m in masks)
    with pytest.raises(ValueError, match="empty list"):
        log_figures(None, [], {})


@pytest.mark.parametrize("given", ["attention_mask", "input_ids", "mask"])
def test_a_batch_given_to_log_gives_its_tokens_as_the_trainer_counts_them(tmp_path, given):
    """`log(loss, batch=batch)` without `mask=`: the batch's own tokens (its attention_mask,
    else every input_ids token, as the Trainer's `num_input_tokens_seen`), so tokens/s,
    padding and samples/s come without a second argument; `mask=` still wins."""
    model, opt, sched, batches = setup()
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False) as mon:
        for b in batches[:4]:
            nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"],
                                         b["mask"]).backward()
            opt.step()
            opt.zero_grad()
            batch = {"input_ids": b["input_ids"]}
            if given != "input_ids":
                batch["attention_mask"] = b["mask"]
            if given == "mask":  # the loss's mask, given: its first token left out
                mon.log(loss=1.0, batch=batch, mask=b["mask"][:, 1:])
            else:
                mon.log(loss=1.0, batch=batch)
    df = nbwatch.open_run(tmp_path / "r").df
    for step, b in enumerate(batches[:4], start=1):
        m = {"attention_mask": b["mask"], "input_ids": torch.ones_like(b["input_ids"]),
             "mask": b["mask"][:, 1:]}[given]
        assert df.loc[step, "tokens/real"] == float(m.sum())
        assert df.loc[step, "data/padding_ratio"] == pytest.approx(1 - float(m.sum()) / m.numel())
        if step > 1:  # a loop of one's own opens inside its first step: no time for it
            assert df.loc[step, "throughput/samples_per_s"] == pytest.approx(
                m.shape[0] / df.loc[step, "time/step"])


@pytest.mark.parametrize("shape", ["4d", "3d", "empty"])
def test_a_batch_whose_mask_is_not_its_tokens_is_logged_without_data_figures(tmp_path, shape):
    """`log(loss, batch=batch)` where the batch's attention_mask is not a [batch, seq_len]
    mask of its tokens (a model's own 4-D [batch, 1, T, T] mask, a multiple-choice model's
    [batch, choices, T]) or the batch is empty: the step is logged, without data figures,
    as before the batch's own tokens were counted; it was refused ("mask has shape ...",
    a mask the loop never gave)."""
    model, opt, sched, batches = setup()
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False) as mon:
        for b in batches[:3]:
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            ids, am = b["input_ids"], b["mask"]
            batch = {"4d": {"input_ids": ids, "attention_mask": am[:, None, None, :].expand(
                         -1, 1, am.shape[1], -1)},
                     "3d": {"input_ids": ids[:, None].expand(-1, 2, -1),
                            "attention_mask": am[:, None].expand(-1, 2, -1)},
                     "empty": {"input_ids": ids[:0], "attention_mask": am[:0]}}[shape]
            mon.log(loss=loss, batch=batch)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == [1, 2, 3]
    assert "tokens/real" not in df.columns or df["tokens/real"].isna().all()


def test_nonfinite_loss_skips_the_step_and_pauses(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)

    def train():
        for i in range(10**6):
            b = batches[i % len(batches)]
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            if i in (4, 5):  # two bad steps in a row
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.log(loss=loss, mask=b["mask"])

    mon.run(train)
    until(lambda: mon.state == "paused", what="the alert's pause")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mon.resume()  # step 6 is NaN too: skipped again, whatever the alert's episode
    until(lambda: mon.step >= 8)
    mon.stop()
    mon.wait()
    df = mon.df
    assert df.loc[5, "skipped"] == 1.0 and df.loc[6, "skipped"] == 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert mon.events.query("kind == 'alert'").message.str.startswith("nonfinite").any()
    assert all(torch.isfinite(v).all() for v in before.values())


def test_bad_input_gets_an_error_that_names_the_fix(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    with pytest.raises(RuntimeError, match="before any optimizer step"):
        mon.log(loss=1.0)
    b = batches[0]
    with mon:
        loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
        loss.backward()
        opt.step()
        with pytest.raises(ValueError, match="not one value"):
            mon.log(loss=torch.ones(3))
        with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
            mon.log(loss=loss, mask=torch.ones(2, 3, 4))
        with pytest.raises(TypeError, match="accuracy"):
            mon.log(loss=loss, accuracy="high")
        mon.log(loss=loss, mask=b["mask"], accuracy=0.5)
        with pytest.raises(RuntimeError, match="twice for one optimizer step"):
            mon.log(loss=loss)
        other = torch.optim.SGD(model.head.parameters(), lr=0.1)
        model(b["input_ids"]).sum().backward()
        with pytest.raises(RuntimeError, match="second optimizer"):
            other.step()
        opt.zero_grad()
        model(b["input_ids"]).sum().backward()
        opt.step()
        with pytest.raises(RuntimeError, match="without mon.log"):
            opt.step()
        mon.log(loss=1.0)
    assert mon.df.loc[1, "train/accuracy"] == 0.5
    assert mon.state == "finished"
    started = nbwatch.Monitor(model, opt, run_dir=tmp_path / "s", display=False)
    started.start(lambda m, b: m(b["input_ids"]).mean(), batches, max_steps=2)
    with pytest.raises(RuntimeError, match="start"):
        started.log(loss=1.0)
    started.wait()


def test_val_at_log_records_eval_figures_and_probes_attention(tmp_path):
    model, opt, sched, batches = setup()
    probe = {"idx": batches[0]["input_ids"]}
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False,
                          probe_batch=probe, probe_fn=lambda m, b: m(b["idx"]))
    with mon:
        for i in range(6):
            b = batches[i]
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            val = {"loss": 3.0 - i * 0.1, "accuracy": 0.1 * i} if i % 3 == 2 else None
            mon.log(loss=loss, mask=b["mask"], val=val)
    df = mon.df
    assert df.loc[3, "loss/val"] == pytest.approx(2.8) and df.loc[6, "val/accuracy"] == 0.5
    assert math.isfinite(df.loc[3, "loss/gap"])
    run = nbwatch.open_run(tmp_path / "r")
    maps = run.attention(step=6)
    assert maps and all(w.shape[0] == 2 for w in maps.values())  # 2 heads a module


def test_a_step_that_holds_the_loops_eval_has_no_throughput(tmp_path):
    """An eval the loop runs before `log(val=...)` lies inside that step's time: a rate
    over it read as a throughput drop at every eval. Such a step keeps its time but no
    rate; a val given every step is part of every step, and keeps its rates."""
    def train(every: int, run: str):
        model, opt, sched, batches = setup()
        with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / run, display=False) as mon:
            for i in range(9):
                b = batches[i]
                loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"],
                                                    b["mask"])
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                val = None
                if (i + 1) % every == 0:
                    time.sleep(0.2)  # the eval
                    val = 3.0
                mon.log(loss=loss, mask=b["mask"], val=val)
        return mon.df

    df = train(4, "periodic")
    assert df.loc[[4, 8], "time/step"].min() >= 0.2
    for key in ("throughput/tokens_per_s", "throughput/samples_per_s"):
        assert df[key].isna().tolist() == [s in (1, 4, 8) for s in df.index], key
    df = train(1, "every step")
    assert df["throughput/tokens_per_s"].loc[2:].notna().all()


def test_probe_every_takes_attention_maps_without_a_val(tmp_path):
    """`Monitor(probe_every=3)`: the attention probe at steps 3 and 6 of a loop that logs no
    val, with no `loss/val` recorded and no checkpoint written for it (the probe ran only
    at `log(val=...)`, so a loop without one passed a dummy val, recorded as `loss/val`)."""
    model, opt, sched, batches = setup()
    probe = {"idx": batches[0]["input_ids"]}
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False,
                          probe_batch=probe, probe_fn=lambda m, b: m(b["idx"]), probe_every=3)
    with mon:
        for i in range(7):
            b = batches[i % len(batches)]
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.log(loss=loss, mask=b["mask"])
    run = nbwatch.open_run(tmp_path / "r")
    assert run.reader.attention_steps() == [3, 6]
    assert all(w.shape[0] == 2 for w in run.attention(step=3).values())
    assert "loss/val" not in run.df
    saved = run.events[run.events.kind == "checkpoint"].step.tolist()
    assert saved == [7]  # the final one only
    with pytest.raises(ValueError, match="probe_every"):
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "bad", probe_every=0)


def test_grad_scaler_in_the_loop_norms_unscaled_overflow_routine(tmp_path):
    def train(scaler, mon, steps=4, factor=1.0):
        torch.manual_seed(0)
        for i in range(steps):
            b = batches[i]
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            (scaler.scale(loss * factor) if scaler else loss * factor).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            mon.log(loss=loss)

    norms = []
    for use_scaler in (False, True):
        model, opt, _, batches = setup()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if use_scaler else None
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / str(use_scaler), scaler=scaler,
                             display=False) as mon:
            train(scaler, mon)
        norms.append(mon.df["grad_norm/global"].tolist())
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)

    model, opt, _, batches = setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows at first
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "o", scaler=scaler,
                         display=False) as mon:
        train(scaler, mon, steps=6, factor=1e3)
    df = mon.df
    assert df.loc[1, "amp/overflow"] == 1.0 and len(df) == 6
    assert not (mon.events.severity == "critical").any()
    assert scaler.get_scale() < 2.0**127  # the scaler lowered its scale, as it should


def test_fused_optimizer_under_a_grad_scaler_records_unscaled_norms(tmp_path):
    """A fused AdamW gets still-scaled gradients (and found_inf) from the GradScaler."""
    norms = {}
    for fused in (False, True):
        model, _, _, batches = setup()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / str(fused), scaler=scaler,
                             display=False) as mon:
            for i in range(4):
                b = batches[i]
                loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"],
                                                    b["mask"])
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                mon.log(loss=loss)
        norms[fused] = mon.df["grad_norm/global"].tolist()
        assert not (mon.events.severity == "critical").any()
    assert norms[True] == pytest.approx(norms[False], rel=1e-4)


def test_each_steps_lengths_count_once_when_an_alert_checkpoints_mid_batch(tmp_path):
    """A CPU mask's figures are taken with the record (probes/late.py): an alert whose action
    checkpoints records the steps waiting from inside the batch, and their sequence lengths
    still reach the next `data/seq_len` histogram once each."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    alerts = {"loss_spike": {"actions": ["checkpoint"]}, "throughput_drop": False,
              "data_bottleneck": False}
    batch, steps = 4, 100
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, hist_every=steps,
                         alerts=alerts) as mon:
        for s in range(1, steps + 1):
            model(torch.randn(batch, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mask = torch.ones(batch, 6, dtype=torch.long)
            mask[:, 4:] = 0
            mon.log(1.0 + 0.001 * (s % 3) + (100.0 if s == 70 else 0.0), mask=mask)
    ev = mon.events
    assert (ev.kind == "checkpoint").any() and ev.message.str.startswith("loss_spike").any()
    at, _, counts = nbwatch.open_run(tmp_path / "r").histograms("data/seq_len")
    assert at.tolist() == [1, steps]
    assert counts.sum(axis=1).tolist() == [batch, (steps - 1) * batch]


def test_log_from_a_second_thread_is_refused_not_taken_as_the_loops_step(tmp_path):
    """A figure logged from another thread (a logger, a callback's thread) used to be taken
    as the loop's step record: refused, naming both threads; the loop's steps are intact."""
    import threading

    from nbwatch.demo import make_demo, masked_cross_entropy

    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m, opt = demo.model, demo.optimizer
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False)
    errors = []

    def other():
        try:
            mon.log(loss=1.0)
        except RuntimeError as e:
            errors.append(str(e))

    with mon:
        for i, b in enumerate(itertools.islice(iter(demo.train), 4)):
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 2:
                t = threading.Thread(target=other, name="side-logger")
                t.start()
                t.join()
            mon.log(loss=loss)
    assert errors and "'side-logger'" in errors[0] and "MainThread" in errors[0], errors
    assert list(mon.df.index) == [1, 2, 3, 4]
    assert mon.df["loss/train"].notna().all()
