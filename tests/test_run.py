"""A run read back from its folder: what a read of keys it lacks says."""

from __future__ import annotations

import warnings

import pytest
import torch

import nbwatch


def _steps(mon: nbwatch.Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer,
           n: int) -> None:
    for _ in range(n):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.log(loss=loss)


def test_a_key_the_run_lacks_is_a_nan_column_and_a_typo_names_the_key_it_has(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    _steps(mon, model, opt, 5)
    mon.close()
    run = nbwatch.open_run(tmp_path / "run")

    with pytest.warns(UserWarning, match=r"'loss/trian'.*did you mean 'loss/train'"):
        got = run.scalars(["loss/train", "loss/trian"])
    assert list(got.columns) == ["loss/train", "loss/trian"]
    assert got["loss/train"].notna().all() and got["loss/trian"].isna().all()
    assert len(got) == 5

    # an ended run that never evaluated: its loss/val is said to be absent, not a typo
    with pytest.warns(UserWarning, match=r"'loss/val' is not recorded.*df.columns"):
        assert run.scalars(["loss/val"])["loss/val"].isna().all()
    with pytest.warns(UserWarning, match=r"system/\.\.\."):
        assert "gpu0/util" in run.system(["gpu0/util"]).columns

    # one key may come bare, not spelt out letter by letter
    assert list(run.scalars("loss/train").columns) == ["loss/train"]


def test_a_live_run_reads_a_key_not_yet_recorded_without_a_warning(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    try:
        _steps(mon, model, opt, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = nbwatch.open_run(tmp_path / "run").scalars(["loss/train", "loss/val"])
        assert list(got.columns) == ["loss/train", "loss/val"]
    finally:
        mon.close()
