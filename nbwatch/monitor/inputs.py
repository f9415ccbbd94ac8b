"""What a user passes to nbwatch, checked before anything opens: the model, optimizer and
scheduler that a Monitor is given, the run folder, step counts, probe samples and what
`log()` receives. Every refusal names the problem and the fix."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import time
import types
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..counts import as_python, integral, real
from ..evaluation import check_val as check_val  # log(val=...)'s check, val_fn's too
from ..evaluation import short_repr
from ..probes.data import batch_figures, check_mask
from ..probes.late import keep_masks
from ..probes.logits import NAMES as LOGIT_NAMES
from ..probes.logits import TrainLogits, is_logits, logit_parts
from ..probes.throughput import mask_rows
from ..sharding import refuse_unsupported
from ..store import check_no_writer, is_run_dir
from .accumulation import step_mean
from .optimizer_hooks import hooked_optimizer, inner_scheduler
from .options import check_every, check_run_dir_length


def check_monitor(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                  config: dict[str, Any] | None, keep_last: int,
                  system_interval: float, on_alert: Any = None) -> dict[str, Any]:
    """Refuse what cannot work, before anything opens, with the fix in the message."""
    refuse_unsupported(model, optimizer)  # FSDP1, DeepSpeed
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "the model has no parameters that require grad, so there is nothing to train; "
            "unfreeze some (p.requires_grad_(True)) before creating the Monitor"
        )
    if scheduler is not None:
        # accelerate's wrappers: AcceleratedScheduler(.scheduler) on AcceleratedOptimizer
        # (.optimizer); either may be given wrapped or not
        hooked, inner = hooked_optimizer(optimizer), inner_scheduler(scheduler)
        built_on = getattr(inner, "optimizer", optimizer)
        while built_on is not optimizer and built_on is not hooked and hasattr(
                built_on, "optimizer"):
            built_on = built_on.optimizer  # a framework's wrapper (accelerate, Lightning)
        if built_on is not optimizer and built_on is not hooked:
            raise ValueError(
                "the scheduler was built on another optimizer than the one passed to the "
                "Monitor; build it on this optimizer: Scheduler(optimizer, ...)"
            )
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError("scheduler must have a step() method (a torch LR scheduler)")
        if not callable(getattr(scheduler, "state_dict", None)):
            warnings.warn(
                f"scheduler {type(scheduler).__name__} has no state_dict(): checkpoints "
                "will not hold its state, and a resumed run restarts its schedule; give "
                "it state_dict()/load_state_dict() to resume it", stacklevel=4)
    config = check_config(config)
    typed = real(system_interval)
    if not typed or not math.isfinite(system_interval) or system_interval < 0.1:
        raise (ValueError if typed else TypeError)(
            f"system_interval must be at least 0.1 s (a number of seconds: the CPU/GPU "
            f"sampler's period), got {system_interval!r}; e.g. system_interval=1.0 (it cannot "
            "be turned off)")
    typed = integral(keep_last)
    if not typed or keep_last < 1:
        raise (ValueError if typed else TypeError)(
            f"keep_last must be an int ≥ 1 (how many periodic checkpoints to keep; the best "
            f"is kept apart), got {keep_last!r}; e.g. keep_last=3")
    if on_alert is not None and not callable(on_alert):
        raise TypeError(
            f"on_alert must be a function called with each alert event, or None, got "
            f"{on_alert!r}; e.g. on_alert=lambda ev: print(ev.message) (alerts are in "
            "mon.events and the dashboard without one)")
    check_covers(model, optimizer)
    return config


CONFIG_DEPTH = 64  # nesting levels a config may have (a deeper one is refused, not truncated)


def as_config(config: Any) -> dict[str, Any]:
    """The run's config as a dict, from what training scripts hold it in: a dict or other
    mapping, an argparse Namespace, a dataclass, an OmegaConf config, or an object with
    `to_dict()` (a Hugging Face config, TrainingArguments)."""
    if config is None:
        return {}
    if type(config).__module__.split(".")[0] == "omegaconf":
        from omegaconf import OmegaConf  # type: ignore[import-not-found]

        config = OmegaConf.to_container(config, resolve=True)
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    elif isinstance(config, (argparse.Namespace, types.SimpleNamespace)):
        config = vars(config)
    elif not isinstance(config, Mapping) and callable(getattr(config, "to_dict", None)):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a dict (or an argparse Namespace, a dataclass, an OmegaConf "
            f"config, an object with to_dict()), got {type(config).__name__}")
    return dict(config)


def check_config(config: Any) -> dict[str, Any]:
    """`as_config(config)`, refused unless it can be stored as JSON (what cannot be is
    stored as its str()) and is nested at most CONFIG_DEPTH levels (the store, the config
    table and comparisons walk it)."""
    config = as_config(config)
    level: list[dict | list | tuple] = [config]
    depth, seen = 0, {id(config)}
    while level:  # breadth first, no recursion: a 5,000-deep dict is refused, not a crash
        depth += 1
        if depth > CONFIG_DEPTH:
            raise ValueError(
                f"config is nested more than {CONFIG_DEPTH} levels deep; "
                "flatten it (e.g. {'optim.lr': 1e-3} instead of {'optim': {'lr': 1e-3}}) or "
                "pass only the settings worth keeping with the run")
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (dict, list, tuple)) and id(v) not in seen]
        seen.update(id(v) for v in level)  # a config that holds itself: json says so below
    try:
        json.dumps(config, default=as_python)
    except (ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"config cannot be stored as JSON ({e}); pass a dict of plain "
                         "values (numbers, strings, lists, dicts)") from e
    return config


_ALLOWED_FOREIGN = {".ipynb_checkpoints", ".DS_Store", "torchrun.log",  # launch() writes the log
                    "rank_errors"}  # a rank > 0 that failed before rank 0 opened the store


def check_covers(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer built on another model; warn about trainable parameters it
    leaves out (they get gradients, are counted in the norms, and never change)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    left = [n for n, p in trainable if id(p) not in held]
    if len(left) == len(trainable):
        raise ValueError(
            "the optimizer holds none of the model's trainable parameters (was it built on "
            "another model?); build it on this one: torch.optim.AdamW(model.parameters(), ...)")
    if left:
        modules = sorted({n.rsplit(".", 1)[0] if "." in n else n for n in left})
        shown = ", ".join(modules[:6]) + (f" and {len(modules) - 6} more" if len(modules) > 6
                                          else "")
        warnings.warn(
            f"{len(left)} of the model's {len(trainable)} trainable parameters are not in the "
            f"optimizer ({shown}): they get gradients, counted in the norms, but this "
            "optimizer never changes them. Freeze them (p.requires_grad_(False)) if that "
            "is deliberate, or add them to the optimizer; if another optimizer trains them "
            "(a GAN's discriminator), give that network its own Monitor and this one only "
            "the network this optimizer trains",
            stacklevel=3)


def default_run_dir(every_rank: bool = False) -> Path:
    """`NBWATCH_RUN_DIR` (set by `nbwatch.launch`), else runs/<date-time>; `every_rank`:
    rank 0's name on every rank of a torchrun job (a collective: each rank calls it)."""
    env = os.environ.get("NBWATCH_RUN_DIR")
    if env:
        return Path(env)
    own = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if every_rank:
        from ..distributed import rank0_run_dir

        return rank0_run_dir(own)
    return own


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def check_run_dir(run_dir: Path) -> None:
    """Refuse a folder that cannot be written, that holds another tool's files, or that a
    live run writes (this process's too: refused before a re-run cell rebinds `mon`).
    A folder made only to try it is removed again: the run makes it as it opens, and a
    Monitor refused meanwhile leaves nothing behind."""
    check_run_dir_length(run_dir)  # SQLite would refuse it only at the run's first write
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"run_dir {run_dir} is a file; pass a folder path")
    blocking = next((p for p in run_dir.absolute().parents if p.exists() and not p.is_dir()),
                    None)
    if blocking is not None:
        raise NotADirectoryError(f"run_dir {run_dir} lies under {blocking}, which is a file, "
                                 "not a folder; pass a path whose parents are folders")
    if run_dir.is_dir() and not is_run_dir(run_dir):
        foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in _ALLOWED_FOREIGN)
        if foreign:
            shown = ", ".join(foreign[:5]) + (" …" if len(foreign) > 5 else "")
            raise FileExistsError(
                f"run_dir {run_dir} already holds files that nbwatch did not write ({shown}); "
                "pass a new or empty folder so that nothing of yours is mixed up or overwritten"
            )
    if is_run_dir(run_dir):
        check_no_writer(run_dir)
    made = next((p for p in [*reversed(run_dir.parents), run_dir] if not p.exists()), None)
    try:
        # a link to a folder not made yet: make where it leads (mkdir of the link would
        # say "File exists")
        target = Path(os.path.realpath(run_dir)) if run_dir.is_symlink() else run_dir
        target.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".nbwatch-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PermissionError(
            f"run_dir {run_dir} is not writable ({e.strerror or e}); pass a folder you can "
            "write to, e.g. run_dir='runs/exp1' under your home or project"
        ) from e
    if made is not None and not run_dir.is_symlink():
        with contextlib.suppress(OSError):  # one another process filled meanwhile: kept
            for p in [run_dir, *run_dir.parents]:  # the folders made here, deepest first
                p.rmdir()
                if p == made:
                    break


def check_closure_free(optimizer: torch.optim.Optimizer) -> None:
    """`start()` calls `optimizer.step()` without a closure: refuse an optimizer whose step
    needs one (LBFGS) before the run opens."""
    import inspect

    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"start() calls optimizer.step() without a closure, which "
            f"{type(optimizer).__name__}.step needs: run it in a loop of your own "
            "(loss = optimizer.step(closure); mon.log(loss=loss)), or pick an optimizer "
            "that steps without one (AdamW, SGD)")


def check_start(step_fn: Any, train_data: Any, max_steps: Any, val_fn: Any,
                eval_every: int | None, checkpoint_every: int | None, accumulate: int
                ) -> tuple[int, int | None, int]:
    """`Monitor.start()`'s loop arguments; returns `max_steps`, `eval_every` (with a
    `val_fn` and none given: every tenth of the run) and `accumulate`, as Python ints."""
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable as step_fn(model, batch), got {step_fn!r}")
    if not integral(max_steps) or max_steps < 1:
        fix = (f"int({max_steps!r})" if isinstance(max_steps, str) and max_steps.isdigit()
               else "the optimizer steps to train, e.g. max_steps=1000")
        raise ValueError(f"max_steps must be a positive int, got {max_steps!r}; pass {fix}")
    check_every(eval_every=eval_every, checkpoint_every=checkpoint_every)
    if not integral(accumulate) or accumulate < 1:
        raise ValueError(f"accumulate must be an int ≥ 1, got {accumulate!r}")
    if val_fn is not None and eval_every is None:
        eval_every = max(max_steps // 10, 1)
    if not hasattr(train_data, "__iter__"):
        raise TypeError(
            f"train_data must be iterable (a DataLoader, a list of batches…), "
            f"got {type(train_data).__name__}"
        )
    return int(max_steps), None if eval_every is None else int(eval_every), int(accumulate)


def log_figures(loss: Any, mask: torch.Tensor | list[torch.Tensor] | None,
                scalars: dict[str, Any],
                first: bool = False, logits: torch.Tensor | None = None,
                source: TrainLogits | None = None, keep: bool = True,
                logit_mask: Any = ...
                ) -> tuple[dict[str, float], list[str], list[torch.Tensor], Any]:
    """Check what `log()` was given: host figures, device figures with their names
    (copied to the host in the step's one copy, read at the next boundary; `logits`: their
    log Z and max |logit| over a fixed subsample, `probes.logits`; without them,
    `source`'s, the output layer's hook), and the
    sequence lengths of the mask. On the `first` step a mask is checked for 0/1 values (on
    a GPU one sync, once) and refused if it holds others; later steps count a bad mask's
    entries with the other figures (`probes.data.BAD`: its figures left out, said once).
    Copies of a later CPU mask and of CPU logits' rows wait in `host` for the step's
    record, which takes their figures a batch of steps at a time (`probes.late`); not
    where `keep` is off (a packed batch's, whose histogram takes its documents').
    `logit_mask`: the logits' own positions where they are not the mask's (an
    encoder-decoder's target; None: every position), by default the last mask."""
    host: dict[str, float] = {}
    names: list[str] = []
    parts: list[torch.Tensor] = []
    if isinstance(loss, (list, tuple)):  # each micro-batch's: the step's mean
        each: dict[str, float] = {}
        ts: list[torch.Tensor] = []
        for i, v in enumerate(loss):
            add_figure(each, [], ts, str(i), v, f"loss[{i}]")
        if not loss:
            raise ValueError("mon.log(): loss is an empty list; pass the step's micro-batches'"
                             " losses (loss=[l1, l2, ...]), or its loss")
        loss = step_mean(ts, list(each.values()))
    if loss is not None:
        add_figure(host, names, parts, "loss/train", loss, "loss")
    for k, v in scalars.items():
        add_figure(host, names, parts, f"train/{k}", v, f"{k}=")
    if logits is not None and not is_logits(logits):
        got = (f"a tensor of shape {tuple(logits.shape)} and dtype {logits.dtype}"
               if isinstance(logits, torch.Tensor) else f"a {type(logits).__name__}")
        raise TypeError(f"mon.log(): logits is {got}; pass the model's output logits, a "
                        "float tensor [..., vocab] (e.g. logits=out.logits)")
    masks = _masks_of(mask)  # the logits, the last micro-batch's
    m = masks[-1] if masks and isinstance(masks[-1], torch.Tensor) else None
    if logit_mask is not ...:
        m = logit_mask
    if source is not None:  # the logits given, else the output layer's hook
        lnames, lparts = source.parts(logits, m, host=host)
        names += lnames
        parts += lparts
    elif logits is not None:
        names += LOGIT_NAMES
        parts += logit_parts(logits, m)
    if not masks:
        if isinstance(mask, (list, tuple)):
            raise ValueError("mon.log(): mask is an empty list; pass the step's micro-batches'"
                             " masks, or none")
        return host, names, parts, None
    for one in masks:
        if not isinstance(one, torch.Tensor):
            raise TypeError(f"mon.log(): mask is a {type(one).__name__}; pass the batch's "
                            "[batch, seq_len] attention mask tensor (1 for real tokens), or a "
                            "list of them, one per micro-batch the step accumulated")
        if one.dim() not in (1, 2) or one.numel() == 0:
            raise ValueError(
                f"mon.log(): mask has shape {tuple(one.shape)}; pass the batch's [batch, "
                "seq_len] 0/1 attention mask (1 for real tokens, 0 for padding)")
        if first:
            check_mask(one, "mon.log()")
    if not first and keep and keep_masks(host, masks):
        return host, names, parts, None
    return host, names, parts, batch_figures(masks).into(names, parts, host)


def _masks_of(mask: Any) -> list:
    """`log(mask=...)` as a list: one mask per micro-batch the step accumulated."""
    return list(mask) if isinstance(mask, (list, tuple)) else [] if mask is None else [mask]


def mask_samples(mask: torch.Tensor | list[torch.Tensor] | None) -> int | None:
    """The sequences a step's mask (or micro-batches' masks, checked) counts, for samples/s;
    None where there is none ([batch, seq_len]; a [seq_len] one is one sequence)."""
    return mask_rows([m for m in _masks_of(mask) if m.dim() in (1, 2)]) or None


_REAL = "pass a real number or a one-element real tensor"


def add_figure(host: dict[str, float], names: list[str], parts: list[torch.Tensor],
                name: str, v: Any, what: str) -> None:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(
                f"mon.log(): {what} has shape {tuple(v.shape)}, not one value: reduce it "
                "first (e.g. loss.mean(), or a masked mean over real tokens)")
        if v.is_complex():
            raise TypeError(f"mon.log(): {what} is a complex tensor ({v.dtype}); {_REAL} "
                            "(e.g. its .real or .abs())")
        if v.is_meta:
            raise ValueError(f"mon.log(): {what} is a meta tensor (a shape without data, from "
                             "a model still on the meta device?); pass the value the step "
                             "computed on real data")
        names.append(name)
        v = v.detach()
        if not v.is_floating_point() and v.device.type != "mps":  # (no float64 there)
            v = v.double()  # a count: exact, not rounded to float32 by the step's one copy
        parts.append(v if v.dim() == 0 else v.reshape(()))
    else:
        host[name] = host_number(v, what)


def host_number(v: Any, what: str) -> float:
    """A host value given to `log()` as a float: a number, a bool (as a bool tensor is:
    0 or 1) or a one-element numpy array; anything else refused, naming `what`."""
    if isinstance(v, (np.ndarray, np.generic)):
        if v.size != 1:
            raise ValueError(f"mon.log(): {what} has shape {v.shape}, not one value: reduce "
                             "it first (e.g. .mean())")
        if v.dtype.kind not in "biuf":
            raise TypeError(f"mon.log(): {what} is a numpy {v.dtype} value; {_REAL}")
        v = v.item()
    if isinstance(v, bool):
        return float(v)
    if not real(v):
        raise TypeError(f"mon.log(): {what} is a {type(v).__name__} ({short_repr(v)}); {_REAL}")
    try:
        return float(v)
    except OverflowError:
        raise ValueError(f"mon.log(): {what} is {short_repr(v)}, too large for a float "
                         "(at most ~1.8e308); log its logarithm, or a scaled value") from None
