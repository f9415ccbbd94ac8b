"""Loss spikes and which batch caused them: a real run with one bad batch at a known place
in the data stream; the `loss_spike` alert names that step, and `run.spikes` that batch.
Gradient-norm spikes: `grad_norm_spike` on an LR spike, before the loss spikes."""

import itertools
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import nbwatch
from nbwatch.alerts import AlertEngine, default_rules
from nbwatch.demo import VOCAB, make_demo, masked_cross_entropy
from nbwatch.recorder.batches import RING, content_hash
from tests.test_alerts_e2e import wait_state

EPOCH, EPOCHS_BEFORE, AT = 100, 2, 30  # the bad batch: epoch 2, position 30 → step 231


def corrupt(b, gen):
    """A corrupt batch (a bad shard, say): random labels, and the rows' order reversed."""
    labels = torch.randint(0, VOCAB, b["labels"].shape, generator=gen)
    return {**b, "input_ids": b["input_ids"].flip(0), "labels": labels}


class Poisoned:
    """The demo's batches, `EPOCH` an epoch; in epoch `epoch`, batch `at` is corrupt.
    Keeps each epoch's batches to check against."""

    def __init__(self, batches, epoch=EPOCHS_BEFORE, at=AT):
        self.batches, self.epochs, self.epoch, self.at = batches, [], epoch, at
        self.gen = torch.Generator().manual_seed(1)

    def __iter__(self):
        seen = []
        self.epochs.append(seen)
        for i, b in enumerate(itertools.islice(self.batches, EPOCH)):
            if len(self.epochs) - 1 == self.epoch and i == self.at:
                b = corrupt(b, self.gen)
            seen.append(b)
            yield b


def crc(ids):
    return f"{zlib.crc32(ids.contiguous().numpy().tobytes()):08x}"


def test_one_bad_batch_fires_loss_spike_at_its_step_and_spikes_name_it(tmp_path):
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=260)
    data = Poisoned(demo.train)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, data, max_steps=260, display=False)
    wait_state(mon, "finished", timeout=300)
    mon.wait()

    step = EPOCHS_BEFORE * EPOCH + AT + 1
    ev = mon.events
    spikes_alerts = ev[(ev.kind == "alert") & ev.message.str.startswith("loss_spike")]
    assert spikes_alerts.step.tolist() == [step], ev[ev.kind == "alert"].message.tolist()
    assert spikes_alerts.severity.iloc[0] == "warning"

    spikes = nbwatch.open_run(tmp_path / "r").spikes
    assert list(spikes.columns)[:5] == ["step", "loss", "median", "z", "batches"]
    assert spikes.step.tolist() == [step]
    row = spikes.iloc[0]
    assert row.loss == mon.df.loc[step, "loss/train"] and row.z > 6
    assert row.loss > row["median"] > 0
    # the spike step's batch, and the four before it, as the test saw them go in
    expected = [{"step": s, "epoch": EPOCHS_BEFORE, "index": s - 1 - EPOCHS_BEFORE * EPOCH,
                 "hash": crc(data.epochs[EPOCHS_BEFORE][s - 1 - EPOCHS_BEFORE * EPOCH]
                             ["input_ids"])}
                for s in range(step - 4, step + 1)]
    assert row.batches == expected
    assert mon.spikes.equals(spikes)  # the Monitor reads the same table
    score = mon.df["spike/score"]  # the spike score, a series: the spike step counts
    assert score[step] == score[step - 1] + 1 and score.notna().all()


def spike_steps(mon, rule="loss_spike"):
    ev = mon.events
    return ev[(ev.kind == "alert") & ev.message.str.startswith(rule + ":")].step.tolist()


def test_one_bad_batch_early_in_a_fresh_run_fires_loss_spike_while_the_loss_falls(tmp_path):
    """Step 60 of a fresh run, the loss still falling from its start: the median of all the
    steps before lags the descent and their MAD counts it as noise (the old rule scored
    z ≈ 4.7 here); the level of the last 10 steps and the MAD around the trend line do
    not."""
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=600)
    data = Poisoned(demo.train, epoch=0, at=59)  # step 60
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, data, max_steps=70, display=False)
    wait_state(mon, "finished", timeout=300)
    mon.wait()
    loss = mon.df["loss/train"]
    assert loss[:10].mean() > loss[50:59].mean() + 1.0  # the descent is in the window
    assert spike_steps(mon) == [60]  # the bad batch's step, and no alarm in the descent
    row = mon.spikes.iloc[0]
    assert row.z > 6 and row.loss > 1.5 * row["median"]
    assert row.batches[-1] == {"step": 60, "epoch": 0, "index": 59,
                               "hash": crc(data.epochs[0][59]["input_ids"])}
    print(f"loss {row['median']:.2f} → {row.loss:.2f} at step 60: z = {row.z:.1f}")


def test_an_lr_spike_fires_grad_norm_spike_before_loss_spike(tmp_path):
    """The LR 15× its schedule for 10 steps from step 150: the gradient norm leaves its
    noise before the loss does (OLMo 2's observation: gradient-norm spikes come first)."""
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=600, seed=2)
    plan = demo.scheduler.lr_lambdas[0]  # the demo's warm-up + cosine
    sched = torch.optim.lr_scheduler.LambdaLR(
        demo.optimizer, lambda i: plan(i) * (15.0 if 149 <= i < 159 else 1.0))
    mon = nbwatch.Monitor(demo.model, demo.optimizer, sched, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, demo.train, max_steps=165, display=False)
    wait_state(mon, "finished", timeout=600)
    mon.wait()
    grad, loss = spike_steps(mon, "grad_norm_spike"), spike_steps(mon)
    assert grad and loss, mon.events[mon.events.kind == "alert"].message.tolist()
    assert 151 <= grad[0] < loss[0] <= 160, (grad, loss)  # both in the LR spike, grad first
    ev = mon.events
    data = ev[ev.message.str.startswith("grad_norm_spike:")].data.iloc[0]
    assert data["z"] > 6 and data["grad_norm"] > 4 * data["median"]
    assert data["batches"][-1]["step"] == grad[0]  # it names its batches too
    print(f"grad_norm_spike at step {grad[0]}, loss_spike at {loss[0]}")


REPLAY = Path(__file__).parent / "data" / "healthy_demo.npz"


def test_the_baseline_follows_a_falling_series_and_its_noise_is_what_is_left():
    """What the spike rules compare with: the median of the 10 values before (not of the
    window, which lags a descent), and the MAD around the trend line (not around the
    median, which counts the descent as noise)."""
    from nbwatch.alerts.rules import Window

    w = Window(1000)
    for s in range(201):
        w.add({"x": 5.0 - 0.01 * s + (0.1 if s % 2 else -0.1)})
    level, mad, n = w.detrended_mad("x", 200)
    assert n == 200 and mad == pytest.approx(0.1, abs=0.01)
    assert level == pytest.approx(5.0 - 0.01 * 194.5, abs=0.11)  # steps 190-199
    med, plain_mad, _ = w.mad("x", 200)
    assert med == pytest.approx(4.0, abs=0.11) and plain_mad > 0.4


@pytest.mark.parametrize("at", [60, 2500])
def test_jumps_put_into_the_healthy_replay_fire_where_they_are(at):
    """The recorded healthy run (quiet: test_alerts_healthy.py) with the loss 2.3× and the
    gradient norm 6× at one step, early in its descent and late: each rule fires there."""
    d = np.load(REPLAY)
    cols = list(d["columns"])
    fired: dict[str, list[int]] = {"loss_spike": [], "grad_norm_spike": []}
    eng = AlertEngine([r for r in default_rules() if r.name in fired])
    for step, row in zip(d["steps"].tolist(), d["scalars"]):
        values = {c: float(v) for c, v in zip(cols, row) if not np.isnan(v)}
        if step == at:
            values["loss/train"] *= 2.3
            values["grad_norm/global"] *= 6.0
        for a in eng.observe("step", step, values):
            fired[a.rule.name].append(a.step)
    assert fired == {"loss_spike": [at], "grad_norm_spike": [at]}


def test_own_loop_spike_names_its_steps(tmp_path):
    """`mon.log()` sees no batch: the identities carry the step alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for s in range(1, 121):
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss * (50.0 if s == 90 else 1.0))  # a spike in what is reported
    spikes = mon.spikes
    assert spikes.step.tolist() == [90]
    assert spikes.batches.iloc[0] == [{"step": s} for s in range(86, 91)]


def test_batch_identity_hash_accumulation_and_ring(tmp_path):
    ids = torch.arange(12).reshape(3, 4)
    assert content_hash({"input_ids": ids[:, :3]}) == crc(ids[:, :3])  # a view: its values
    assert content_hash((ids, torch.ones(3))) == content_hash(ids) == crc(ids)
    assert content_hash(torch.randn(3, 4)) is None  # not token ids
    assert content_hash({"x": ids}) is None and content_hash(3) is None
    assert content_hash(ids.bool()) is None and content_hash(ids.to_sparse()) is None
    assert content_hash(ids.to("meta")) is None  # not on the host: never copied there
    assert content_hash(ids.int()) == crc(ids.int())  # any integer dtype
    if torch.cuda.is_available():
        assert content_hash(ids.cuda()) is None  # never a device→host copy

    torch.manual_seed(0)
    model = nn.Embedding(12, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [ids + i for i in range(5)]  # an epoch of 5 batches, 2 a step
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r")
    recorders = []

    def step_fn(m, b):
        recorders.append(mon._session.recorder)  # the run's recorder, read after it ends
        return m(b % 12).square().mean()

    mon.start(step_fn, batches, max_steps=40, accumulate=2, display=False)
    mon.wait()
    ring = list(recorders[-1].batch_ids.ring)
    assert len(ring) == min(40, RING) and ring[-1]["step"] == 40
    first, second = ring[0], ring[1]  # steps 1 and 2: batches 0-1, 2-3
    both = zlib.crc32(batches[1].numpy(), zlib.crc32(batches[0].numpy()))
    assert first == {"step": 1, "epoch": 0, "index": 0, "micro": 2, "hash": f"{both:08x}"}
    assert (second["epoch"], second["index"]) == (0, 2)
    third = ring[2]  # batch 4, then the next epoch's first
    assert (third["epoch"], third["index"]) == (0, 4)


def test_own_loop_spike_names_its_batch(tmp_path):
    """`mon.log(batch=...)`: the loop's batch is recorded as start() records it (a count
    of the batches given as its index, the CRC-32 of its token ids), so run.spikes names
    the corrupt batch of a loop of the user's own."""
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=600)
    model, opt, gen = demo.model, demo.optimizer, torch.Generator().manual_seed(1)
    given = []
    with nbwatch.Monitor(model, opt, demo.scheduler, run_dir=tmp_path / "r",
                         display=False) as mon:
        for s, b in zip(range(1, 66), demo.train):
            b = corrupt(b, gen) if s == 60 else b
            given.append(b)
            loss = masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            demo.scheduler.step()
            opt.zero_grad()
            mon.log(loss=loss, mask=b["mask"], batch=b)
    spikes = nbwatch.open_run(tmp_path / "r").spikes
    assert spikes.step.tolist() == [60]
    assert spikes.batches.iloc[0] == [{"step": s, "index": s - 1,
                                       "hash": crc(given[s - 1]["input_ids"])}
                                      for s in range(56, 61)]


def test_own_loop_batch_epoch_and_index(tmp_path):
    """epoch= with the batch: the own count starts again at each new epoch; index= is
    taken as given; neither is a figure. A bad one is refused in one line, and log() can
    be called again for that step, with the same count."""
    torch.manual_seed(0)
    model = nn.Embedding(12, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [(torch.arange(12).reshape(3, 4) + i) % 12 for i in range(30)]  # an epoch
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for s in range(1, 101):
            epoch, i = divmod(s - 1, 30)
            loss = model(batches[i]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if s == 1:
                with pytest.raises(ValueError, match="index=-1"):
                    mon.log(loss=loss, batch=batches[i], index=-1)
                with pytest.raises(TypeError, match="epoch='0'"):
                    mon.log(loss=loss, batch=batches[i], epoch="0")
                with pytest.raises(TypeError, match="batch=3 is a int"):
                    mon.log(loss=loss, batch=3)
            where = {"epoch": epoch, **({"index": 100 + i} if epoch == 3 else {})}
            if s == 68:  # a log() that raises after taking its batch: its count taken back
                with pytest.raises(TypeError, match="val is a str"):
                    mon.log(loss=loss, batch=batches[i], val="abc", **where)
            mon.log(loss=loss * (50.0 if s in (70, 95) else 1.0), batch=batches[i], **where)
    spikes = mon.spikes
    assert spikes.step.tolist() == [70, 95]
    crcs = [crc(b) for b in batches]
    assert spikes.batches.iloc[0] == [{"step": s, "epoch": 2, "index": s - 61,
                                       "hash": crcs[s - 61]} for s in range(66, 71)]
    assert spikes.batches.iloc[1] == [{"step": s, "epoch": 3, "index": 100 + s - 91,
                                       "hash": crcs[s - 91]} for s in range(91, 96)]
    assert not {"train/epoch", "train/index"} & set(mon.df.columns)
