"""Commands at a run's end: a checkpoint asked while the last step is recorded is taken."""

from __future__ import annotations

import itertools

import nbwatch
from nbwatch.demo import make_demo, masked_cross_entropy


def test_a_checkpoint_asked_as_the_last_step_is_recorded_is_taken(tmp_path):
    """`attach(run_dir).checkpoint()` from another handle lands in the store between the
    run's last `log()` and its end (the poll of the store runs every 0.25 s): it is applied,
    a checkpoint of the last step, not expired."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m, opt = demo.model, demo.optimizer
    run_dir = tmp_path / "r"
    mon = nbwatch.Monitor(m, opt, run_dir=run_dir, display=False)

    def train():
        for b in itertools.islice(itertools.cycle(demo.train), 20):
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
        other = nbwatch.attach(run_dir, display=False)
        other.checkpoint()  # the loop returns at once: the run ends
        other.close()

    mon.run(train).wait()
    assert mon.state == "finished", mon.error
    ev = mon.events
    outcome = ev[ev.data.map(lambda d: isinstance(d, dict) and d.get("command") == "checkpoint")]
    assert outcome.data.iloc[0]["outcome"] == "applied", outcome.message.tolist()
    saved = ev[ev.kind == "checkpoint"]
    assert saved.step.tolist() == [20], saved.message.tolist()  # one checkpoint of step 20
