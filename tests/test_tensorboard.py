"""`nbwatch.to_tensorboard`: TensorBoard's own reader reads back what the run stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nbwatch
from tests.conftest import tiny_step

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_compare.py
    try:
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        d = tmp_path_factory.mktemp("tb") / "run"
        batches = make_batches(8)
        mon = nbwatch.Monitor(model, opt, run_dir=d)
        mon.start(tiny_step, batches, max_steps=20, eval_every=10, hist_every=10,
                  val_fn=lambda m: 1.5, sample_fn=lambda m: "<b>def</b> f():",
                  display=False).wait()
    finally:
        torch.set_num_threads(threads)
    return d


def read(logdir) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0,
                                                      "tensors": 0})
    ea.Reload()
    return ea


def test_scalars_and_histograms_read_back(run, tmp_path):
    logdir = nbwatch.to_tensorboard(run, tmp_path / "tb")
    ea = read(logdir)
    stored = nbwatch.open_run(run)
    df, walls = stored.df, stored.reader.walls()

    tags = ea.Tags()
    assert set(tags["scalars"]) == set(df.columns)
    for key in ("loss/train", "loss/val", "grad_norm/global", "lr"):
        col = df[key].dropna()
        events = ea.Scalars(key)
        assert [e.step for e in events] == col.index.tolist()
        np.testing.assert_array_equal([e.value for e in events], col.to_numpy(np.float32))
    assert [e.wall_time for e in ea.Scalars("loss/train")] == pytest.approx(walls.tolist())

    names = stored.reader.histogram_names()
    assert "weight/blocks.0.attn.qkv" in names and set(tags["histograms"]) == set(names)
    for name in names:
        steps, edges, counts = stored.histograms(name)
        events = ea.Histograms(name)
        assert [e.step for e in events] == steps.tolist()
        for e, edge, c in zip(events, edges, counts):
            h = e.histogram_value
            assert h.num == c.sum() and (h.min, h.max) == (edge[0], edge[-1])
            np.testing.assert_allclose(h.bucket_limit, edge)
            assert h.bucket[0] == 0
            np.testing.assert_array_equal(h.bucket[1:], c)

    text = ea.Tensors("samples/text_summary")
    assert [t.step for t in text] == [10, 20]
    assert text[0].tensor_proto.string_val[0].decode() == "<b>def</b> f():"


def test_refuses_to_mix_with_existing_event_files(run, tmp_path):
    nbwatch.to_tensorboard(run, tmp_path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        nbwatch.to_tensorboard(run, tmp_path)
    nbwatch.to_tensorboard(run, tmp_path, overwrite=True)
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert len(read(tmp_path).Scalars("loss/train")) == 20


def test_no_run_no_events(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no nbwatch run"):
        nbwatch.to_tensorboard(tmp_path / "nothing", tmp_path / "tb")
    assert not (tmp_path / "tb").exists()
