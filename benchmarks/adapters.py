"""Overhead of the framework adapters: the same fit with and without nbwatch, as ratios.

A 4-layer d=128 GPT-2 (Hugging Face `Trainer`) and the demo's 4-layer d=128 GPT
(Lightning), batch 16 × 128 tokens, AdamW, on the CPU; variants interleaved in one
process, several rounds each; each variant's time is the fit's wall time for `--steps`
optimizer steps (the same setup in both, so it cancels in the ratio). On 2 shared cores
that ratio moves by more than nbwatch costs, so a second table gives, for the watched
fit, the ratio step / (step − own) from the run's `time/nbwatch` (nbwatch's own time on
the training thread) and `time/step`, over the steps after the first `WARM`.

    python benchmarks/adapters.py [--steps 40] [--rounds 5] [--only hf|lightning]

The bare fit runs as nbwatch's `start()` runs the watched one: in a thread of its own, the
caller's OpenMP pool released (`overhead.py` says why); the order of the two alternates
by round. The watched fit's wall time includes nbwatch's start-up and close.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402

warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def batches(n: int, T: int = 128, B: int = 16, vocab: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, vocab, (B, T), generator=g) * mask
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    return out


WARM = 5  # steps left out of the own-time share: the first steps compile and warm up


def own_share(run_dir: Path) -> float:
    """nbwatch's share of the step time on the training thread, after `WARM` steps."""
    import nbwatch

    df = nbwatch.open_run(run_dir).df
    df = df[df.index > WARM]
    return float(df["time/nbwatch"].sum() / df["time/step"].sum())


def hf_fit(steps: int, root: Path, watched: bool) -> tuple[float, float]:
    import transformers as tf

    import nbwatch.hf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=256, n_positions=128,
                        bos_token_id=0, eos_token_id=0)
    rows = [{k: v[i] for k, v in b.items()} for b in batches(8) for i in range(16)]
    args = tf.TrainingArguments(
        output_dir=str(root / f"out{time.monotonic_ns()}"), max_steps=steps,
        per_device_train_batch_size=16, logging_steps=10**9, report_to=[],
        save_strategy="no", learning_rate=3e-4, use_cpu=True, disable_tqdm=True,
        log_level="error", seed=0)
    trainer = tf.Trainer(model=tf.GPT2LMHeadModel(cfg), args=args, train_dataset=rows)
    run_dir = root / f"hf{time.monotonic_ns()}"
    t0 = time.perf_counter()
    if watched:
        nbwatch.hf.start(trainer, run_dir=run_dir, display=False).wait()
    else:
        trainer.train()
    took = (time.perf_counter() - t0) / steps
    return took, own_share(run_dir) if watched else 0.0


def pl_fit(steps: int, root: Path, watched: bool) -> tuple[float, float]:
    import lightning.pytorch as L

    import nbwatch
    import nbwatch.lightning
    from nbwatch.demo import TinyGPT

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyGPT(vocab=256, d=128, layers=4, heads=4, ctx=128)

        def training_step(self, b, i):
            return nbwatch.masked_cross_entropy(self.net(b["input_ids"]), b["labels"],
                                                b["attention_mask"])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(batches(8), batch_size=None)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=str(root))
    module = Module()
    run_dir = root / f"pl{time.monotonic_ns()}"
    t0 = time.perf_counter()
    if watched:
        nbwatch.lightning.start(trainer, module, train_dataloaders=loader, run_dir=run_dir,
                                display=False).wait()
    else:
        trainer.fit(module, train_dataloaders=loader)
    took = (time.perf_counter() - t0) / steps
    return took, own_share(run_dir) if watched else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--only", choices=["hf", "lightning"])
    args = ap.parse_args()
    fits = {"hf": hf_fit, "lightning": pl_fit}
    if args.only:
        fits = {args.only: fits[args.only]}
    results: dict[str, list[float]] = {}
    owns: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            for name, fit in fits.items():
                for watched in (False, True) if r % 2 == 0 else (True, False):
                    key = f"{name} {'+ nbwatch' if watched else 'bare'}"
                    took, own = (fit(args.steps, root, True) if watched else overhead.in_thread(
                        lambda f=fit: f(args.steps, root, False)))
                    results.setdefault(key, []).append(took)
                    if watched:
                        owns.setdefault(name, []).append(own)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1] * 1e3:.0f} ms" for k, v in results.items()), flush=True)
    print(f"\n{torch.get_num_threads()} threads, {args.steps} steps x {args.rounds} rounds "
          "(median over rounds; the fastest round beside it)")
    print("| fit | bare ms/step | with nbwatch | ratio (median of rounds) | spread | "
          "ratio (fastest) |")
    print("|---|---|---|---|---|---|")
    for name in fits:
        bare, watched = results[f"{name} bare"], results[f"{name} + nbwatch"]
        mb, mw = statistics.median(bare), statistics.median(watched)
        per = [w / b for w, b in zip(watched, bare)]  # each round against its own bare fit
        print(f"| {name} | {mb * 1e3:.1f} | {mw * 1e3:.1f} | {statistics.median(per):.3f}x | "
              f"{min(per):.3f}–{max(per):.3f} | {min(watched) / min(bare):.3f}x |")
    print(f"\nnbwatch's own time on the training thread (time/nbwatch), steps after {WARM}: "
          "the ratio step / (step - own), median over rounds and spread")
    print("| fit | own share of the step (median) | ratio from own time (median) | spread |")
    print("|---|---|---|---|")
    for name in fits:
        ratio = [1 / (1 - o) for o in owns[name]]
        print(f"| {name} | {statistics.median(owns[name]):.2%} | "
              f"{statistics.median(ratio):.4f}x | {min(ratio):.4f}–{max(ratio):.4f} |")


if __name__ == "__main__":
    main()
