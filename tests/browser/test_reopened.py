"""A notebook saved with its widget state (JupyterLab's "Save Widget State Automatically")
and reopened after the kernel that ran it has gone: its dashboard comes back from the saved
state, with no kernel behind it."""

from __future__ import annotations

import json
import urllib.request

import nbformat
import pytest
from nbformat.sign import NotebookNotary

from nbwatch.widget import Dashboard

from .harness import open_notebook

pytestmark = pytest.mark.browser


WIDGETS = "/lab/api/settings/@jupyter-widgets/jupyterlab-manager:plugin"


def widget_settings(lab, raw: dict) -> None:
    body = json.dumps({"raw": json.dumps(raw)}).encode()
    req = urllib.request.Request(lab.url + WIDGETS, data=body, method="PUT",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).close()


@pytest.fixture
def lab_saving_widgets(lab):
    """JupyterLab with "Save Widget State Automatically" on (it restores saved widgets)."""
    widget_settings(lab, {"saveState": True})
    yield lab
    widget_settings(lab, {})
    lab.shutdown_kernels()


class Gone:  # what the dashboard read of the Monitor that ran it, in the kernel now gone
    state, running = "running", True


def saved_with_widget_state(root, name: str) -> str:
    """A notebook whose one cell showed a live dashboard, saved with the widget state."""
    run_dir = str(root / "runs" / name)
    dash = Dashboard(run_dir, monitor=Gone())
    try:
        state = Dashboard.get_manager_state(drop_defaults=False, widgets=[dash, dash.layout])
        view = {"model_id": dash.model_id, "version_major": 2, "version_minor": 0}
    finally:
        dash.close()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": state}
    cell = nbformat.v4.new_code_cell("mon.start(...)", execution_count=3)
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": view, "text/plain": repr(dash)})]
    nb.cells = [cell]
    NotebookNotary().sign(nb)  # saved by its user: trusted, its widget outputs render
    nbformat.write(nb, root / f"{name}.ipynb")
    return run_dir


def test_a_reopened_dashboard_without_its_kernel_names_its_folder_and_sends_nothing(
        page, lab_saving_widgets, workdir):
    """It showed the live controls enabled (a click reached no kernel) and "`%nbwatch
    RUN_DIR` reopens a finished run", a placeholder for the folder it knows."""
    run_dir = saved_with_widget_state(workdir, "reopened")
    open_notebook(page, f"{lab_saving_widgets.url}/lab/tree/reopened.ipynb?reset")
    page.wait_for_selector(".nbw-root .nbw-pause", timeout=30_000)
    assert page.locator(".nbw-pause").is_disabled()
    assert page.locator(".nbw-stop").is_disabled()
    status = page.locator(".nbw-status")
    page.wait_for_function(
        "(d) => document.querySelector('.nbw-status')?.textContent.includes(d)",
        arg=f"%nbwatch {run_dir}", timeout=20_000)
    assert "reopened after its kernel ended" in status.inner_text()
    assert page.locator(".nbw-pause").is_disabled()
    assert not page.errors, page.errors
