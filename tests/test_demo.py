import re
import subprocess
import sys

import nbwatch
from nbwatch.demo import PAD, collate, decode, encode, make_demo, make_samples, stdlib_text


def test_stdlib_text_makes_variable_length_padded_batches():
    lines = stdlib_text(max_files=5)
    samples = make_samples(lines, ctx=64)
    lengths = {len(s) for s in samples}
    assert len(lengths) > 20 and max(lengths) <= 65
    batch = collate(samples[:16])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["mask"].shape
    assert 0 < batch["mask"].float().mean() < 1  # there is padding to measure
    assert (batch["labels"][batch["mask"] == 0] == PAD).all()
    assert decode(encode("def f(x):\n")) == "def f(x):\n"


def test_demo_loss_falls(tmp_path):
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=80)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "d",
                          config=demo.config)
    mon.start(max_steps=80, eval_every=40, display=False, **demo.start_kwargs()).wait()
    df = mon.df
    assert df["loss/train"].iloc[-10:].mean() < df["loss/train"].iloc[:10].mean() - 1.0
    assert df["loss/val"].dropna().iloc[-1] < df["loss/val"].dropna().iloc[0]
    assert 0.05 < df["data/padding_ratio"].mean() < 0.9
    run = nbwatch.open_run(mon.run_dir)
    assert len(run.samples) == 2 and run.samples.text.iloc[0].startswith("def ")
    # Sampled, not greedy: a small model's greedy text is one character repeated.
    assert all(len(set(t[4:])) > 5 for t in run.samples.text), list(run.samples.text)
    tokens = run.reader.attention_tokens(80)
    assert tokens and all(isinstance(t, str) for t in tokens)


def test_cli_demo_and_ls(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "nbwatch.cli", "demo", "--steps", "10", "--eval-every", "5",
         "--run-dir", str(tmp_path / "runs" / "demo"), "--print-every", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "done: finished at step 10" in out.stdout
    # Progress lines say "val –" until the first eval, never "val nan".
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("step ")]
    assert lines and not any("nan" in ln for ln in lines), out.stdout
    # the means are said to be means; the LR is the newest step's (a warm-up moves it)
    assert "means of the last 20 steps" in out.stdout.split(lines[0])[0], out.stdout
    lrs = nbwatch.open_run(tmp_path / "runs" / "demo").df["lr"]
    for ln in lines:
        step, lr = re.search(r"^step\s+(\d+)/.*\blr (\S+)", ln).groups()
        assert lr == f"{lrs[int(step)]:.2e}", (ln, lrs.tolist())
    ls = subprocess.run([sys.executable, "-m", "nbwatch.cli", "ls", str(tmp_path / "runs")],
                        capture_output=True, text=True, timeout=60)
    assert re.search(r"^demo\s+finished\s+10/10\s", ls.stdout, re.M), ls.stdout
