"""Which batch: each recorded step's batch identity, kept in a ring of the last
`RING` steps, so that an alert about a step (a loss spike) can name the batches of the
steps around it.

An identity is `{"step": s}` plus what the loop offers cheaply: `epoch` and `index` (the
batch's position in its epoch) where nbwatch iterates the data (`Monitor.start()`) or the
framework says (Lightning) or a loop of the user's passes them to `mon.log(batch=...,
epoch=..., index=...)` (else `index` counts the batches given to `log()`, from 0 in each
epoch given), and `hash`, the CRC-32 (hex) of the batch's token ids where
they are a CPU integer tensor (`batch["input_ids"]`, the batch itself, or its first
element). Device tensors are never hashed: that would cost a device→host copy a step.
With gradient accumulation, `micro` counts the micro-batches, `epoch`/`index` are the
first one's, and `hash` is the CRC-32 of all of them in order.
"""

from __future__ import annotations

import numbers
import zlib
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

RING = 96  # the 63 `batches_before` allows, and a record batch (step_end.py) later


def hashable_ids(batch: Any) -> np.ndarray | None:
    """The batch's token ids as a contiguous host array, or None where there are none on
    the CPU (floats, device tensors, no tensor)."""
    t: Any
    if isinstance(batch, torch.Tensor):
        t = batch
    elif isinstance(batch, Mapping):
        t = batch.get("input_ids")
    elif isinstance(batch, (list, tuple)) and batch:
        t = batch[0]
    else:
        return None
    if not isinstance(t, torch.Tensor):
        return None
    # numpy refuses what is not a plain CPU tensor (a GPU one: no copy is made) and a
    # dtype it lacks; one call instead of five looks at the tensor, each cold after a
    # backward pass (111 against 157 µs with the hash, benchmarks/README.md)
    try:
        a = t.numpy()
    except (TypeError, RuntimeError):  # a device tensor, sparse, a dtype numpy lacks
        return None
    return np.ascontiguousarray(a) if a.dtype.kind in "iu" else None  # not float or bool


def content_hash(batch: Any) -> str | None:
    """CRC-32 (8 hex digits) of the batch's CPU token ids, or None (see `hashable_ids`)."""
    a = hashable_ids(batch)
    return None if a is None else f"{zlib.crc32(a.data):08x}"


class BatchIds:
    """The batch identities of the last `RING` steps, and that of the step being taken."""

    def __init__(self, ring: int = RING):
        self.ring: deque[dict[str, Any]] = deque(maxlen=ring)  # oldest first
        self._batch: dict[str, Any] | None = None  # the step being taken
        self._logged: tuple[int | None, int] | None = None  # log(batch=): (epoch, next index)
        self._counted = False  # this step's log() took a count (one that raised: taken back)
        self._before: tuple[int | None, int] | None = None  # the count before it

    def note_logged_batch(self, batch: Any, scalars: dict[str, Any]) -> None:
        """`mon.log(batch=..., epoch=..., index=...)`: the identity of the step's batch, as
        `start()` records it; `epoch` and `index` are taken out of `scalars` (with a batch
        they say where it is, not figures). Without `index`, an own count of the batches
        given to `log()` (from 0, and again from 0 when `epoch` changes). A later `log()`
        for the same step (after one that raised) replaces it."""
        if batch is None:
            return
        epoch, index = scalars.pop("epoch", None), scalars.pop("index", None)
        for name, v in (("epoch", epoch), ("index", index)):
            if v is None:
                continue
            how = (f"mon.log(): {name}={v!r}; with batch=, {name} says where the batch is (an "
                   "int ≥ 0), e.g. mon.log(loss=loss, batch=batch, epoch=epoch, index=i)")
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(how)
            if v < 0:
                raise ValueError(how)
        if isinstance(batch, (numbers.Number, str)):
            raise TypeError(f"mon.log(): batch={batch!r} is a {type(batch).__name__}; pass the "
                            "batch itself (its token ids are hashed) and its position as "
                            "index=, e.g. mon.log(loss=loss, batch=batch, index=i)")
        if not self._counted:
            self._counted, self._before = True, self._logged
        last = self._before  # a second log() for this step: the first one raised
        if index is None:
            index = last[1] if last is not None and last[0] == epoch else 0
        self._logged = (epoch, int(index) + 1)
        self._batch = None  # one batch a log(): never added to a failed log()'s
        self.note_batch(batch, epoch, index)

    def note_batch(self, batch: Any, epoch: int | None = None, index: int | None = None
                   ) -> None:
        """The step being taken uses `batch` (call once per micro-batch, before the step's
        end): its identity goes into the ring at the end of the step."""
        a = hashable_ids(batch)
        cur = self._batch
        if cur is None:
            cur = self._batch = {}
            if epoch is not None:
                cur["epoch"] = int(epoch)
            if index is not None:
                cur["index"] = int(index)
            if a is not None:
                cur["hash"] = f"{zlib.crc32(a.data):08x}"
            return
        cur["micro"] = cur.get("micro", 1) + 1
        if "hash" in cur:
            if a is None:
                del cur["hash"]
            else:  # crc32(b, crc32(a)) == crc32(a + b): the hash of the step's ids in order
                cur["hash"] = f"{zlib.crc32(a.data, int(cur['hash'], 16)):08x}"

    def end_step(self, step: int) -> None:
        """The step `step` is taken: its batch's identity goes into the ring."""
        b, self._batch, self._counted = self._batch, None, False
        self.ring.append({"step": step, **b} if b else {"step": step})

    def around(self, step: int, before: int) -> list[dict[str, Any]]:
        """The identities of steps `step - before` … `step` still in the ring, oldest first."""
        return [dict(b) for b in self.ring if step - before <= b["step"] <= step]
