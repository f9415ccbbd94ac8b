"""The background training loop. One step, in this order:

    commands (pause/stop/clip/lr/checkpoint, between steps only)
    → fetch batch (timed: data wait) → step_fn → backward        (× accumulate)
    → AMP unscale → grad probes → clip → [weights snapshot] → optimizer step
    → scheduler step (LR factor kept) → zero_grad → record (one device→host copy)
    → [eval: val_fn, attention probe, sample_fn, checkpoint]

Everything a step measures is gathered as device tensors and copied to the host once
(`.tolist()` on one stacked vector): on a GPU each `.item()` would be a sync point.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from . import controls as ctl
from .alerts import AlertEngine, default_rules, weight_std
from .checkpoint import Checkpointer, rng_state
from .distributed import Dist, lost_peer, merge_ranks, rank_figures
from .evaluation import evaluate
from .probes import weights as wprobe
from .probes.attention import clone_samples
from .probes.data import mask_stats
from .probes.grads import Layers, clip_, grad_norms
from .probes.loss import parse_step_output
from .probes.throughput import timing_figures
from .records import Command, Event, Histogram, Sample, Scalars
from .store import RunStore

log = logging.getLogger("nbwatch.runner")
# Rules whose inputs are identical on every DDP rank (the synchronised gradients): each
# rank reaches the same decision at the same step without asking the others.
SAME_ON_EVERY_RANK = ("nonfinite", "grad_explosion")
_FROM_ALL_RANKS = ("loss/train", "tokens/real", "throughput/tokens_per_s")
_RUN_IDS = itertools.count(1)  # each run's logger is its own, whatever its folder's name


@dataclass
class RunSpec:
    """What `Monitor.start()` was asked to run."""

    step_fn: Callable[[nn.Module, Any], Any]
    train_data: Iterable
    max_steps: int
    val_fn: Callable[[nn.Module], Any] | None = None
    eval_every: int | None = None
    sample_fn: Callable[[nn.Module], str] | None = None
    accumulate: int = 1
    hist_every: int = 50
    hist_bins: int = 64
    checkpoint_every: int | None = None
    probe_batch: Any = None
    probe_tokens: list[list[str]] | None = None
    attention_samples: int = 2
    attention_tokens: int = 64
    log_every: int = 50
    trial: bool = False  # preflight: no checkpoints, no pausing


@dataclass
class Progress:
    """State shared with the caller's thread: read freely, written only by the runner."""

    step: int = 0
    state: str = "created"
    error: BaseException | None = None
    traceback: str | None = None
    train_loss_sum: float = 0.0  # finite train losses since the last eval, for loss/gap
    train_loss_n: int = 0

    def train_mean(self) -> float | None:
        return self.train_loss_sum / self.train_loss_n if self.train_loss_n else None


class Runner:
    """Runs `RunSpec` on the model in the calling thread (the Monitor gives it its own)."""

    def __init__(
        self,
        spec: RunSpec,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: Any,
        store: RunStore,
        checkpointer: Checkpointer,
        commands: ctl.CommandQueue,
        control: ctl.ControlState,
        progress: Progress,
        start_step: int = 0,
        engine: AlertEngine | None = None,
        on_alert: Callable[[Event], Any] | None = None,
        dist: Dist | None = None,
    ):
        self.spec, self.model, self.opt, self.sched, self.scaler = (
            spec, model, optimizer, scheduler, scaler
        )
        self.store, self.ckpt, self.commands, self.control = store, checkpointer, commands, control
        self.progress = progress
        self.engine = engine if engine is not None else AlertEngine(default_rules())
        self.on_alert = on_alert
        self.dist = dist
        self._rank_rows: list[tuple[int, dict[str, float]]] = []
        self._sync_s = 0.0
        self._rank_step_times: dict[int, deque[float]] = {}
        self.step = start_step
        self.layers = Layers.of(model)
        self._stop_requested = False
        self._last_val: float | None = None
        self._seq_lens: list[torch.Tensor] = []
        self._store_poll = 0.0
        self._command_id = 0  # the newest store command taken
        self._data: Iterator | None = None
        self._epoch = 0
        self.log = logging.getLogger(f"nbwatch.run.{store.run_dir.name}.{next(_RUN_IDS)}")
        self._start_step = start_step
        self._reduction_saved = False
        self._ckpt_step: int | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def run(self) -> None:
        p = self.progress
        try:
            self._set_state("running")
            self._loop()
            if self.dist is not None:
                self._sync_ranks(final=True)
            if self._stop_requested:
                self._checkpoint("stop")
                self._set_state("stopped")
            else:
                if self.spec.val_fn is not None and not self._evaluated_at(self.step):
                    self._eval()
                self._checkpoint("final")
                self._set_state("finished")
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised by Monitor.wait()
            p.error = e
            p.traceback = traceback.format_exc()
            p.state = "failed"  # first: recording it below may itself fail (a dead store)
            msg = f"{type(e).__name__}: {e}"
            if self.dist is not None:
                if lost_peer(e):
                    msg = ("lost contact with another rank (it died or hangs), so this rank "
                           f"stops: {str(e).splitlines()[0][:300]}")
                msg = f"[rank {self.dist.rank}/{self.dist.world}] {msg}"
            try:
                self._emit(
                    Event(self.step, "error", "critical", msg, {"traceback": p.traceback}),
                    logging.ERROR,
                )
                self._checkpoint("emergency")
                self._set_state("failed")
            except BaseException as ce:  # noqa: BLE001 - the original error matters more
                self.log.error("recording the failure failed too: %s\n%s", ce, p.traceback)
        finally:
            try:
                self.store.flush()
            except Exception as fe:  # never mask the training error
                log.error("final flush of the run store failed: %s", fe)

    def _set_state(self, state: str) -> None:
        self.progress.state = state
        self.store.set_meta("state", state)
        self.store.set_meta("step", self.step)
        if state != "running" or self.step:
            self._emit(Event(self.step, "state", "info", f"run {state} at step {self.step}"))

    def _emit(self, ev: Event, level: int | None = None) -> None:
        self.store.put(ev)
        lvl = level if level is not None else {
            "info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL
        }[ev.severity]
        self.log.log(lvl, ev.message, extra={"step": ev.step, "kind": ev.kind, "data": ev.data})

    # -- commands (between steps only) --------------------------------------------------
    def _poll_commands(self) -> list[Command]:
        cmds = self.commands.drain()
        now = time.monotonic()
        if now - self._store_poll > 0.25:  # other processes write commands into the store
            self._store_poll = now
            for cid, cmd in self.store.pending_commands(self._command_id):
                self.store.mark_taken(cid)
                self._command_id = cid
                cmds.append(cmd)
        return cmds

    def _apply_commands(self) -> None:
        if self.dist is not None:
            d = self.dist
            if self.control.paused or (self.step > self._start_step and self.step % d.every == 0):
                self._sync_ranks()
            return
        for cmd in self._poll_commands():
            self._apply(cmd)
        while self.control.paused and not self._stop_requested and not self.spec.trial:
            cmd = self.commands.get(timeout=0.1)
            cmds = ([cmd] if cmd else []) + self._poll_commands()
            for c in cmds:
                self._apply(c)

    def _sync_ranks(self, final: bool = False) -> None:
        """Meet the other ranks: figures to rank 0, rank 0's commands to all, applied here
        at this same step on every rank; while paused, meet again every 0.1 s."""
        d = self.dist
        assert d is not None
        while True:
            cmds = self._poll_commands() if d.rank == 0 else []
            t0 = time.perf_counter()
            rows, cmds = d.exchange(self._rank_rows, cmds)
            self._sync_s = time.perf_counter() - t0
            self._rank_rows = []
            if d.rank == 0:
                self._record_ranks(rows)
            for c in cmds:
                self._apply(c)
            if final or not self.control.paused or self._stop_requested:
                return
            if d.rank == 0:
                time.sleep(0.1)  # the others wait in the next exchange

    def _record_ranks(self, rows: list) -> None:
        merged = merge_ranks(rows)
        for sc in merged:
            self.store.put(sc)
            for r in range(self.dist.world):
                # busy time outside collectives: a fast rank's step also holds its wait
                # for the slow one (inside backward), so step time alone hides a straggler
                fwd = sc.values.get(f"rank{r}/time/forward")
                data = sc.values.get(f"rank{r}/time/data", 0.0)
                if fwd is not None:
                    self._rank_step_times.setdefault(r, deque(maxlen=50)).append(fwd + data)
        recent = {r: float(np.median(ts)) for r, ts in self._rank_step_times.items()
                  if len(ts) >= 20}
        for a in self.engine.observe("ranks", self.step, None, rank_step_times=recent):
            self._raise_alerts([a])

    def _apply(self, cmd: Command) -> None:
        c, step = self.control, self.step
        if cmd.kind == "pause" and not c.paused:
            c.paused = True
            self._set_state("paused")
            msg = f"paused at step {step}"
        elif cmd.kind == "resume" and c.paused:
            c.paused = False
            self._set_state("running")
            msg = f"resumed at step {step}"
        elif cmd.kind == "stop":
            self._stop_requested = True
            msg = f"stop requested at step {step}"
        elif cmd.kind == "checkpoint":
            self._checkpoint("manual")
            return
        elif cmd.kind == "clip":
            c.clip = cmd.value
            msg = f"gradient clipping at {cmd.value:g}" if cmd.value else "gradient clipping off"
        elif cmd.kind == "scale_lr":
            before = ctl.lrs(self.opt)[0]
            ctl.scale_lrs(self.opt, cmd.value)
            c.lr_factor *= cmd.value
            msg = (f"LR scaled ×{cmd.value:g} (factor now {c.lr_factor:g}): "
                   f"{before:.3g} → {ctl.lrs(self.opt)[0]:.3g}")
        else:  # pause while paused, resume while running: nothing to acknowledge
            return
        self._emit(Event(step, "action", "info", msg,
                         {"command": cmd.kind, "value": cmd.value, "source": cmd.source}))

    # -- the loop -----------------------------------------------------------------------
    def _next_batch(self) -> Any:
        if self._data is None:
            self._data = iter(self.spec.train_data)
        try:
            return next(self._data)
        except StopIteration:
            self._epoch += 1
            self._data = iter(self.spec.train_data)
            try:
                return next(self._data)
            except StopIteration:
                raise ValueError(
                    "train_data yielded no batches; pass a non-empty DataLoader or iterable "
                    "(a generator is used up after one pass: pass a list or a DataLoader)"
                ) from None

    def _loop(self) -> None:
        spec = self.spec
        while self.step < spec.max_steps:
            self._apply_commands()
            if self._stop_requested:
                return
            self._train_step()
            if spec.eval_every and self.step % spec.eval_every == 0:
                self._eval()
            elif spec.checkpoint_every and self.step % spec.checkpoint_every == 0:
                self._checkpoint("periodic")

    def _train_step(self) -> None:
        spec, model, opt, scaler = self.spec, self.model, self.opt, self.scaler
        t0 = time.perf_counter()
        data_s = fwd_s = 0.0
        loss_sum: torch.Tensor | None = None
        tokens: torch.Tensor | None = None
        padded = samples = 0
        mask_figs: list[dict[str, torch.Tensor]] = []
        reduction = None
        for _ in range(spec.accumulate):
            td = time.perf_counter()
            batch = self._next_batch()
            data_s += time.perf_counter() - td
            samples += _batch_size(batch)
            if spec.probe_batch is None and spec.eval_every:  # fixed samples for attention
                spec.probe_batch = clone_samples(batch, spec.attention_samples)
            tf = time.perf_counter()
            out = parse_step_output(spec.step_fn(model, batch))
            fwd_s += time.perf_counter() - tf
            reduction = out.reduction
            loss = out.loss / spec.accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
            detached = out.loss.detach().float()
            loss_sum = detached if loss_sum is None else loss_sum + detached
            if out.mask is not None:
                figs = mask_stats(out.mask)
                mask_figs.append(figs)
                if spec.hist_every > 0:
                    self._seq_lens.append(figs["lengths"])
                tokens = figs["tokens"] if tokens is None else tokens + figs["tokens"]
                padded += out.mask.numel()
        if not self._reduction_saved:
            self.store.set_meta("loss_reduction", reduction)
            self._reduction_saved = True
        if scaler is not None:
            scaler.unscale_(opt)  # norms and clipping see the true gradients
        t_fb = time.perf_counter()

        total, per_layer, grads = grad_norms(self.layers)
        # One device→host copy for every per-step figure, before the optimizer step so
        # that the rules can still skip or clip this step.
        dev = total.device
        parts = [(loss_sum / spec.accumulate).to(dev).reshape(1), total.reshape(1), per_layer]
        names = ["loss/train", "grad_norm/global"]
        names += [f"grad_norm/{n}" for n in self.layers.names]
        if mask_figs:
            tok = tokens.float().to(dev).reshape(1)
            lens = torch.stack([f["data/seq_len_mean"] for f in mask_figs]).float().mean()
            mx = torch.stack([f["data/seq_len_max"] for f in mask_figs]).float().max()
            parts += [tok, lens.to(dev).reshape(1), mx.to(dev).reshape(1)]
            names += ["tokens/real", "data/seq_len_mean", "data/seq_len_max"]
        host = torch.cat([t.float().to(dev) for t in parts]).tolist()  # the sync point
        values = dict(zip(names, host))
        if mask_figs:
            values["data/padding_ratio"] = 1.0 - values["tokens/real"] / max(padded, 1)
        lrs = ctl.lrs(opt)  # the LR this step uses: read before scheduler.step()
        values["lr"] = lrs[0]
        for i, lr in enumerate(lrs[1:], start=1):
            values[f"lr/group{i}"] = lr
        t_probe = time.perf_counter()

        step = self.step + 1
        observed = values
        if (scaler is not None and not math.isfinite(values["grad_norm/global"])
                and math.isfinite(values["loss/train"])):
            # fp16 loss-scale overflow: routine for a GradScaler, which skips the step and
            # lowers its scale itself; not a reason to pause the run
            values["amp/overflow"] = 1.0
            observed = {k: v for k, v in values.items() if k != "grad_norm/global"}
        alerts = self.engine.observe("grads", step, observed)
        skip = any("skip_step" in a.rule.actions for a in alerts)
        for a in alerts:
            if "clip" in a.rule.actions and not skip:
                limit = float(a.rule.params.get("max_norm", 1.0))
                if self.control.clip is None or self.control.clip > limit:
                    self.control.clip = limit
        g = values["grad_norm/global"]
        clip = self.control.clip
        applied = clip and not skip and math.isfinite(g)
        values["grad_norm/clipped"] = g * min(1.0, clip / (g + 1e-6)) if applied else g
        if clip and not skip:
            clip_(grads, total, clip)

        hist = spec.hist_every > 0 and not skip and (
            (self.step + 1) % spec.hist_every == 0 or self.step == self._start_step
        )
        before = wprobe.snapshot(self.layers) if hist else None
        if skip:
            if scaler is not None:
                scaler.update()  # a non-finite step lowers the scale, as scaler.step would
        elif scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if self.sched is not None and not skip:
            ctl.scheduler_step(self.sched, opt, self.control.lr_factor)
        opt.zero_grad(set_to_none=True)
        if before is not None:
            ratios = wprobe.update_ratios(self.layers, before).tolist()
            values.update({f"update_ratio/{n}": r for n, r in zip(self.layers.names, ratios)})

        self.step = step
        t_end = time.perf_counter()
        n_tokens = values.get("tokens/real")
        values.update(timing_figures(t_end - t0, data_s, n_tokens, samples or None))
        values["time/forward_backward"] = t_fb - t0 - data_s
        values["time/forward"] = fwd_s  # step_fn alone: under DDP, before any gradient sync
        values["time/probes"] = t_probe - t_fb
        values["time/optimizer"] = t_end - t_probe
        if self._epoch:
            values["epoch"] = float(self._epoch)
        if skip:
            values["skipped"] = 1.0
        alerts += self.engine.observe("step", step, values)
        if self.dist is not None:
            self._rank_rows.append((step, {**rank_figures(values), "time/sync": self._sync_s}))
            self._sync_s = 0.0
            # run-level loss, tokens and throughput come from all ranks, at the next exchange
            stored = {k: v for k, v in values.items() if k not in _FROM_ALL_RANKS}
        else:
            stored = values
        self.store.put(Scalars(step, stored))
        self.progress.step = step
        if math.isfinite(values["loss/train"]):
            self.progress.train_loss_sum += values["loss/train"]
            self.progress.train_loss_n += 1
        self._raise_alerts(alerts)

        if hist:
            self._histograms(step)
        if spec.log_every and step % spec.log_every == 0:
            self.log.info("step", extra={"step": step, "data": {
                k: values[k] for k in ("loss/train", "grad_norm/global", "lr", "time/step")}})

    def _raise_alerts(self, alerts: list) -> None:
        """Record each alert, then carry out its actions (skip and clip are done already)."""
        for a in alerts:
            self._emit(a.event)
            if self.on_alert is not None:
                try:
                    self.on_alert(a.event)
                except Exception:  # a user's callback must not kill the run
                    self.log.exception("on_alert callback failed for %s", a.rule.name)
        for a in alerts:
            acts = a.rule.actions
            if self.dist is not None and a.rule.name not in SAME_ON_EVERY_RANK:
                # decided on rank 0 alone: applied by every rank at the next exchange
                for act in acts:
                    if act in ("pause", "checkpoint"):
                        self.commands.put(Command(act, None, f"alert:{a.rule.name}"))
                    elif act == "cut_lr":
                        f = float(a.rule.params.get("lr_factor", 0.5))
                        self.commands.put(Command("scale_lr", f, f"alert:{a.rule.name}"))
                continue
            if "cut_lr" in acts:
                f = float(a.rule.params.get("lr_factor", 0.5))
                self._apply(Command("scale_lr", f, f"alert:{a.rule.name}"))
            if "clip" in acts and self.control.clip is not None:
                self._emit(Event(self.step, "action", "info",
                                 f"gradient clipping at {self.control.clip:g} "
                                 f"(alert {a.rule.name})",
                                 {"command": "clip", "value": self.control.clip,
                                  "source": f"alert:{a.rule.name}"}))
            if "checkpoint" in acts:
                self._checkpoint(f"emergency ({a.rule.name})")
            if "pause" in acts:
                self._apply(Command("pause", None, f"alert:{a.rule.name}"))

    def _histograms(self, step: int) -> None:
        edges, counts = wprobe.layer_histograms(self.layers, self.spec.hist_bins)
        edges, counts = edges.cpu().double().numpy(), counts.cpu().numpy()
        for i, name in enumerate(self.layers.names):
            self.store.put(Histogram(step, f"weight/{name}", edges[i], counts[i]))
        stds = {n: weight_std(edges[i], counts[i]) for i, n in enumerate(self.layers.names)}
        self._raise_alerts(self.engine.observe("hist", step, weight_std=stds))
        if self._seq_lens:
            lens = torch.cat([t.float().cpu() for t in self._seq_lens])
            self._seq_lens.clear()
            hi = max(float(lens.max()), 1.0)
            e, c = wprobe.histogram(torch.cat([lens, lens.new_tensor([0.0, hi])]), 32)
            c[0] -= 1  # the two range anchors are not data: pin the range at [0, max]
            c[-1] -= 1
            self.store.put(Histogram(step, "data/seq_len", e.double().numpy(), c.numpy()))

    # -- eval ---------------------------------------------------------------------------
    def _evaluated_at(self, step: int) -> bool:
        return bool(self.spec.eval_every) and step % self.spec.eval_every == 0

    def _eval(self) -> None:
        spec, step = self.spec, self.step
        result = evaluate(self.model, spec, step, self.progress.train_mean())
        if spec.val_fn is not None:
            self.progress.train_loss_sum, self.progress.train_loss_n = 0.0, 0
            self._last_val = result.values.get("loss/val")
        for a in result.attention:
            self.store.put(a)
        if result.sample is not None:
            self.store.put(Sample(step, result.sample))
        if result.values:
            self.store.put(Scalars(step, result.values))
            self._raise_alerts(self.engine.observe("eval", step, result.values))
        if result.attention:
            self._raise_alerts(self.engine.observe("attention", step,
                                                   attention=result.first_maps()))
        every = spec.checkpoint_every or spec.eval_every
        if every and step % every == 0:
            self._checkpoint("periodic")

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict() if self.sched is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": rng_state(),
            "controls": self.control.to_dict(),
        }

    def _checkpoint(self, reason: str) -> None:
        if self.spec.trial or (self.dist is not None and self.dist.rank != 0):
            return
        if reason in ("final", "stop") and self._ckpt_step == self.step:
            return  # the periodic checkpoint of this very step is the final one
        self._ckpt_step = self.step
        saved = self.ckpt.save(self.state_dict(), self.step, self._last_val)
        self._last_val = None  # "best" compares checkpoints taken right after an eval
        msg = (f"{reason} checkpoint at step {self.step}: {saved.path.name}, "
               f"{saved.bytes / 2**20:.1f} MiB in {saved.seconds:.2f} s"
               + (" (best)" if saved.best else ""))
        self._emit(Event(self.step, "checkpoint", "info", msg, {
            "path": str(saved.path), "seconds": saved.seconds, "bytes": saved.bytes,
            "best": saved.best, "reason": reason}))


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for b in batch:
            n = _batch_size(b)
            if n:
                return n
    return 0


def run_in_thread(runner: Runner, name: str) -> threading.Thread:
    """Start `runner.run` in a daemon thread that keeps the caller's context (so a
    notebook's output from the thread lands in the cell that started it)."""
    import contextvars

    ctx = contextvars.copy_context()
    t = threading.Thread(target=ctx.run, args=(runner.run,), name=name, daemon=True)
    t.start()
    return t
