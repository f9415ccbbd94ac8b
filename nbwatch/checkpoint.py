"""Checkpoints: atomic writes, rotation (last N + best), and loading with weights_only=True."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from .store.recover import temp_path

FORMAT = "nbwatch-checkpoint"
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt or not nbwatch's."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk, a read-only folder). Its partial
    file is gone; the first line of the message says why ("disk full: ..." for a full disk)."""


@dataclass(frozen=True)
class Saved:
    path: Path
    seconds: float
    bytes: int
    best: bool


def rng_state() -> dict[str, Any]:
    """Every RNG a training loop draws from, in types `torch.load(weights_only=True)` accepts."""
    # legacy (the default): MT19937's tuple; numpy's stub types the bare call as the dict
    np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _chain(e: BaseException | None):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _write_failed(e: BaseException, tmp: Path, path: Path) -> str:
    """Why writing `path` failed, cause first; measured before its partial file `tmp` is
    removed (torch reports a full disk as `enforce fail ... unexpected pos`, no errno)."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    cause = f"{type(e).__name__}: {first}"
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    try:
        partial = tmp.stat().st_size
    except OSError:
        partial = 0
    full = any(getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for x in _chain(e))
    if not full and free is not None and free < (1 << 20):  # the partial file filled it
        full = True
    if not full:
        return (f"checkpoint {path} could not be written ({cause}); its partial file was "
                "removed and the checkpoints before it are kept")
    others = [p.stat().st_size for p in path.parent.glob("step_*.pt") if p != path]
    needed = max(others) if others else partial
    room = (free or 0) + partial
    unit = max(needed, room)  # one unit for both: 0.4 MiB against 0.4 MiB read as fitting
    need = (f"about {_size(needed, unit)}" if others
            else f"more than the {_size(partial, unit)} written")
    left = f"{_size(room, unit)} are free" if free is not None else "it is full"
    return (f"disk full: checkpoint {path} could not be written ({cause}); its partial file"
            f" was removed ({left} on that disk now, a checkpoint needs {need}). Free space"
            " there (or keep fewer checkpoints with keep_last=), then resume the run with"
            " resume=True from its newest checkpoint; the checkpoints before it are kept")


def _size(n: float, scale: float) -> str:
    """Bytes in the unit a figure of `scale` bytes reads best in: KiB below 10 MiB."""
    return f"{n / 2**10:,.0f} KiB" if scale < 10 * 2**20 else f"{n / 2**20:,.1f} MiB"


def _write_atomically(path: Path, write: Any) -> None:
    """`write(tmp)` then rename onto `path`; on any failure the temp file is removed (a full
    disk keeps no half-written file eating the space) and CheckpointWriteError says why."""
    tmp = temp_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        why = _write_failed(e, tmp, path) if isinstance(e, Exception) else ""
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if why:
            raise CheckpointWriteError(why) from e
        raise
    _fsync_dir(path.parent)


def atomic_save(obj: Any, path: Path) -> int:
    """torch.save to a temp file, fsync, rename: a reader never sees half a file, and a
    failed write leaves none (CheckpointWriteError, "disk full: ..." for a full disk)."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    _write_atomically(path, write)
    return path.stat().st_size


KEEP_BRANCHES = 3  # rewinds whose abandoned checkpoints are kept (checkpoints/rewind/<n>/)


class Checkpointer:
    """Writes `step_XXXXXXXX.pt` files into `directory`, keeps the newest `keep_last`,
    and keeps the one with the best val loss as `best.pt` (a hard link, or a copy)."""

    every_rank = False  # rank 0 alone saves (sharded_checkpoint.py's: every rank)
    group: Any = None  # the ranks' group its shards are read over (sharded_checkpoint.py's)

    def __init__(self, directory: str | Path, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.best_val: float | None = self._best_recorded()

    def _best_recorded(self) -> float | None:
        """The val loss of an earlier run's best.pt (from its small sidecar), so that a
        resumed run does not replace it with a worse one."""
        try:
            return float(json.loads((self.dir / "best.json").read_text())["val_loss"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def steps(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _STEP_FILE.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        s = self.steps()
        return s[-1][1] if s else None

    def set_aside(self, after: int, folder: str) -> list[Path]:
        """Move the checkpoints of steps after `after` into `folder` (under this one), where
        `steps()` and `latest()` no longer see them: a rewind's abandoned branch, kept for
        whoever wants it, never what `resume=True` continues."""
        gone = [p for s, p in self.steps() if s > after]
        if not gone:
            return []
        into = self.dir / folder
        into.mkdir(parents=True, exist_ok=True)
        moved = []
        for p in gone:
            os.replace(p, into / p.name)
            moved.append(into / p.name)
        _fsync_dir(self.dir)
        # the newest branches' alone: rule-driven rewinds must not fill the disk
        kept = sorted((d for d in into.parent.iterdir() if d.is_dir() and d.name.isdigit()),
                      key=lambda d: int(d.name))
        for old in kept[:-KEEP_BRANCHES]:
            shutil.rmtree(old, ignore_errors=True)
        return moved

    def save(self, state: dict[str, Any], step: int, val_loss: float | None = None) -> Saved:
        self.dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        path = self.dir / f"step_{step:08d}.pt"
        size = atomic_save({"format": FORMAT, "step": step, "val_loss": val_loss, **state}, path)
        best = val_loss is not None and (self.best_val is None or val_loss < self.best_val)
        if best:
            def link(tmp: Path) -> None:
                tmp.unlink(missing_ok=True)
                try:
                    os.link(path, tmp)
                except OSError:  # no hard links on this filesystem
                    shutil.copyfile(path, tmp)

            _write_atomically(self.dir / "best.pt", link)
            _write_atomically(self.dir / "best.json", lambda tmp: tmp.write_text(
                json.dumps({"step": step, "val_loss": val_loss})))
            self.best_val = val_loss
        for _, old in self.steps()[: -self.keep_last]:
            old.unlink(missing_ok=True)
        return Saved(path, time.perf_counter() - t0, size, best)


def restore_into(ckpt: dict[str, Any], model: Any, optimizer: Any, scheduler: Any,
                 scaler: Any, control: Any, where: Path, pending: int = 0,
                 group: Any = None) -> int:
    """Load a checkpoint's model, optimizer, scheduler, scaler, RNG and control state
    (resume, rewind); returns its step. A model that does not fit gets a clear error. A
    scheduler saved a step behind its checkpoint's number is stepped to it, less the
    `pending` step the loop has yet to take itself (a rewind inside a `log()` that comes
    before the loop's `scheduler.step()`). `group`: the ranks' group for FSDP2's shards."""
    try:
        if ckpt.get("sharded"):  # FSDP2: the shards, read by every rank (sharding.py)
            from .sharding import load_sharded

            load_sharded(where / ckpt["sharded"], model, optimizer, group)
        else:
            load_model_state(bare_module(model), ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        if (scheduler is not None and ckpt.get("scheduler") is not None
                and hasattr(scheduler, "load_state_dict")):
            scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("scaler") is not None:
            scaler.load_state_dict(ckpt["scaler"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise RuntimeError(
            f"checkpoint at step {ckpt.get('step')} in {where} does not fit "
            f"this model/optimizer ({e}); resume with the same model and optimizer (the "
            "same parameters, in the same optimizer groups)"
        ) from e
    behind = int(ckpt.get("scheduler_behind", 0)) - pending
    if behind > 0 and scheduler is not None and ckpt.get("scheduler") is not None:
        try:
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(behind):
                    scheduler.step()
        except Exception as e:
            raise RuntimeError(
                f"the scheduler of the checkpoint at step {ckpt.get('step')} was saved a step "
                f"behind, and stepping it to its step failed ({type(e).__name__}: {e}); pass "
                "the scheduler the run was trained with") from e
    set_rng_state(ckpt["rng"])
    c = ckpt.get("controls", {})
    control.clip = c.get("clip")
    control.lr_factor = float(c.get("lr_factor", 1.0))
    control.lr_raw = bool(c.get("lr_raw", False))
    return int(ckpt["step"])


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of `model` (its `bare_module`): its state_dict, less a PEFT
    model's frozen base weights (`frozen_base`) and what their layers write beside them
    (a quantized base's statistics: bitsandbytes' `weight.absmax`, `weight.quant_map`)."""
    state = model.state_dict()
    base = frozen_base(model)
    return {k: v for k, v in state.items() if not of_base(k, base)} if base else state


def of_base(key: str, base: set[str]) -> bool:
    """Whether state_dict `key` is a `frozen_base` weight's, or written beside one under
    its name (`<weight>.absmax`)."""
    return key in base or any(key[:i] in base for i, c in enumerate(key) if c == ".")


def frozen_base(model: torch.nn.Module) -> set[str]:
    """A PEFT model's (LoRA's) frozen weights, by every name they have (tied ones too):
    the pretrained base the script loads again before it resumes, left out of its
    checkpoints (a 7B bf16 base is 13 GB each; the adapters, their `modules_to_save`,
    the buffers and the optimizer are kept). Every adapter is kept, the frozen ones too
    (PEFT freezes all but the active one: one trained before, a reference), as PEFT's
    `save_pretrained` keeps them. Empty for any other model, whose frozen weights are
    saved (an EMA copy kept frozen in the model changes)."""
    if not (type(model).__module__.startswith("peft.") and hasattr(model, "peft_config")):
        return set()
    names = set(getattr(model, "peft_config", None) or ())
    adapters: set[int] = set()  # each adapter's own parameters, by the tuner layers' dicts
    for m in model.modules():
        held = [getattr(m, a, None) for a in getattr(m, "adapter_layer_names", ())]
        if isinstance(getattr(m, "prompt_encoder", None), torch.nn.ModuleDict):
            held.append(m.prompt_encoder)
        for d in held:
            if isinstance(d, (torch.nn.ModuleDict, torch.nn.ParameterDict)):
                for name in names & set(d.keys()):
                    v = d[name]
                    adapters.update(map(id, v.parameters() if isinstance(v, torch.nn.Module)
                                        else [v]))
    return {n for n, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad and id(p) not in adapters}


def load_model_state(inner: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load a checkpoint's model state: whole, or (a PEFT model's, `model_state`) all but
    the frozen base, which the model holds already. Which weights are frozen now need not
    be those frozen when it was written (a base layer unfrozen mid-run is in it, and
    frozen in the model built again until the loop unfreezes it): what it holds loads,
    and it may lack the frozen base alone."""
    state = fit_keys(state, inner.state_dict().keys())
    base = frozen_base(inner)
    if not base:
        inner.load_state_dict(state)
        return
    missing, unexpected = inner.load_state_dict(state, strict=False)
    missing = sorted(k for k in missing if not of_base(k, base))
    unexpected = sorted(k for k in unexpected if not of_base(k, base))  # (an older one's
    if missing or unexpected:  # quantized base: its statistics beside its weights)
        raise RuntimeError("Error(s) in loading state_dict: "
                           f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")


def bare_module(model: Any) -> Any:
    """The module a checkpoint holds: inside torch.compile's and DDP's (or DataParallel's)
    wrappers, so that its keys carry no `_orig_mod.` or `module.` and load alike into the
    model wrapped or not (a DDP run resumed alone, a compiled run resumed uncompiled)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, (torch.nn.parallel.DistributedDataParallel,
                                                torch.nn.DataParallel)):
            inner = model.module
        if inner is None:
            return model
        model = inner


def fit_keys(state: dict[str, Any], want: Any) -> dict[str, Any]:
    """`state` with the wrappers' prefixes (`_orig_mod.`, `module.`) that a checkpoint
    written before `bare_module` kept taken off, where that makes its keys the model's."""
    want = set(want)
    while set(state) != want:
        for prefix in ("_orig_mod.", "module."):
            if state and all(k.startswith(prefix) for k in state):
                state = {k.removeprefix(prefix): v for k, v in state.items()}
                break
        else:
            return state  # load_state_dict names what differs
    return state


def load(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load an nbwatch checkpoint with `weights_only=True`; a clear error if it is not one."""
    path = Path(path)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {first}); it is corrupt or "
            "truncated: delete it to resume from the previous one"
        ) from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an nbwatch checkpoint (no '{FORMAT}' marker)")
    return obj
