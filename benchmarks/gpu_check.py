"""What watching costs on a GPU, workload by workload: one table.

Each workload trains bare and watched (a loop of your own with `mon.log`, `mon.start`, the
HF Trainer with `NbwatchCallback`), variants interleaved in rounds, each on a fresh copy of
the same initial model. Only steady steps are timed: a window of `--steps` steps inside
the run, between two `torch.cuda.synchronize()` (the same in every variant), after the
Monitor has opened and before it closes. Also, per loop, in a separate run:

  - device→host syncs per steady step (`torch.cuda.set_sync_debug_mode("warn")`, any
    thread), nbwatch's apart from the loop's own (the Trainer checks each step's loss
    for NaN on the host and copies its batch in: a bare Trainer's syncs too); the target
    is 0 for nbwatch's outside eval steps, which the window avoids; histograms are off
    here, and their steps read nothing either: tests/recorder/test_host_copy.py);
  - `time/nbwatch` (nbwatch's own host work) and `time/device_wait` against `time/step`.

Workloads (all bf16 autocast, fused AdamW unless said):
  gpt2       GPT-2 124M from `GPT2Config()` (vocab 50,304, SDPA), batch 16 × 1024
  nanogpt    nanoGPT's shakespeare-char shape: 6 layers × 384, 6 heads, 64 × 256
  tiny       nbwatch's TinyGPT 8 × 512, 16 × 256
  trainer    GPT-2 124M under the HF Trainer, 16 × 512
  compiled   `torch.compile`d GPT-2 124M, 16 × 1024, own loop
  foreach    the nanoGPT shape with `torch.optim.AdamW(model.parameters())`: foreach, not fused
  clip       the nanoGPT shape in nanoGPT's own loop: `clip_grad_norm_(params, 1.0)` before
             each step, bare and watched (nbwatch records the norms before it)
  packed     the nanoGPT shape on packed rows (`position_ids` restarting at each document,
             no mask: HF's DataCollatorWithFlattening), watched with `mon.log(loss,
             batch=batch)`: the documents' lengths leave the device as counts by length
  padded     the nanoGPT shape on padded rows (an `attention_mask`, a quarter of the
             tokens padding), watched with `mon.log(loss, batch=batch)`: the mask's
             token figures and the logits weighted by it

    python benchmarks/gpu_check.py [--rounds 5] [--steps 30] [--only gpt2,nanogpt]
                                   [--trace DIR]
    python benchmarks/gpu_check.py --device cpu --quick [--gpu-order]  # the script's test

`--trace DIR` also profiles 6 steady steps of each own loop, bare and watched
(`torch.profiler`, CPU and CUDA): a Chrome trace (`<workload>-<variant>.json`, open it in
Perfetto) and the ops by their host time (`.txt`), to see where a GPU waits for its host.

Fits in ~6 minutes on an H200. Each workload's rows are printed as it ends (a run cut off
by a time limit keeps them), then the whole table. Exits 0 with a message where there is
no CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import nbwatch
from nbwatch.demo import TinyGPT

WARM = 8  # steps before the timed window (the Monitor opens at the first)
SCRIPT = os.path.abspath(__file__)
NBWATCH = os.path.dirname(os.path.abspath(nbwatch.__file__)) + os.sep
_WHOSE: dict[str, str] = {}  # a code file's: "nbwatch", "script" or "" (SyncCounter)
SHM = "/dev/shm"


@dataclass
class Work:
    """A workload: a model maker, a batch shape, and the loops it runs in."""

    name: str
    make: Callable[[], torch.nn.Module]
    batch: int
    seq: int
    vocab: int
    loops: tuple[str, ...] = ("log", "start")
    fused: bool = True
    compile: bool = False
    clip: float | None = None  # the loop's own clip_grad_norm_, bare and watched
    rows: str = "ids"  # "ids"; "packed" (position_ids); "padded" (attention_mask)
    rounds: int = 5
    model: Any = None  # built once, copied for each variant
    times: dict[str, list[float]] = field(default_factory=dict)
    syncs: dict[str, float] = field(default_factory=dict)  # nbwatch's, per steady step
    loop_syncs: dict[str, float] = field(default_factory=dict)  # the loop's own
    own: dict[str, tuple[float, float, float]] = field(default_factory=dict)


def gpt2(layers: int = 12, heads: int = 12, d: int = 768, ctx: int = 1024,
         vocab: int = 50304) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=d, n_positions=ctx,
                         vocab_size=vocab, attn_implementation="sdpa",
                         bos_token_id=min(50256, vocab - 1), eos_token_id=min(50256, vocab - 1))
        return GPT2LMHeadModel(cfg)
    return make


def workloads(quick: bool) -> list[Work]:
    if quick:  # the script's own test: small shapes, on any device
        small = gpt2(layers=2, heads=2, d=64, ctx=64, vocab=256)
        return [Work("gpt2", small, 2, 64, 256, rounds=2),
                Work("tiny", lambda: TinyGPT(vocab=256, d=64, layers=2, heads=2, ctx=64),
                     2, 64, 256, rounds=2),
                Work("trainer", small, 2, 64, 256, loops=("trainer",), rounds=2),
                Work("foreach", small, 2, 64, 256, fused=False, rounds=2),
                Work("compiled", small, 2, 64, 256, loops=("log",), compile=True, rounds=2),
                Work("clip", small, 2, 64, 256, loops=("log",), clip=1.0, rounds=2),
                Work("packed", small, 2, 64, 256, loops=("log",), rows="packed", rounds=2),
                Work("padded", small, 2, 64, 256, loops=("log",), rows="padded", rounds=2)]
    return [
        Work("gpt2", gpt2(), 16, 1024, 50304),
        Work("nanogpt", gpt2(6, 6, 384, 256, 65), 64, 256, 65, rounds=7),
        Work("tiny", lambda: TinyGPT(vocab=512, d=512, layers=8, heads=8, ctx=256),
             16, 256, 512),
        Work("trainer", gpt2(ctx=512), 16, 512, 50304, loops=("trainer",)),
        Work("compiled", gpt2(), 16, 1024, 50304, loops=("log",), compile=True),
        Work("foreach", gpt2(6, 6, 384, 256, 65), 64, 256, 65, fused=False),
        Work("clip", gpt2(6, 6, 384, 256, 65), 64, 256, 65, loops=("log",), clip=1.0),
        Work("packed", gpt2(6, 6, 384, 256, 65), 64, 256, 65, loops=("log",), rows="packed"),
        Work("padded", gpt2(6, 6, 384, 256, 65), 64, 256, 65, loops=("log",), rows="padded"),
    ]


# -- one variant ------------------------------------------------------------------------
def batches(w: Work, device: str, n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        b = {"input_ids": torch.randint(0, w.vocab, (w.batch, w.seq), generator=g)}
        if w.rows == "packed":  # documents of 1/8 to 1/2 of a row, the last one cut
            pos = torch.empty(w.batch, w.seq, dtype=torch.long)
            for row in pos:
                at = 0
                while at < w.seq:
                    n_doc = int(torch.randint(w.seq // 8, w.seq // 2 + 1, (), generator=g))
                    row[at:at + n_doc] = torch.arange(min(n_doc, w.seq - at))
                    at += n_doc
            b["position_ids"] = pos
        elif w.rows == "padded":  # right padding, a quarter of the tokens on average
            real = torch.randint(w.seq // 2, w.seq + 1, (w.batch, 1), generator=g)
            b["attention_mask"] = (torch.arange(w.seq) < real).long()
        out.append({k: v.to(device) for k, v in b.items()})
    return out


def forward_loss(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = b["input_ids"]
    extra = {k: v for k, v in b.items() if k != "input_ids"}
    out = model(ids, **extra) if extra else model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    labels = ids[:, 1:]
    if "attention_mask" in b:  # padding is not a target
        labels = labels.masked_fill(b["attention_mask"][:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten())


def fresh(w: Work, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(w.model)
    if w.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4,
                            **({"fused": True} if w.fused else {}))
    return model, opt


class Window:
    """The timed window: steps WARM+1 .. WARM+steps, between two syncs."""

    def __init__(self, steps: int, device: str):
        self.steps, self.device = steps, device
        self.t0 = self.t1 = 0.0

    def at(self, done: int) -> None:
        """Called at the start of a step, `done` steps completed."""
        if done == WARM:
            self.sync()
            self.t0 = time.perf_counter()
        elif done == WARM + self.steps:
            self.sync()
            self.t1 = time.perf_counter()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    @property
    def per_step(self) -> float:
        return (self.t1 - self.t0) / self.steps


class Trace(Window):
    """Profiles the window's steps instead of timing them; writes what it saw to `out`."""

    def __init__(self, steps: int, device: str, out: Path):
        super().__init__(steps, device)
        self.out = out
        self.prof: Any = None

    def at(self, done: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        if done == WARM:
            self.sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                             if self.device == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        elif done == WARM + self.steps and self.prof is not None:
            self.sync()
            self.prof.__exit__(None, None, None)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.out.with_suffix(".json")))
            self.out.with_suffix(".txt").write_text(self.prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=40))
            self.prof = None


def autocast(device: str) -> Any:
    return torch.autocast(device, dtype=torch.bfloat16) if device == "cuda" \
        else contextlib.nullcontext()


def own_loop(w: Work, device: str, steps: int, root: Path, watched: bool,
             window: Window | None, counter: SyncCounter | None = None) -> Any:
    model, opt = fresh(w, device)
    data = batches(w, device)
    mon = (nbwatch.Monitor(model, opt, run_dir=root, display=False, hist_every=10**6)
           if watched else None)
    for i in range(WARM + steps + 2):
        if window is not None:
            window.at(i)
        if counter is not None:
            counter.on = WARM <= i < WARM + steps
        b = data[i % len(data)]
        with autocast(device):
            loss = forward_loss(model, b)
        loss.backward()
        if w.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon is not None:
            mon.log(loss=loss, **({"batch": b} if w.rows != "ids" else {}))
    if counter is not None:
        counter.on = False
    if mon is not None:
        mon.close()
    return mon


def start_loop(w: Work, device: str, steps: int, root: Path, window: Window | None,
               counter: SyncCounter | None = None) -> Any:
    model, opt = fresh(w, device)
    data = batches(w, device)
    mon = nbwatch.Monitor(model, opt, run_dir=root, display=False, hist_every=10**6)

    def step_fn(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        if window is not None:
            window.at(mon.step)
        if counter is not None:
            counter.on = WARM <= mon.step < WARM + steps
        with autocast(device):
            return forward_loss(model, b)

    mon.start(step_fn, data, max_steps=WARM + steps + 2, display=False, dry_run=False)
    mon.wait()
    if counter is not None:
        counter.on = False
    return mon


def trainer_loop(w: Work, device: str, steps: int, root: Path, watched: bool,
                 window: Window | None, counter: SyncCounter | None = None) -> Any:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import nbwatch.hf

    class Timing(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if window is not None:
                window.at(state.global_step)
            if counter is not None:
                counter.on = WARM <= state.global_step < WARM + steps

    model = copy.deepcopy(w.model)
    data = [{"input_ids": b, "labels": b} for b in
            batches(w, "cpu", 4)[0]["input_ids"].repeat(4, 1)]
    args = TrainingArguments(
        output_dir=str(root.with_name(root.name + "-out")), max_steps=WARM + steps + 2,
        per_device_train_batch_size=w.batch, bf16=device == "cuda",
        optim="adamw_torch_fused" if w.fused else "adamw_torch", learning_rate=3e-4,
        logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=device == "cpu", dataloader_pin_memory=device == "cuda", seed=0)
    callbacks: list[Any] = [Timing()]
    if watched:
        callbacks.append(nbwatch.hf.NbwatchCallback(run_dir=root, display=False,
                                                    hist_every=10**6))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # its end-of-fit dict on stdout
    trainer.train()
    if counter is not None:
        counter.on = False
    return nbwatch.open_run(root) if watched else None


def run_variant(w: Work, variant: str, device: str, steps: int, root: Path,
                window: Window | None = None, counter: SyncCounter | None = None) -> Any:
    if w.loops == ("trainer",):
        return trainer_loop(w, device, steps, root, variant != "bare", window, counter)
    if variant == "start":
        return start_loop(w, device, steps, root, window, counter)
    return own_loop(w, device, steps, root, variant == "log", window, counter)


# -- what it prints -----------------------------------------------------------------------
class SyncCounter:
    """Counts CUDA sync warnings (any thread) while `on`: `count`, those made under
    nbwatch's code; `loop`, the loop's own (the Trainer's, the model's), whichever of
    nbwatch's code and this script's is innermost where the sync was made (a step_fn that
    `start()` calls is the loop's). `cuda=False`: the warnings alone (the CPU's test)."""

    def __init__(self, cuda: bool = True) -> None:
        self.count = 0
        self.loop = 0
        self.on = False
        self.cuda = cuda
        self._lock = threading.Lock()
        self._filters: Any = None

    @staticmethod
    def nbwatchs(frame: Any) -> bool:
        """Whether the innermost of nbwatch's frames and this script's, from `frame` out,
        is nbwatch's."""
        while frame is not None:
            whose = _WHOSE.get(frame.f_code.co_filename)
            if whose is None:
                path = os.path.abspath(frame.f_code.co_filename)
                whose = _WHOSE[frame.f_code.co_filename] = (
                    "script" if path == SCRIPT else
                    "nbwatch" if path.startswith(NBWATCH) else "")
            if whose:
                return whose == "nbwatch"
            frame = frame.f_back
        return False

    def __enter__(self) -> SyncCounter:
        self._filters = warnings.catch_warnings()  # put back as they were at the exit
        self._filters.__enter__()
        shown = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "synchroniz" not in str(message):
                shown(message, category, *args, **kwargs)
            elif self.on:
                ours = self.nbwatchs(sys._getframe(1))
                with self._lock:
                    if ours:
                        self.count += 1
                    else:
                        self.loop += 1

        warnings.showwarning = show
        warnings.simplefilter("always")
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self._filters.__exit__(*exc)


def own_time(run: Any, steps: int) -> tuple[float, float, float]:
    """Medians over the steady steps: (time/nbwatch, time/device_wait, time/step), ms."""
    df = run.df if hasattr(run, "df") else run
    df = df.loc[WARM + 1: WARM + steps]

    def med(col: str) -> float:
        return float(df[col].median()) * 1e3 if col in df and df[col].notna().any() else 0.0
    return med("time/nbwatch"), med("time/device_wait"), med("time/step")


def drop(run_dir: Path) -> None:
    """A run's folder (and the Trainer's output folder beside it), once measured: each
    watched run ends with a final checkpoint (1.5 GB for GPT-2 124M and its AdamW), ~25 GB
    over the own loops if all were kept."""
    for path in (run_dir, run_dir.with_name(run_dir.name + "-out")):
        shutil.rmtree(path, ignore_errors=True)


def runs_root() -> str | None:
    """Where the runs' folders go: /dev/shm where it has room (RAM: a run's final
    checkpoint, written and fsynced as its Monitor closes, outside the timed steps, costs
    seconds on a VM's disk, up to a minute over GPT-2's 13 watched runs), else the temp
    folder."""
    try:
        if os.path.isdir(SHM) and shutil.disk_usage(SHM).free > 16 * 2**30:
            return SHM
    except OSError:
        pass
    return None


def measure(w: Work, device: str, steps: int, root: Path, log: Callable[[str], None],
            trace: Path | None = None) -> None:
    torch.manual_seed(0)
    w.model = w.make().to(device)
    variants = ("bare", *w.loops) if w.loops != ("trainer",) else ("bare", "callback")
    if w.compile:  # the first compile (~40 s) outside the rounds
        run_variant(w, "bare", device, 2, root / f"{w.name}-compile")
        drop(root / f"{w.name}-compile")
    for loop in variants[1:]:  # syncs and own time, one run each
        counter = SyncCounter()
        where = root / f"{w.name}-{loop}-syncs"
        with counter if device == "cuda" else contextlib.nullcontext():
            run = run_variant(w, loop, device, steps, where, counter=counter)
        w.syncs[loop] = counter.count / steps if device == "cuda" else float("nan")
        w.loop_syncs[loop] = counter.loop / steps if device == "cuda" else float("nan")
        w.own[loop] = own_time(run, steps)
        del run
        drop(where)
    for r in range(w.rounds):
        order = variants if r % 2 == 0 else tuple(reversed(variants))
        for v in order:
            win = Window(steps, device)
            run_variant(w, v, device, steps, root / f"{w.name}-{v}-{r}", window=win)
            drop(root / f"{w.name}-{v}-{r}")
            w.times.setdefault(v, []).append(win.per_step)
        log(f"{w.name} round {r + 1}/{w.rounds}: " + ", ".join(
            f"{v} {w.times[v][-1] * 1e3:.2f}" for v in variants) + " ms/step")
    if trace is not None and "log" in variants and w.rows == "ids":
        for v in ("bare", "log"):
            run_variant(w, v, device, 6, root / f"{w.name}-{v}-trace",
                        window=Trace(6, device, trace / f"{w.name}-{v}"))
            drop(root / f"{w.name}-{v}-trace")
        log(f"{w.name}: traces in {trace}")
    w.model = None
    if device == "cuda":
        torch.cuda.empty_cache()


def table(works: list[Work]) -> str:
    rows = ["| workload | bare ms/step | watched | ms/step | ratio (median; min–max of rounds) "
            "| syncs/step: nbwatch's · the loop's "
            "| time/nbwatch · device_wait · time/step (ms, medians) |",
            "|---|---|---|---|---|---|---|"]
    for w in works:
        if not w.times:
            continue
        bare = statistics.median(w.times["bare"])
        for v, ts in w.times.items():
            if v == "bare":
                continue
            ratios = [t / b for t, b in zip(ts, w.times["bare"])]
            nb, wait, step = w.own.get(v, (0.0, 0.0, 0.0))
            rows.append(
                f"| {w.name} | {bare * 1e3:.2f} | {v} | {statistics.median(ts) * 1e3:.2f} | "
                f"{statistics.median(ts) / bare:.3f}x ({min(ratios):.3f}–{max(ratios):.3f}) | "
                f"{w.syncs.get(v, float('nan')):.2f} · {w.loop_syncs.get(v, float('nan')):.2f} | "
                f"{nb:.2f} · {wait:.2f} · {step:.2f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=0, help="override each workload's")
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes: the script's test")
    ap.add_argument("--trace", type=Path, default=None,
                    help="a folder: a profiler trace of each own loop, bare and watched")
    ap.add_argument("--gpu-order", action="store_true",
                    help="on a CPU, the GPU's path: decided on the device, read a step later")
    args = ap.parse_args()
    if args.gpu_order:
        from nbwatch.recorder import host_copy

        host_copy.DEFER_ON_CPU = True
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "nothing to measure. Run it on a machine with an NVIDIA GPU "
              "(--device cpu --quick runs the script itself on small shapes).")
        return 0
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        torch.backends.cuda.matmul.allow_tf32 = True
    works = workloads(args.quick)
    if args.only:
        keep = set(args.only.split(","))
        works = [w for w in works if w.name in keep]
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    with tempfile.TemporaryDirectory(dir=runs_root()) as tmp:
        log(f"run folders in {tmp}")
        for w in works:
            if args.rounds:
                w.rounds = args.rounds
            try:
                measure(w, args.device, args.steps, Path(tmp) / w.name, log, args.trace)
            except Exception as e:  # noqa: BLE001 - one workload's failure: said, go on
                log(f"{w.name}: FAILED: {type(e).__name__}: {e}")
            else:  # its rows at once: a run cut off by a time limit keeps what it measured
                log(f"{w.name} done:\n" + table([w]))
    print(table(works))
    bad = [f"{w.name}/{v}" for w in works for v, s in w.syncs.items() if s > 0.0]
    if bad:
        print(f"nbwatch's device→host syncs in a steady step: {', '.join(bad)} (target 0)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
