"""Update ratios ‖ΔW‖/‖W‖ per layer: with the histograms by default, every step with
`update_every=1`, equal to what the loop itself sees change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbwatch


def model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def layer_ratio(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    delta = sum(float((a - b).pow(2).sum()) for a, b in zip(after, before)) ** 0.5
    return delta / sum(float(b.pow(2).sum()) for b in before) ** 0.5  # ‖W‖ before


def train(mon, m, opt, steps: int) -> list[dict[str, float]]:
    seen = []
    with mon:
        for _ in range(steps):
            loss = m(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            before = {k: [p.detach().clone() for p in m[int(k)].parameters()] for k in "02"}
            opt.step()
            opt.zero_grad()
            seen.append({k: layer_ratio(b, [p.detach() for p in m[int(k)].parameters()])
                         for k, b in before.items()})
            mon.log(loss=loss)
    return seen


def test_every_step_ratios_equal_the_weights_change(tmp_path):
    m, opt = model_and_opt()
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", update_every=1, hist_every=10,
                          display=False)
    seen = train(mon, m, opt, 25)
    df = nbwatch.open_run(tmp_path / "r").df
    for k in "02":
        got = df[f"update_ratio/{k}"]
        assert got.notna().all()
        assert got.tolist() == pytest.approx([s[k] for s in seen], rel=1e-4)
    run = nbwatch.open_run(tmp_path / "r")
    assert run.histograms("weight/0")[0].tolist() == [1, 10, 20]  # histograms keep theirs


def test_by_default_ratios_come_with_the_histograms(tmp_path):
    m, opt = model_and_opt()
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", hist_every=10, display=False)
    train(mon, m, opt, 25)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df["update_ratio/0"].dropna().index.tolist() == [1, 10, 20]


def test_start_overrides_update_every_without_histograms(tmp_path):
    m, opt = model_and_opt()
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False)
    data = [torch.randn(4, 8) for _ in range(12)]
    mon.start(lambda model, x: model(x).pow(2).mean(), data, max_steps=12, update_every=5,
              hist_every=0, dry_run=False)
    mon.wait()
    run = nbwatch.open_run(tmp_path / "r")
    assert run.df["update_ratio/2"].dropna().index.tolist() == [1, 5, 10]
    assert run.reader.histogram_names() == []


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_update_every_must_be_a_positive_int(tmp_path, bad):
    m, opt = model_and_opt()
    with pytest.raises(ValueError, match="update_every must be a positive int"):
        nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", update_every=bad, display=False)
