"""A real JupyterLab (and Notebook 7) server on 127.0.0.1 and Debian's headless Chromium
driven by Playwright; no request leaves 127.0.0.1. Screenshots go to `artifacts/`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = os.environ.get("NBWATCH_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage"]

# What the quickstart's "steps/demo" cell becomes in a test: a smaller model, a pause in
# each step so a run lasts while the test acts, one torch thread (the browser needs a core).
PARAMS = """\
import time as _time, torch
torch.set_num_threads(1)
steps = {steps}
demo = make_demo(d=32, layers=2, heads=2, ctx=48, batch_size=4, max_steps=steps)
_inner = demo.step_fn
def _slow_step(model, batch, _n=[0]):
    _n[0] += 1
    if _n[0] == {fail_at}:
        raise RuntimeError("the test's step {fail_at} raised on purpose")
    _time.sleep({sleep})
    return _inner(model, batch)
demo.step_fn = _slow_step
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `jupyter lab` or `jupyter notebook` process serving `root`."""

    def __init__(self, app: str, root: Path, home: Path):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR",
                    "JUPYTERLAB_WORKSPACES_DIR", "IPYTHONDIR"):
            env[var] = str(home / var.lower())
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        # No "would you like news?" toast over the dashboard (and no fetch to the internet).
        news = home / "jupyterlab_settings_dir" / "@jupyterlab" / "apputils-extension"
        news.mkdir(parents=True, exist_ok=True)
        (news / "notification.jupyterlab-settings").write_text(
            '{"fetchNews": "false", "checkForUpdates": false}')
        cls = "LabApp" if app == "lab" else "JupyterNotebookApp"
        self.log = open(home / f"{app}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", app, "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--port={self.port}", "--ServerApp.port_retries=0", "--ServerApp.token=",
             "--ServerApp.password=", "--allow-root", f"--ServerApp.root_dir={root}",
             f"--{cls}.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.api("GET", "/api/status")
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(
                        f"jupyter {app} did not start; see {self.log.name}") from None
                time.sleep(0.3)

    def api(self, method: str, path: str):
        req = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        for s in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{s['id']}")
        for k in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{k['id']}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} missing: apt-get install -y chromium (never `playwright install`)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@contextmanager
def exported_page(browser, run_dir: Path, html: Path) -> Iterator[tuple[object, list[str]]]:
    """The run's HTML export open and drawn in a fresh page: (page, its page errors)."""
    from nbwatch.export import export_html

    path = export_html(run_dir, html)
    page = browser.new_context(viewport={"width": 1400, "height": 1400}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
        yield page, errors
    finally:
        page.context.close()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("nbroot")


def _server(app: str, workdir: Path, tmp_path_factory):
    srv = Server(app, workdir, tmp_path_factory.mktemp(f"home-{app}"))
    yield srv
    srv.shutdown_kernels()
    srv.stop()


@pytest.fixture(scope="session")
def lab(workdir, tmp_path_factory):
    yield from _server("lab", workdir, tmp_path_factory)


@pytest.fixture(scope="session")
def nb7(workdir, tmp_path_factory):
    yield from _server("notebook", workdir, tmp_path_factory)


def write_notebook(root: Path, name: str, steps: int = 5000, sleep: float = 0.04,
                   fail_at: int = -1) -> Path:
    """A copy of notebooks/quickstart.ipynb with test parameters and its own run folder."""
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    # the own-loop section trains a second model: tests/test_notebooks.py runs it
    nb.cells = [c for c in nb.cells if "own-loop" not in c.metadata.get("tags", [])]
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "make_demo(" in c.source and "import" not in c.source]
    assert params, "quickstart.ipynb lost its `demo = make_demo(...)` cell"
    params[0].source = PARAMS.format(steps=steps, sleep=sleep, fail_at=fail_at)
    start = [c for c in code if "nbwatch.Monitor(" in c.source][0]
    start.source = start.source.replace(
        "config=demo.config", f"config=demo.config, run_dir='runs/{name}'")
    assert f"runs/{name}" in start.source
    shutil.rmtree(root / "runs" / name, ignore_errors=True)
    path = root / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture
def page(browser, request):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1800})
    from tests.browser.harness import local_only

    blocked = local_only(ctx)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.blocked = blocked
    pg.errors = errors
    yield pg
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"))
    finally:
        ctx.close()
    assert not [e for e in errors if "nbwatch" in e or "plotly" in e.lower()], errors
