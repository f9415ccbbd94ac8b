"""torchrun / DDP: rank 0 owns the store, every rank runs the same probes.

Every `every` steps (sooner where steps are slow: about every `MEET_S` seconds, as rank 0
plans at each meeting) the ranks meet in one small collective on a gloo group of nbwatch's
own (with a timeout, so a dead rank cannot hang the others forever): each rank sends
its per-step figures (loss, step time, data wait, throughput, LR, GPU memory) and rank 0
sends the control commands it has received. Rank 0 stores `rank{r}/...` columns and the
global loss (the mean over ranks); every rank applies the same commands at the same step,
so pause, stop, clip, LR factor and checkpoint never split the replicas.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .records import Command, Scalars

RANK_KEYS = ("loss", "time/step", "time/data", "time/forward", "time/busy",
             "throughput/tokens_per_s", "throughput/samples_per_s", "lr", "gpu/mem_gb",
             "time/sync", "tokens/real", "data/seq_len_mean", "data/seq_len_max",
             "data/padding_ratio")
# the job's figure is the sum of the ranks': each trains its own share of the batch
SUMMED = ("tokens/real", "throughput/tokens_per_s", "throughput/samples_per_s")
# the job's batch's lengths and padding, from each rank's with its tokens (`job_lengths`)
LENGTHS = ("data/seq_len_mean", "data/seq_len_max", "data/padding_ratio")


MEET_S = 2.0  # seconds of steps between two meetings, at most: a command waits no longer


FAILED_S = 5.0  # a rank's failure waits this long for the others' at the same step
_RUNS = itertools.count()  # the runs this process opened under torchrun


def meet_gap(rows: list[tuple[int, dict[str, float]]], every: int, last: int = 0) -> int:
    """Steps to the next meeting: `every`, or fewer where rank 0's steps since the last
    one took long (`MEET_S` of them; at least 1). Without a step time among `rows` (a
    pause's meetings; the first step), the `last` plan holds, else the next step."""
    times = sorted(f["time/step"] for _, f in rows if f.get("time/step"))
    if not times:
        return last or 1
    return max(1, min(every, math.ceil(MEET_S / max(times[len(times) // 2], 1e-9))))


@dataclass
class Dist:
    """This process's place in the job and nbwatch's own collective group."""

    rank: int
    world: int
    every: int
    group: Any
    backend: str
    next_meet: int = 0  # the step of the next meeting (0: after the run's first step)
    gap: int = 0  # the steps between meetings rank 0 planned last
    # each rank's (host, pid), as the run opened: a rank that dies is named by it
    places: list[tuple[str, int]] = field(default_factory=list)
    key: str = ""  # this run's keys in the job's rendezvous store (`not_failed`)

    @classmethod
    def detect(cls, every: int = 10, timeout_s: float = 60.0) -> Dist | None:
        """A Dist when torch.distributed is initialised with more than one rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        # A CPU group of our own: figures are small, and its timeout bounds a dead peer.
        group = own_group(timeout_s, "open its run")
        places: list[Any] = [None] * dist.get_world_size()
        with contextlib.suppress(RuntimeError):  # named less if it fails; the run goes on
            dist.all_gather_object(places, (socket.gethostname(), os.getpid()), group=group)
        places = [tuple(p) if p else ("", 0) for p in places]
        # every rank opens the job's runs in the same order: the same key on each
        key = f"nbwatch/{places[0][0]}:{places[0][1]}/{next(_RUNS)}"
        return cls(dist.get_rank(), dist.get_world_size(), every, group, dist.get_backend(),
                   places=places, key=key)

    def dead_ranks(self, wait: float = 2.0) -> list[int]:
        """The other ranks on this host whose process is gone (ended, or a zombie its
        launcher has not reaped), waiting up to `wait` s for one: a rank killed (SIGKILL,
        the OOM killer) writes no error of its own. Ranks on other hosts are not seen."""
        host = socket.gethostname()
        mine = [(r, pid) for r, (h, pid) in enumerate(self.places)
                if r != self.rank and h == host and pid]
        deadline = time.monotonic() + wait
        while True:
            dead = [r for r, pid in mine if not _alive(pid)]
            if dead or not mine or time.monotonic() >= deadline:
                return dead
            time.sleep(0.1)

    def not_failed(self, wait: float = FAILED_S) -> list[str]:
        """The other ranks that cannot take part in a collective now that this one failed,
        each said with why: each failing rank says so in the job's rendezvous store, out of
        band, as the others may be blocked inside a collective of their training (one here
        would wait for them, or mix with theirs). Waits up to `wait` s for ranks failing at
        the same step. The answer is the job's, one for every failing rank: the first rank
        that knows it (every rank failed, or its wait ran out) writes it in the store at
        once (`compare_set`) and the others take it, so no rank enters a collective another
        gave up; a rank failing later does not wait. [] where every rank failed, or the
        store cannot be reached (the collective tells)."""
        import torch.distributed as dist

        def has(r: int) -> bool:
            return bool(store.check([f"{self.key}/failed/{r}"]))

        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{self.key}/failed/{self.rank}", "1")
            count = f"{self.key}/failed_count"  # one request a look, however many ranks
            store.add(count, 1)
            others = [r for r in range(self.world) if r != self.rank]
            answer, deadline = f"{self.key}/answer", time.monotonic() + wait
            while (store.add(count, 0) < self.world and not store.check([answer])
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            left = [r for r in others if not has(r)]
            said = store.compare_set(answer, "", f"{self.rank}:" + ",".join(
                map(str, left))).decode()  # the first answer holds
            who, late = said.split(":")
            if not late:  # every rank failed
                return []
            ranks = [int(r) for r in late.split(",")]
            out = [f"rank {r} (still training)" for r in ranks if r != self.rank and not has(r)]
            if int(who) != self.rank:
                out.append(f"rank {who} (failed before, alone: gone)")
            return out or [f"rank {r} (failed after this one gave up)" for r in ranks]
        except Exception:  # noqa: BLE001 - no store (an init of one's own): the save tells
            return []

    def all_agree(self, ok: bool, what: str) -> bool:
        """Whether `ok` holds on every rank (each rank calls this at the same moment)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as e:
            raise RankLost(f"rank {self.rank} of {self.world}: another rank stopped answering "
                           f"while {what} ({str(e).splitlines()[0][:200]})") from e
        return bool(flag.item())

    def close(self) -> None:
        """Destroy nbwatch's own group (a live gloo group aborts the process at exit)."""
        import torch.distributed as dist

        if self.group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):  # gone already with the default group
                dist.destroy_process_group(self.group)
        self.group = None

    def due(self, step: int, start: int) -> bool:
        """Whether the ranks meet after `step` (of a run that began at `start`): first
        after its first step, where rank 0 learns how long a step takes."""
        if not self.next_meet:
            self.next_meet = start + 1
        elif self.next_meet - step > max(self.gap, 1):  # a rewind went back: from here
            self.plan(step, self.gap or self.every)
        return step > start and step >= self.next_meet

    def plan(self, step: int, gap: int) -> None:
        """The next meeting, `gap` steps after `step` (at `every`, on its multiples)."""
        self.gap = gap
        self.next_meet = ((step // self.every + 1) * self.every if gap >= self.every
                          else step + gap)

    def exchange(self, rows: list[tuple[int, dict[str, float]]], commands: list[Command],
                 step: int = 0, final: bool = False, gap: int = 0
                 ) -> tuple[list[list[tuple[int, dict[str, float]]]], list[Command]]:
        """All ranks' rows, and rank 0's commands (every rank calls this at the same step,
        `step`; `final`: as its loop ends); rank 0's `gap`, where given, sets every rank's
        next meeting."""
        import torch.distributed as dist

        payload = (rows, [c.to_wire() for c in commands] if self.rank == 0 else [], step,
                   final, gap if self.rank == 0 else 0)
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, payload, group=self.group)
        except RuntimeError as e:
            why = (f"; this rank's loop had ended at step {step}, and a rank that trains more "
                   "steps than the others (uneven data per rank) never comes to its end"
                   if final else "")
            raise RankLost(
                f"rank {self.rank} of {self.world}: another rank stopped answering nbwatch's "
                f"exchange ({str(e).splitlines()[0][:200]}); a rank died or hangs{why}"
            ) from e
        where = [(o[2], o[3]) for o in out]
        if len(set(where)) > 1:  # not one step: a rank ended its loop while others went on
            said = ", ".join(f"rank {r} {'ended at' if f else 'was at'} step {s}"
                             for r, (s, f) in enumerate(where))
            raise RanksOutOfStep(
                f"rank {self.rank} of {self.world}: the ranks are out of step ({said}): every "
                "rank must take the same steps; give each the same number of batches "
                "(DistributedSampler(..., drop_last=True)) or stop at the same max_steps")
        cmds = [Command.from_wire(*c) for c in out[0][1]]
        if out[0][4]:
            self.plan(step, out[0][4])
        return [o[0] for o in out], cmds


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not; Linux's /proc, else a signal 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def own_group(timeout_s: float, what: str) -> Any:
    """A new gloo group of every rank (a collective: each rank creates it at once)."""
    import torch.distributed as dist

    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # a rank that never comes: the store's wait times out
        raise RankLost(
            f"rank {dist.get_rank()} of {dist.get_world_size()}: the other ranks did not come "
            f"within {timeout_s:.0f} s as nbwatch's Monitor came to {what}: under torchrun "
            "every rank creates its Monitor and starts (or logs) it, not rank 0 alone; "
            f"nbwatch records on rank 0 by itself ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]})") from e


def rank0_run_dir(own: Path, timeout_s: float = 60.0) -> Path:
    """Rank 0's run folder, on every rank of a job (each rank calls this at once): a
    default name is taken from each process's own clock, which the ranks do not share."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return own
    group = own_group(timeout_s, "name its run folder")
    try:
        box = [str(own)]
        dist.broadcast_object_list(box, src=0, group=group)
        return Path(box[0])
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)


def peer_errors(run_dir: Path, since: float, wait: float = 2.0) -> list[dict[str, Any]]:
    """The errors other ranks wrote since `since` (their NullStore's), waiting up to `wait`
    seconds for one: a rank that lost contact learns which rank failed first, and why."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for f in sorted((run_dir / ERRORS).glob("rank*.json")):
            with contextlib.suppress(OSError, ValueError):
                if f.stat().st_mtime >= since:
                    found.append(json.loads(f.read_text()))
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


class RankLost(RuntimeError):
    """A peer rank died or stopped answering nbwatch's collective within its timeout."""


class RanksOutOfStep(RuntimeError):
    """The ranks met at different steps: one ended its loop while the others went on."""


def lost_peer(e: BaseException) -> bool:
    """An error from a collective whose peer died (gloo, NCCL) or timed out."""
    text = str(e)
    return isinstance(e, RankLost) or any(s in text for s in (
        "Connection closed by peer", "Connection reset", "timed out", "Timed out",
        "NCCL communicator was aborted", "Broken pipe"))


def rank_figures(values: dict[str, float]) -> dict[str, float]:
    """The per-rank subset of a step's figures, under the names of `RANK_KEYS`."""
    out = {"loss": values.get("loss/train", float("nan"))}
    for k in RANK_KEYS[1:]:
        if k in values:
            out[k] = values[k]
    if torch.cuda.is_available():
        out["gpu/mem_gb"] = torch.cuda.memory_allocated() / 2**30
    return out


def merge_ranks(per_rank: list[list[tuple[int, dict[str, float]]]]) -> list[Scalars]:
    """Rank rows → one Scalars per step: `rank{r}/...` columns and the global loss (mean)."""
    by_step: dict[int, dict[str, float]] = {}
    losses: dict[int, list[float]] = {}
    for r, rows in enumerate(per_rank):
        for step, figs in rows:
            d = by_step.setdefault(step, {})
            for k, v in figs.items():
                d[f"rank{r}/{k}"] = v
            losses.setdefault(step, []).append(figs.get("loss", float("nan")))
    out = []
    for step in sorted(by_step):
        d = by_step[step]
        ls = losses[step]
        if len(ls) == len(per_rank):
            d["loss/train"] = float(np.mean(ls))
            for key in SUMMED:  # the job's, not one rank's
                parts = [d.get(f"rank{r}/{key}") for r in range(len(per_rank))]
                present = [v for v in parts if v is not None]
                if len(present) == len(parts):
                    d[key] = float(sum(present))
            d.update(job_lengths(d, len(per_rank)))
        out.append(Scalars(step, d))
    return out


def job_lengths(d: dict[str, float], ranks: int) -> dict[str, float]:
    """The job's `data/seq_len_mean`, `seq_len_max` and `padding_ratio` from each rank's
    with its tokens (its samples: tokens / mean; its padding: tokens · p / (1 − p)): the
    real tokens over every rank's samples, the longest, the padding over all. Where a rank
    lacks one, rank 0's as it was."""
    out = {key: d[f"rank0/{key}"] for key in LENGTHS if f"rank0/{key}" in d}

    def each(key: str) -> list[float] | None:
        got = [d.get(f"rank{r}/{key}") for r in range(ranks)]
        return None if any(v is None for v in got) else [float(v or 0.0) for v in got]

    tokens = each("tokens/real")
    if tokens is None:
        return out
    means, longest, ratios = (each(k) for k in LENGTHS)
    if means is not None and all(m > 0 for m in means):
        out["data/seq_len_mean"] = sum(tokens) / sum(t / m for t, m in zip(tokens, means))
    if longest is not None:
        out["data/seq_len_max"] = max(longest)
    if ratios is not None and all(0.0 <= p < 1.0 for p in ratios):
        padded = sum(t * p / (1.0 - p) for t, p in zip(tokens, ratios))
        if sum(tokens) + padded > 0:
            out["data/padding_ratio"] = padded / (sum(tokens) + padded)
    return out


ERRORS = "rank_errors"  # the run folder's file per rank > 0 that failed: rank{r}.json


class NullStore:
    """The store of ranks other than 0: the same interface, nothing written but the rank's
    own error (rank 0 alone writes the store: it names the error in its own record)."""

    def __init__(self, run_dir: str | Path, rank: int = 1):
        self.run_dir, self.rank = Path(run_dir), rank

    def put(self, record: Any) -> None:
        if getattr(record, "kind", None) == "error":
            with contextlib.suppress(OSError):  # a folder this rank cannot write: said less
                folder = self.run_dir / ERRORS
                folder.mkdir(parents=True, exist_ok=True)
                tmp = folder / f".rank{self.rank}.json.tmp"
                tmp.write_text(json.dumps({
                    "rank": self.rank, "step": record.step, "message": record.message,
                    "traceback": (record.data or {}).get("traceback")}))
                os.replace(tmp, folder / f"rank{self.rank}.json")

    def set_meta(self, key: str, value: Any) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def pending_commands(self, after_id: int = 0, fresh: bool = False) -> list:
        return []

    def mark_taken(self, command_id: int) -> None:
        pass

    def flush(self, timeout: float = 10.0) -> None:
        pass

    def close(self) -> None:
        pass
