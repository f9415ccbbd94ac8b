"""The one narrow channel back: control commands, and LR arithmetic that survives a scheduler.

Buttons, `Monitor.pause()` etc. and other processes (through the store) send `Command`s
made by `make_command` (one table of what each kind takes); the recorder applies them
between steps and records each one's outcome as an event naming its id.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .counts import integral
from .records import Command, CommandKind

KINDS = tuple(k.value for k in CommandKind)
MAX_SKIP = 100_000  # batches one skip may throw away: past it, a typo, not a remedy
MAX_REWIND = 10**9  # steps one rewind may go back


@dataclass
class ControlState:
    """What the controls have set; saved in every checkpoint."""

    clip: float | None = None
    lr_factor: float = 1.0
    lr_raw: bool = False  # the optimizer's LRs hold the plain schedule (factor divided out)

    def to_dict(self) -> dict:
        return {"clip": self.clip, "lr_factor": self.lr_factor, "lr_raw": self.lr_raw}


class CommandQueue:
    """Thread-safe FIFO of commands; `get` waits (used while paused). Closed when its run
    ends, so that a command sent as it ends is refused, never kept for the next run."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def put(self, command: Command) -> None:
        if not isinstance(command, Command):
            raise TypeError(f"not a Command: {command!r}; make one with make_command()")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{command.kind.value} refused: the run has just ended")
            self._q.put(command)

    def close(self) -> list[Command]:
        """The run ends: refuse what comes now; returns what is left (to expire)."""
        with self._lock:
            self._closed = True
        return self.drain()

    def open(self) -> None:
        """A run opens on this queue (what a handle queued before it is kept)."""
        with self._lock:
            self._closed = False

    def drain(self) -> list[Command]:
        if self._q.empty():  # the common case, without raising queue.Empty
            return []
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def get(self, timeout: float) -> Command | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None


def _no_args() -> dict[str, Any]:
    return {}


def _clip(max_norm: float | None = None) -> dict[str, Any]:
    return {"max_norm": check_clip(max_norm)}


def _scale_lr(factor: float = 0.5) -> dict[str, Any]:
    return {"factor": check_factor(factor)}


def _rewind(steps: int = 100, skip: int = 200) -> dict[str, Any]:
    return {"steps": check_count("steps", steps, 1, MAX_REWIND),
            "skip": check_count("skip", skip, 0, MAX_SKIP)}


def _skip(batches: int) -> dict[str, Any]:
    return {"batches": check_count("batches", batches, 1, MAX_SKIP)}


@dataclass(frozen=True)
class Field:
    """One argument's input beside its button on the page: a number, starting at `value`
    (`integer`: a whole one); `switch`: a checkbox beside it, unchecked sends None."""

    name: str  # the argument's name: the page sends it by this name
    css: str  # the input's class on the page, nbw-<css>
    value: float
    least: float  # the input's least value (its arrows stop there; the check says why)
    step: float
    note: str = ""  # a word after the input
    integer: bool = False
    switch: bool = False


@dataclass(frozen=True)
class CommandSpec:
    """One command of the table: the arguments it takes (checked, they make its payload),
    the `Controls` method that sends it, and its button on the page (None: none): its label,
    class (nbw-<css>), the inputs of its arguments and its tooltip. `instead_of`: the
    button this command takes over while the run is paused (Resume on Pause's)."""

    args: Callable[..., dict[str, Any]]
    method: str
    button: str | None
    css: str = ""
    fields: tuple[Field, ...] = ()
    title: str = ""
    instead_of: CommandKind | None = None


# The one table of the commands: the API's methods, `send`, the widget's buttons (the page
# receives the table and builds its buttons from it: `page_table()`) and attach all build
# their commands through it; the recorder's dispatch table (recorder/steering.py) applies
# each kind; tests/test_controls.py holds the enum, the methods, the dispatch and the page
# to it.
COMMANDS: dict[CommandKind, CommandSpec] = {
    CommandKind.PAUSE: CommandSpec(_no_args, "pause", "Pause", "pause",
                                   title="pause at the next step boundary"),
    CommandKind.RESUME: CommandSpec(_no_args, "resume", "Resume", "pause",
                                    title="go on from the step it is paused at",
                                    instead_of=CommandKind.PAUSE),
    CommandKind.STOP: CommandSpec(_no_args, "stop", "Stop", "stop",
                                  title="stop after a final checkpoint"),
    CommandKind.CHECKPOINT: CommandSpec(_no_args, "checkpoint", "Checkpoint", "checkpoint",
                                        title="write a checkpoint at the next step"),
    CommandKind.CLIP: CommandSpec(
        _clip, "set_clip", "Clip", "clip",
        (Field("max_norm", "clip-value", 1.0, 0.01, 0.1, "on", switch=True),),
        "clip the global gradient norm to this value from the next step (unticked: no "
        "clipping)"),
    CommandKind.SCALE_LR: CommandSpec(
        _scale_lr, "scale_lr", "Cut LR", "lr",
        (Field("factor", "lr-factor", 0.5, 0.05, 0.05, "× LR"),),
        "multiply the learning rate by this factor, over the scheduler's"),
    CommandKind.REWIND: CommandSpec(
        _rewind, "rewind", "Rewind", "rewind",
        (Field("steps", "rewind-steps", 100, 1, 10, "steps back", integer=True),
         Field("skip", "rewind-skip", 200, 0, 50, "batches skipped", integer=True)),
        "reload the newest checkpoint at least this many steps back, and skip this many "
        "batches"),
    CommandKind.SKIP: CommandSpec(_skip, "skip", None),
}
PAYLOADS: dict[CommandKind, Callable[..., dict[str, Any]]] = {
    k: c.args for k, c in COMMANDS.items()}


def page_table() -> list[dict[str, Any]]:
    """The commands that have a button, as the page receives them (it builds its bar from
    this): kind, label, class, tooltip, the inputs of the arguments, and `instead_of`."""
    return [{"kind": k.value, "label": c.button, "css": c.css, "title": c.title,
             "instead_of": c.instead_of.value if c.instead_of else None,
             "fields": [dataclasses.asdict(f) for f in c.fields]}
            for k, c in COMMANDS.items() if c.button is not None]


def make_command(kind: str | CommandKind, source: str = "api", **args: Any) -> Command:
    """A checked command: `make_command("rewind", steps=10, skip=0)`. Bad arguments raise
    here, in the caller's thread, naming the argument and what it takes."""
    try:
        k = CommandKind(kind)
    except ValueError:
        raise ValueError(f"unknown command {kind!r}; known: {', '.join(KINDS)}") from None
    try:
        payload = PAYLOADS[k](**args)
    except TypeError:
        raise TypeError(takes(k, args)) from None
    return Command(k, payload, source)


def takes(kind: CommandKind, args: dict[str, Any]) -> str:
    """What `kind` takes, against the arguments it was given (for a TypeError)."""
    import inspect

    params = inspect.signature(PAYLOADS[kind]).parameters
    named = ", ".join(f"{n}=" for n in params) or "no arguments"
    return f"{kind.value} takes {named}; got {', '.join(f'{a}=' for a in args) or 'none'}"


def checked(command: Command) -> Command:
    """`command` with its payload checked as `make_command` checks it, where it is applied:
    a row another process wrote into the store, or a framework's exchange, never went
    through `make_command`. Raises ValueError or TypeError naming what is wrong."""
    if not isinstance(command.payload, dict):
        raise TypeError(f"{command.kind.value}: its arguments must be a dict, got "
                        f"{type(command.payload).__name__}")
    # what the recorder decided of a rewind (rank 0, before it goes to every rank) is kept
    decided = {k: v for k, v in command.payload.items()
               if command.kind is CommandKind.REWIND and k in REWIND_DECIDED}
    if "to" in decided:
        decided["to"] = check_count("to", decided["to"], 0)
    if "refused" in decided and not isinstance(decided["refused"], str):
        raise TypeError(f"rewind: refused is a reason (a str), got {decided['refused']!r}")
    given = {k: v for k, v in command.payload.items() if k not in decided}
    try:
        payload = PAYLOADS[command.kind](**given)
    except TypeError:
        raise TypeError(takes(command.kind, given)) from None
    return Command(command.kind, {**payload, **decided}, command.source, command.id)


REWIND_DECIDED = ("to", "refused")  # recorder/rewind.py's resolve_rewind adds them


class Controls:
    """The control surface shared by `Monitor`, the framework handles and `Attached` (what
    the buttons call). Each method returns the command's id: its one outcome event
    (`events`, kind "action" when applied, "command" when refused or expired) names it.

    Subclasses implement `submit(command)`: a queue in this process, or a row in the
    store for a run written by another.
    """

    def submit(self, command: Command) -> None:
        """Send a `Command` made with `make_command`: checked here, applied by the run."""
        raise NotImplementedError

    def send(self, kind: str | CommandKind, source: str = "api", **args: Any) -> str:
        """Send a command by name (`send("rewind", steps=10, skip=0)`): the one way in for
        the methods below, the dashboard's buttons and `attach`. Returns its id."""
        command = make_command(kind, source, **args)
        self.submit(command)
        return command.id

    def pause(self) -> str:
        """Pause after the current step (the training thread waits; the kernel stays free)."""
        return self.send("pause")

    def resume(self) -> str:
        return self.send("resume")

    def stop(self) -> str:
        """Stop after the current step, with a final checkpoint."""
        return self.send("stop")

    def checkpoint(self) -> str:
        """Write a checkpoint after the current step."""
        return self.send("checkpoint")

    def set_clip(self, max_norm: float | None) -> str | None:
        """Clip the global gradient norm to `max_norm` from the next step (None: no clipping)."""
        return self.send("clip", max_norm=max_norm)

    def scale_lr(self, factor: float) -> str:
        """Multiply the LR by `factor` from the next step; the scheduler does not undo it."""
        return self.send("scale_lr", factor=factor)

    def rewind(self, steps: int = 100, skip: int = 200) -> str:
        """PaLM's remedy for a loss spike: reload the newest checkpoint at least `steps`
        steps back (model, optimizer, scheduler, RNG; the clip and LR factor in force are
        kept) and go on from there, on the data that
        comes `skip` batches after the current one; the batches since the checkpoint and
        those `skip` are not trained on. The rewound-over steps stay in the history as a
        branch (`rewind/<n>/loss/train`). One command: refused, it changes nothing (the
        skip included). In a loop of your own, `log()` returns the checkpoint's step and
        `mon.rewound`/`mon.skip_batches` say what to do."""
        return self.send("rewind", steps=steps, skip=skip)

    def skip(self, batches: int) -> str:
        """Skip the next `batches` batches of the data stream (at most `MAX_SKIP`); in a loop
        of your own, the next `log()` sets `mon.skip_batches` for the loop to do it."""
        return self.send("skip", batches=batches)


def refuse_early(command: Command, state: str, running: bool,
                 framework: str | None = None) -> None:
    """What a handle in this process refuses at the call, before the command is queued:
    a run not running, one already stopping, a rewind or skip under a framework."""
    kind = command.kind.value
    if not running:
        raise RuntimeError(f"cannot {kind}: the run is {state}, not running")
    if state == "stopping":
        raise RuntimeError(f"cannot {kind}: the run is stopping (its final checkpoint is "
                           "being written)")
    if command.kind is CommandKind.SKIP and framework:
        raise RuntimeError(f"cannot skip: {framework} runs this loop: skip batches in its "
                           "data loader")
    if command.kind is CommandKind.REWIND and framework:
        how = _FRAMEWORK_RESUME.get(framework, "the framework's own resume from a checkpoint")
        raise RuntimeError(
            f"cannot rewind: {framework} runs this loop and keeps its own step count; "
            f"stop it and resume from one of its checkpoints instead: {how}")


# nbwatch.checkpoint.load reads nbwatch's own .pt files, never a framework's checkpoint
_FRAMEWORK_RESUME = {
    "hf": "trainer.train(resume_from_checkpoint='<output_dir>/checkpoint-N')",
    "lightning": "trainer.fit(module, ..., ckpt_path='<path>.ckpt')",
}


def check_count(name: str, v: int, least: int, most: int | None = None) -> int:
    if not integral(v) or v < least or (most is not None and v > most):
        bound = f"an int ≥ {least}" + (f" and ≤ {most:,}" if most is not None else "")
        raise ValueError(f"{name} must be {bound}, got {v!r}")
    return int(v)


def _number(v: Any) -> float:
    """`v` as a float, or NaN where it is none (an empty box, a word): the check names it."""
    if isinstance(v, bool):
        return float("nan")
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def check_clip(max_norm: float | None) -> float | None:
    if max_norm is None:
        return None
    v = _number(max_norm)
    if not v > 0 or v == float("inf"):
        raise ValueError(
            f"clip max_norm must be a positive finite number or None, got {max_norm!r}"
        )
    return v


def check_factor(factor: float) -> float:
    v = _number(factor)
    if not v > 0 or v == float("inf"):
        raise ValueError(f"LR factor must be a positive finite number, got {factor!r}")
    return v


def scale_lrs(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every param group's LR by `factor` (a tensor LR is scaled in place)."""
    for g in optimizer.param_groups:
        scale_group_lr(g, factor)


def scale_group_lr(group: dict[str, Any], factor: float) -> None:
    """Multiply one param group's LR by `factor` (a tensor LR in place)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].mul_(factor)
    else:
        group["lr"] *= factor


def lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def chains(scheduler: Any) -> bool:
    """Whether `scheduler.step()` scales the current LR (chainable: StepLR, ExponentialLR)
    rather than recomputing it from `base_lrs` (closed form: LambdaLR, OneCycleLR)."""
    cached = _CHAINS.get(scheduler)  # never an attribute: state_dict() is its __dict__
    if cached is not None:
        return cached
    groups = scheduler.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = list(scheduler.get_lr())
            for g in groups:
                g["lr"] = g["lr"] * 2.0
            b = list(scheduler.get_lr())
        chains = any(x != y for x, y in zip(a, b))
    except Exception:  # a hand-written scheduler: assume closed form, the common case
        chains = False
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr
    _CHAINS[scheduler] = chains
    return chains


_CHAINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def on_metric(scheduler: Any) -> bool:
    """Whether `scheduler` steps on a metric the loop hands it, at its evals
    (ReduceLROnPlateau), not once per optimizer step."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def steps_taken(scheduler: Any) -> Any:
    """A counter that moves when the scheduler steps (None if it has none)."""
    for attr in ("_step_count", "last_epoch"):
        n = getattr(scheduler, attr, None)
        if n is not None:
            return n
    return None
