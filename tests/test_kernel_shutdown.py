"""A kernel that goes away while a run trains in its thread (a headless notebook run by
nbclient or `nbconvert --execute`, "Restart kernel", "Shut down kernel"): the run ends as a
script's does, stopped and saying why, never `finished` short of its end, and its folder
opens. A real kernel through jupyter_client, shut down the way nbclient and JupyterLab do."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import nbwatch
from tests.conftest import until

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]


class Kernel:
    """A python3 kernel in its own process; `run(code)` waits for the cell's reply."""

    def __init__(self, cwd: Path):
        self.km = jupyter_client.KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 120) -> None:
        reply = self.kc.execute_interactive(textwrap.dedent(code), timeout=timeout,
                                            output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]

    def shut_down(self, restart: bool = False) -> None:
        """As nbclient at the end of a notebook (graceful: a shutdown request, SIGTERM
        after 2.5 s, SIGKILL after 5 s), or as "Restart kernel"."""
        if restart:
            self.km.restart_kernel(now=False)
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def in_kernel(tmp_path: Path, code: str) -> Kernel:
    k = Kernel(tmp_path)
    try:
        k.run(f"import sys, torch; sys.path.insert(0, {str(ROOT)!r}); torch.set_num_threads(1)")
        k.run(code)
    except BaseException:
        k.shut_down()
        raise
    return k


def training_in_kernel(tmp_path: Path, run_dir: Path, eval_every: int, steps: int) -> Kernel:
    """A kernel whose `mon` trains the demo's tiny model in the background into `run_dir`,
    returned once the folder holds `steps` steps."""
    k = in_kernel(tmp_path, f"""
        import nbwatch
        from nbwatch.demo import make_demo
        demo = make_demo(d=32, layers=2, heads=2, ctx=32, max_steps=100_000)
        mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler,
                              run_dir={str(run_dir)!r})
        mon.start(max_steps=100_000, eval_every={eval_every}, display=False,
                  **demo.start_kwargs())
    """)
    try:
        until(lambda: (run_dir / "nbwatch.db").exists()
              and nbwatch.open_run(run_dir).step >= steps,
              120, f"the run in the kernel to take {steps} steps")
    except BaseException:
        k.shut_down()
        raise
    return k


@pytest.mark.slow
@pytest.mark.parametrize("restart", [False, True], ids=["shutdown", "restart"])
def test_a_kernel_shut_down_mid_run_leaves_it_stopped_with_the_reason(tmp_path, restart):
    run_dir = tmp_path / "quick"
    training_in_kernel(tmp_path, run_dir, eval_every=50, steps=5).shut_down(restart=restart)
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped", (run.state, run.events.tail())
    assert run.meta["stopped_by"].startswith("kernel shut down at step ")
    said = run.events[run.events.kind == "state"].message
    assert said.str.contains("kernel shut down at step").any(), list(said)
    assert run.step >= 5 and len(run.df) == run.step  # every recorded step is there
    # the stop checkpoint is written when the stop is taken within the shutdown's grace
    # (or the periodic one of the step it stopped at: the same weights, written once)
    stop = run.events[(run.events.kind == "checkpoint")]
    if len(stop):
        last = stop.iloc[-1]
        assert last.data["reason"] == "stop" or (
            last.data["reason"] == "periodic" and last.step == run.step), stop.message.tolist()


@pytest.mark.slow
def test_a_trainer_whose_kernel_shuts_down_mid_fit_is_stopped_not_finished(tmp_path):
    pytest.importorskip("transformers")
    run_dir = tmp_path / "hf"
    k = in_kernel(tmp_path, f"""
        import nbwatch.hf
        from pathlib import Path
        from tests.test_hf import make_trainer
        trainer = make_trainer(Path({str(tmp_path / "out")!r}), max_steps=300, delay=0.05)
        run = nbwatch.hf.start(trainer, run_dir={str(run_dir)!r}, display=False)
    """)
    try:
        until(lambda: (run_dir / "nbwatch.db").exists() and nbwatch.open_run(run_dir).step >= 3,
              120, "the Trainer in the kernel to take 3 steps")
    finally:
        k.shut_down()
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped", (run.state, list(run.events.message))
    assert run.meta["stopped_by"].startswith("kernel shut down at step ")
    assert 3 <= run.step < 300


@pytest.mark.slow
def test_a_fit_whose_kernel_shuts_down_before_its_first_step_opens_stopped(tmp_path):
    """Lightning's setup (here its sanity-check validation) can take minutes; the folder the
    dashboard names must hold a run from the moment start() returns, and say how it ended."""
    pytest.importorskip("lightning")
    run_dir = tmp_path / "pl"
    k = in_kernel(tmp_path, f"""
        import time, torch, nbwatch.lightning
        from pathlib import Path
        from tests.test_lightning import TinyModule, loader, make_trainer

        class Slow(torch.utils.data.Dataset):
            def __len__(self):
                return 2
            def __getitem__(self, i):
                time.sleep(600)

        trainer = make_trainer(Path({str(tmp_path / "out")!r}), num_sanity_val_steps=1)
        run = nbwatch.lightning.start(
            trainer, TinyModule(), train_dataloaders=loader(4),
            val_dataloaders=torch.utils.data.DataLoader(Slow(), batch_size=None),
            run_dir={str(run_dir)!r}, display=False)
    """)
    try:
        run = until(lambda: (run_dir / "nbwatch.db").exists() and nbwatch.open_run(run_dir),
                    30, "the run folder to open")
        assert run.state == "starting"
    finally:
        k.shut_down()
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped"
    assert run.meta["stopped_by"] == "kernel shut down before the first step"


def test_a_fit_that_fails_before_its_first_step_reads_failed(tmp_path):
    pytest.importorskip("lightning")
    import nbwatch.lightning
    from tests.test_lightning import TinyModule, loader, make_trainer

    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            raise KeyError("input_ids")

    handle = nbwatch.lightning.start(  # fails in the sanity check, before the first step
        make_trainer(tmp_path / "out", num_sanity_val_steps=1), TinyModule(),
        train_dataloaders=loader(4),
        val_dataloaders=torch.utils.data.DataLoader(Broken(), batch_size=None),
        run_dir=tmp_path / "f", display=False)
    with pytest.raises(KeyError):
        handle.wait(60)
    run = nbwatch.open_run(tmp_path / "f")
    assert run.state == "failed" and handle.state == "failed"
    assert run.events.message.iloc[-1] == "KeyError: 'input_ids'"


@pytest.mark.slow
def test_a_stop_checkpoint_cut_short_by_the_shutdown_leaves_the_run_stopped(tmp_path):
    """The shutdown's grace (2.5 s before SIGTERM) can end before the stop checkpoint is
    written (a big model, a slow disk; 1 of 12 headless quickstart runs). The stop taken at
    the step boundary used to write `stopping` over the `stopped` recorded at once, and the
    folder read `stopping`, then `stale`. It reads `stopped`, with the reason."""
    run_dir = tmp_path / "slow"
    k = in_kernel(tmp_path, f"""
        import time
        import nbwatch
        from nbwatch.demo import make_demo
        demo = make_demo(d=32, layers=2, heads=2, ctx=32, max_steps=100_000)
        slow = [False]
        plain = demo.model.state_dict

        def state_dict(*a, **kw):  # a checkpoint that takes longer than the grace
            if slow[0]:
                time.sleep(8)
            return plain(*a, **kw)

        demo.model.state_dict = state_dict
        mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler,
                              run_dir={str(run_dir)!r})
        mon.start(max_steps=100_000, eval_every=10_000, display=False, **demo.start_kwargs())
    """)
    try:
        until(lambda: (run_dir / "nbwatch.db").exists() and nbwatch.open_run(run_dir).step >= 5,
              120, "the run in the kernel to take 5 steps")
        k.run("slow[0] = True")
    finally:
        k.shut_down()
    run = nbwatch.open_run(run_dir)
    assert run.meta["state"] == "stopped", (run.meta["state"], list(run.events.message))
    assert run.state == "stopped"
    assert run.meta["stopped_by"].startswith("kernel shut down at step ")
