"""Loss spikes and which batch caused them: a real run with one bad batch at a known place
in the data stream; the `loss_spike` alert names that step, and `run.spikes` that batch."""

import itertools
import zlib

import torch
from torch import nn

import nbwatch
from nbwatch.demo import VOCAB, make_demo
from nbwatch.recorder.batches import RING, content_hash
from tests.test_alerts_e2e import wait_state

EPOCH, EPOCHS_BEFORE, AT = 100, 2, 30  # the bad batch: epoch 2, position 30 → step 231


class Poisoned:
    """The demo's batches, `EPOCH` an epoch; in epoch `EPOCHS_BEFORE`, batch `AT` has
    random labels (a corrupt shard, say). Keeps each epoch's batches to check against."""

    def __init__(self, batches):
        self.batches, self.epochs = batches, []
        self.gen = torch.Generator().manual_seed(1)

    def __iter__(self):
        seen = []
        self.epochs.append(seen)
        for i, b in enumerate(itertools.islice(self.batches, EPOCH)):
            if len(self.epochs) - 1 == EPOCHS_BEFORE and i == AT:
                labels = torch.randint(0, VOCAB, b["labels"].shape, generator=self.gen)
                b = {**b, "input_ids": b["input_ids"].flip(0), "labels": labels}
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
    assert list(spikes.columns) == ["step", "loss", "median", "z", "batches"]
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
    if torch.cuda.is_available():
        assert content_hash(ids.cuda()) is None  # never a device→host copy

    torch.manual_seed(0)
    model = nn.Embedding(12, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [ids + i for i in range(5)]  # an epoch of 5 batches, 2 a step
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r")
    recorders = []

    def step_fn(m, b):
        recorders.append(mon._recorder)  # the run's recorder, read after it ends
        return m(b % 12).square().mean()

    mon.start(step_fn, batches, max_steps=40, accumulate=2, display=False)
    mon.wait()
    ring = list(recorders[-1].batches)
    assert len(ring) == min(40, RING) and ring[-1]["step"] == 40
    first, second = ring[0], ring[1]  # steps 1 and 2: batches 0-1, 2-3
    both = zlib.crc32(batches[1].numpy(), zlib.crc32(batches[0].numpy()))
    assert first == {"step": 1, "epoch": 0, "index": 0, "micro": 2, "hash": f"{both:08x}"}
    assert (second["epoch"], second["index"]) == (0, 2)
    third = ring[2]  # batch 4, then the next epoch's first
    assert (third["epoch"], third["index"]) == (0, 4)
