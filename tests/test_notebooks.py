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


@pytest.mark.slow
def test_quickstart_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "make_demo(" in c.source and "import" not in c.source]
    assert params, "quickstart.ipynb lost its `demo = make_demo(...)` cell"
    params[0].source = SMALL
    assert any(".run(train)" in c.source for c in code), "the own-loop cell is gone"
    nb.cells.append(nbformat.v4.new_code_cell(CHECK))
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    last = nb.cells[-1].outputs
    assert any("ok" in o.get("text", "") for o in last), last
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
