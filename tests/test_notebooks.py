"""The notebooks that ship run top to bottom (Run All), as a newcomer would run them: a
real kernel through nbclient, with a smaller model so that it takes seconds."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]

SMALL = """\
import torch
torch.set_num_threads(1)
steps = 60
demo = make_demo(d=32, layers=2, heads=2, ctx=48, batch_size=4, max_steps=steps)
"""

CHECK = """\
mon.wait(); mon2.wait()
assert mon.state == "finished" and mon.step == steps, (mon.state, mon.step)
assert mon2.state == "finished" and mon2.step == 200, (mon2.state, mon2.step)
df2 = mon2.df
assert df2["loss/val"].notna().sum() == 4 and df2["grad_norm/global"].notna().all()
assert mon2.events.query("kind == 'checkpoint'").step.max() == 200
assert nbwatch.open_run(mon2.run_dir).attention(), "the probe drew no attention map"
print("ok")
"""


ADAPTER_CHECK = """\
run.wait()
assert run.state == "finished" and run.step == steps, (run.state, run.step)
df = run.df
assert df["loss/train"].notna().sum() == steps and df["loss/val"].notna().any()
assert df["grad_norm/global"].notna().all() and nbwatch.open_run(run.run_dir).attention()
print("ok")
"""


def run_notebook(nb, tmp_path: Path) -> None:
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    last = nb.cells[-1].outputs
    assert any("ok" in o.get("text", "") for o in last), last
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
    check_saved(nb, tmp_path / "saved.ipynb")


def check_saved(nb, path: Path) -> None:
    """Saved with its dashboards, the notebook stays valid nbformat, its widget state has the
    `state` key GitHub's renderer requires, and where widgets do not render a dashboard's
    text names its run folder."""
    nbformat.write(nb, path)
    saved = nbformat.read(path, as_version=4)
    nbformat.validate(saved)
    for entry in saved.metadata.get("widgets", {}).values():
        assert "state" in entry, list(entry)
    views = [o["data"] for c in saved.cells if c.cell_type == "code" for o in c.outputs
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert views, "no dashboard was displayed"
    assert all(v["text/plain"].startswith("nbwatch dashboard of ") for v in views), views


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_trainer", "lightning"])
def test_framework_notebooks_run_top_to_bottom(tmp_path, name):
    pytest.importorskip("transformers" if name == "hf_trainer" else "lightning")
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and c.source.strip() == "steps = 300"]
    assert cells, f"{name}.ipynb lost its `steps = 300` cell"
    cells[0].source = "torch.set_num_threads(1)\nsteps = 12"
    nb.cells.append(nbformat.v4.new_code_cell(ADAPTER_CHECK))
    run_notebook(nb, tmp_path)


@pytest.mark.slow
def test_quickstart_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "make_demo(" in c.source and "import" not in c.source]
    assert params, "quickstart.ipynb lost its `demo = make_demo(...)` cell"
    params[0].source = SMALL
    assert any(".run(train)" in c.source for c in code), "the own-loop cell is gone"
    nb.cells.append(nbformat.v4.new_code_cell("mon"))  # a Monitor as a cell's result
    nb.cells.append(nbformat.v4.new_code_cell(CHECK))
    run_notebook(nb, tmp_path)
    # a cell ending in start() or run() shows one dashboard, not the Monitor's repr under
    # it; `mon` alone shows one
    shows = [c for c in nb.cells if c.cell_type == "code" and (
        c.source.strip() == "mon" or c.source.strip().splitlines()[-1].startswith(
            ("mon.start(", "mon2.run(")))]
    assert len(shows) == 3
    for c in shows:
        views = [o for o in c.outputs if "application/vnd.jupyter.widget-view+json"
                 in o.get("data", {})]
        said = [o["data"]["text/plain"] for o in c.outputs if "text/plain" in o.get("data", {})]
        assert len(views) == 1 and not any("<nbwatch.Monitor" in t for t in said), c.outputs
