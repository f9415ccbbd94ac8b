"""`nbwatch.compare` and `nbwatch ls` on three real short runs of different LR."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.cli import main
from nbwatch.comparison import list_runs
from nbwatch.demo import TinyGPT
from tests.conftest import make_batches, tiny_step

LRS = (3e-4, 1e-3, 3e-3)
STEPS = 24


def make_runs(root: Path, lrs=LRS, steps: int = STEPS) -> list[Path]:
    """One finished run per LR under `root` (val every 8 steps), same seed and data."""
    batches = make_batches(8)
    dirs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 3 ms a step; 2 OpenMP threads on 2 busy cores: ~0.4 s
    try:
        for lr in lrs:
            dirs.append(_one_run(root, lr, batches, steps))
    finally:
        torch.set_num_threads(threads)
    return dirs


def _one_run(root: Path, lr: float, batches: list, steps: int, val: bool = True) -> Path:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def val_fn(m):
        return float(tiny_step(m, batches[0])["logits"].float().std())  # any float will do

    d = root / f"lr{lr:g}"
    mon = nbwatch.Monitor(model, opt, run_dir=d, name=f"lr={lr:g}",
                          config={"lr": lr, "batch": 4, "model": {"d": 32, "layers": 2}})
    mon.start(tiny_step, batches, max_steps=steps, val_fn=val_fn if val else None,
              eval_every=8 if val else None, hist_every=8, display=False).wait()
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    make_runs(root)
    return root


def test_where_filters_and_overlays_the_right_runs(runs):
    one = nbwatch.compare(runs, where={"lr": 3e-4})
    assert one.runs == ["lr0.0003"]
    two = nbwatch.compare(runs, where=lambda c: c["lr"] >= 1e-3)
    assert two.runs == ["lr0.001", "lr0.003"]
    assert nbwatch.compare(runs, where={"lr": lambda v: v < 2e-3}).runs == ["lr0.0003",
                                                                           "lr0.001"]
    assert nbwatch.compare(runs, where={"model.d": 32}).runs == ["lr0.0003", "lr0.001",
                                                                 "lr0.003"]

    fig = two.figure()
    names = [(t.name, t.yaxis) for t in fig.data]
    assert names == [("lr0.001", "y"), ("lr0.001", "y2"), ("lr0.003", "y"), ("lr0.003", "y2")]
    # The overlaid curves are the runs' own numbers.
    for label in two.runs:
        df = nbwatch.open_run(runs / label).df
        tr = [t for t in fig.data if t.name == label and t.yaxis == "y"][0]
        np.testing.assert_allclose(tr.y, df["loss/train"].to_numpy(), rtol=1e-6)
        assert list(tr.x) == df.index.tolist()
    wide = two.wide("loss/train")
    assert list(wide.columns) == two.runs and wide.index.tolist() == list(range(1, STEPS + 1))
    assert not np.allclose(wide["lr0.001"], wide["lr0.003"])  # different LRs, different runs
    assert sorted(two.df.columns) == ["metric", "run", "step", "value", "wall"]
    assert set(two.df.metric) == {"loss/train", "loss/val"}


def test_config_diff_and_summary(runs):
    cmp = nbwatch.compare([runs / "lr0.003", runs / "lr0.0003"])
    assert cmp.runs == ["lr0.003", "lr0.0003"]  # the order given
    assert list(cmp.config_diff.columns) == ["lr"]
    assert cmp.config_diff["lr"].tolist() == [3e-3, 3e-4]
    s = cmp.summary
    assert s["state"].tolist() == ["finished", "finished"]
    assert s["steps"].tolist() == [STEPS, STEPS] and s["max_steps"].tolist() == [STEPS, STEPS]
    for label in cmp.runs:
        df = nbwatch.open_run(runs / label).df
        val = df["loss/val"].dropna()
        assert s.loc[label, "best_val"] == pytest.approx(val.min())
        assert s.loc[label, "best_val_step"] == val.idxmin()
        assert s.loc[label, "last_train"] == pytest.approx(df["loss/train"].iloc[-1])
        assert s.loc[label, "wall_s"] > 0


def test_x_wall_is_seconds_since_start(runs):
    cmp = nbwatch.compare(runs, metrics="loss/train", x="wall")
    d = cmp.df[cmp.df.run == "lr0.001"]
    assert (d.wall >= 0).all() and d.wall.is_monotonic_increasing
    fig = cmp.figure()
    assert len(fig.data) == 3 and fig.layout.xaxis.title.text == "seconds since start"
    np.testing.assert_allclose(fig.data[1].x, d.wall.to_numpy())


def test_clear_errors(runs, tmp_path):
    with pytest.raises(ValueError, match=r"none of the 3 runs matches.*lr in \{0.0003, 0.001"):
        nbwatch.compare(runs, where={"lr": 1.0})
    with pytest.raises(ValueError, match="no compared run recorded 'loss/vall'"):
        nbwatch.compare(runs, metrics=["loss/vall"])
    with pytest.raises(FileNotFoundError, match="holds no nbwatch run"):
        nbwatch.compare([tmp_path])
    with pytest.raises(FileNotFoundError, match="no nbwatch runs under"):
        nbwatch.compare(tmp_path)
    with pytest.raises(ValueError, match="x must be"):
        nbwatch.compare(runs, x="time")
    from nbwatch.store import RunStore

    RunStore(tmp_path / "empty").close()  # a run that has recorded no step yet
    with pytest.raises(ValueError, match="no compared run has recorded a step yet"):
        nbwatch.compare([tmp_path / "empty"])
    one = runs / "lr0.001"
    with pytest.raises(ValueError, match="is given twice"):
        nbwatch.compare([one, f"{one}/", runs / "lr0.003"])


def test_a_run_compared_from_inside_its_folder_is_labelled(runs, monkeypatch):
    monkeypatch.chdir(runs / "lr0.001")
    assert nbwatch.compare(".").runs == ["lr0.001"]
    assert list_runs(".").run.tolist() == ["lr0.001"]


def test_a_comparison_follows_a_run_still_being_written(tmp_path):
    """Shown again after the run went on, a comparison reads its new steps: its figure
    and `.df` agree with its summary."""
    batches = make_batches(4)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "live", display=False) as mon:
        for i in range(12):
            out = tiny_step(model, batches[i % 4])
            loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"], out["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
            if i == 5:
                mon.df  # noqa: B018 - a read records the steps waiting for their batch
                cmp = nbwatch.compare([tmp_path / "live"])
                assert cmp.df.step.max() == 6
    assert cmp.df.step.max() == 12 and int(cmp.summary.steps.iloc[0]) == 12


def test_ls_lists_state_steps_best_val_and_config(runs, capsys):
    assert main(["ls", str(runs)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["run", "state", "steps"] and out[0].endswith("config")
    body = {line.split()[0]: line for line in out[1:]}
    assert list(body) == ["lr0.0003", "lr0.001", "lr0.003"]
    for label, line in body.items():
        best = nbwatch.compare([runs / label]).summary["best_val"].iloc[0]
        assert f" finished {STEPS}/{STEPS} " in " ".join(line.split())
        assert f"{best:.4f}" in line
        assert line.endswith(f"lr={label.removeprefix('lr')}")  # only the key that differs

    assert main(["ls", str(runs), "--where", "lr=0.001", "--keys", "lr,model.d"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("lr0.001")
    assert out[1].endswith("lr=0.001  model.d=32")

    assert main(["ls", str(runs), "--sort", "best"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    best = [float(r.split()[3]) for r in rows]
    assert best == sorted(best)


def test_list_runs_is_the_frame_ls_prints(runs):
    from nbwatch.comparison import list_runs

    df = list_runs(runs, sort="best")
    assert list(df.columns[:9]) == ["run", "state", "steps", "max_steps", "best_val",
                                    "best_val_step", "last_train", "wall_s", "error"]
    assert list(df.columns[9:]) == ["lr"]  # the config key that differs
    assert df["error"].isna().all()  # none failed
    assert df["best_val"].is_monotonic_increasing and set(df["state"]) == {"finished"}
    assert list(list_runs(runs, where={"lr": 0.001})["run"]) == ["lr0.001"]
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        list_runs(runs / "nope")


def test_ls_on_an_empty_folder(tmp_path, capsys):
    assert main(["ls", str(tmp_path)]) == 0
    assert "no nbwatch runs under" in capsys.readouterr().out


def test_default_metrics_without_val_fn(runs, tmp_path):
    """Runs without a val_fn have no loss/val: the default compares loss/train, and says so."""
    batches = make_batches(4)
    plain = [_one_run(tmp_path, lr, batches, steps=4, val=False) for lr in (1e-3, 3e-3)]
    cmp = nbwatch.compare(plain)
    assert cmp.metrics == ["loss/train"]
    assert "no compared run recorded loss/val" in cmp.note and "loss/train" in cmp.note
    assert "on loss/train (no run recorded loss/val)" in repr(cmp)
    assert set(cmp.df.metric) == {"loss/train"} and len(cmp.figure().data) == 2
    assert cmp.summary["best_val"].isna().all()
    # one run with val is enough for both default metrics, and no note
    mixed = nbwatch.compare([plain[0], runs / "lr0.001"])
    assert mixed.metrics == ["loss/train", "loss/val"] and mixed.note is None
    assert nbwatch.compare(plain, metrics="loss/train").note is None  # chosen, not defaulted
    with pytest.raises(ValueError, match="no compared run recorded 'loss/val'"):
        nbwatch.compare(plain, metrics=["loss/train", "loss/val"])  # asked for: an error


def test_a_resumed_run_keeps_its_start(tmp_path):
    """A resume used to overwrite the run's start: its wall time read the last segment's
    alone, and the steps before the resume came before 0 s on compare's time axis."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(steps, resume):
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False,
                             resume=resume, checkpoint_every=5) as mon:
            for _ in range(mon.step, steps):
                model(torch.randn(8, 4)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                mon.log(loss=torch.tensor(1.0))
                time.sleep(0.05)

    train(5, False)
    started = nbwatch.open_run(tmp_path / "r").meta["started"]
    train(10, True)
    meta = nbwatch.open_run(tmp_path / "r").meta
    assert meta["started"] == started and meta["opened"] > started
    d = nbwatch.compare([tmp_path / "r"], metrics="loss/train", x="wall").df
    assert (d.wall >= 0).all() and d.wall.is_monotonic_increasing and len(d) == 10
    assert nbwatch.compare([tmp_path / "r"]).summary.wall_s.iloc[0] >= 0.45  # 10 × 0.05 s
