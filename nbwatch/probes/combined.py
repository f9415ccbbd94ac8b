"""A step's batch made of several batches: several loaders' (Lightning's `CombinedLoader`)
or one batch's parts (a pair's `{"chosen": ..., "rejected": ...}`, `{"image": {...},
"text": {...}}`): the one rule every loop counts it by.

    {"a": batch_a, "b": batch_b}      # CombinedLoader({"a": dl_a, "b": dl_b}), or parts
    [batch_a, batch_b]                # CombinedLoader([dl_a, dl_b])
    {"a": None, "b": batch_b}         # mode="max_size": loader a has run out

Each part is counted for its tokens as a micro-batch of the step is (its `attention_mask`,
else every `input_ids` token; a packed one's documents), the sequence figures over all of
them. Its samples: the parts' rows added up where they are known to be several loaders'
batches (Lightning, which knows its loaders), else the batch's own rows (`Split.rows`): a
shape cannot tell two loaders' batches from two views of the same samples, and counting
a pair twice would double samples/s wherever a batch comes in parts. `Tally` adds a
step's micro-batches up so, in every loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .data import packed_positions
from .throughput import batch_samples


def _one_loaders(x: Any) -> bool:
    """A batch one loader gives: a Mapping (a dict, a `BatchEncoding`) or a list or tuple
    (`(x, y)`, a `TensorDataset`'s `[x, y]`) holding a tensor with a batch dimension at its
    own level. A shape only, nothing read."""
    if isinstance(x, Mapping):
        items: Any = x.values()
    elif isinstance(x, (list, tuple)):
        items = x
    else:
        return False
    return any(isinstance(v, torch.Tensor) and v.ndim for v in items)


def _by_loaders(batch: Any, loaders: Any) -> list | None:
    """The loaders' batches, where `batch` has the shape of `loaders` (the fit's collection
    of loaders: a dict, list or tuple of them, nested or not); None where it has not (a
    hook that reshaped the batch)."""
    if isinstance(loaders, Mapping):
        if not isinstance(batch, Mapping) or any(k not in batch for k in loaders):
            return None
        found = [_by_loaders(batch[k], v) for k, v in loaders.items()]
    elif isinstance(loaders, (list, tuple)):
        if not isinstance(batch, (list, tuple)) or len(batch) != len(loaders):
            return None
        found = [_by_loaders(b, v) for b, v in zip(batch, loaders)]
    else:  # one loader: its batch (None: a `max_size` loader run out)
        return [] if batch is None else [batch]
    if any(f is None for f in found):
        return None
    return [b for f in found if f is not None for b in f]


class Split(NamedTuple):
    """A step's batch in the parts its tokens are counted by (`loader_batches`)."""

    parts: list
    loaders: bool  # several loaders' batches (their rows add up), not one batch's parts
    inner: int = 0  # loaders' batches in parts themselves: the rows their parts count twice
    held: tuple = ()  # the parts of a batch in parts with a packed one (its documents count)

    def rows(self, batch: Any) -> int | None:
        """Its samples: the loaders' batches' rows added up, else the batch's own
        (`batch_samples`: the first batched tensor's; a shape, nothing read)."""
        if not self.loaders:
            return batch_samples(batch)
        return sum(batch_samples(p) or 0 for p in self.parts) - self.inner or None

    def overlap(self, batch: Any) -> int:
        """The rows its parts count beyond its samples (one batch's parts: each holds the
        same samples), to take from the sum of the parts' rows; for loaders' batches, those
        of the ones that come in parts (a pair loader's `{"chosen": ..., "rejected": ...}`)."""
        if self.loaders:
            return self.inner
        if len(self.parts) < 2 or self.held:  # a packed part: its documents, not its rows
            return 0
        return sum(batch_samples(p) or 0 for p in self.parts) - (batch_samples(batch) or 0)

    def beside(self, batch: Any, bare: list) -> int:
        """The samples its parts add beside a packed batch's documents (`BESIDE`, where the
        step has one): the rows of `bare`, its parts of no tokens, but those of a batch in
        parts with a packed part (its documents are its samples), less the rows its parts
        count twice (`overlap`: a pair's padded parts, counted as rows beside)."""
        rows = sum(batch_samples(p) or 0 for p in bare if not any(p is h for h in self.held))
        return rows - self.overlap(batch)


def loader_batches(batch: Any, enc_dec: bool = False, loaders: Any = None) -> Split:
    """The batches a step's batch combines, each counted for its tokens as a micro-batch
    is; `[batch]` for a plain batch.

    Where the loop knows its loaders (`loaders`: Lightning's, the collection
    `CombinedLoader` combines), their shape says which parts are batches, and their rows
    add up; each loader's batch is then split by its own shape (a pair loader's chosen and
    rejected: their tokens, its rows). Elsewhere the batch's shape, one batch's parts (its
    samples its own rows): a Mapping each of whose values is a batch (`_one_loaders`: a
    dict, or a list or tuple, with a batched tensor of its own) or None, or a list or tuple
    each of whose entries is a dict batch or None, at least one not None. So a dict with
    a batched tensor at its top level is one batch (its parts beside it are its own), and
    so is a list of `(x, y)` batches (two views of a pair; `log(batch=...)` counts them one
    each where the step took as many backward passes), and an encoder-decoder's batch in
    parts (its source's and its target's, `(src, tgt)`: its figures are the source's), as
    Lightning's tuples and a bare tensor's."""
    if isinstance(loaders, (Mapping, list, tuple)):
        found = _by_loaders(batch, loaders)
        if found:  # each loader's batch split by its shape in turn (a pair loader's)
            splits = [(loader_batches(b, enc_dec), b) for b in found]
            return Split([p for s, _ in splits for p in s.parts], True,
                         sum(s.overlap(b) for s, b in splits),
                         tuple(h for s, _ in splits for h in s.held))
    if enc_dec:
        return Split([batch], False)
    if isinstance(batch, Mapping):
        items, one = list(batch.values()), _one_loaders
    elif isinstance(batch, (list, tuple)):
        items = list(batch)

        def one(x: Any) -> bool:
            return isinstance(x, Mapping) and _one_loaders(x)
    else:
        return Split([batch], False)
    parts = [x for x in items if x is not None]
    if parts and all(one(x) for x in parts):
        packed = len(parts) > 1 and any(packed_positions(p) is not None for p in parts)
        return Split(parts, False, 0, tuple(parts) if packed else ())
    return Split([batch], False)


class Tally:
    """A step's samples, its micro-batches' added up as they come (`add`): their rows
    (`Split.rows`, shapes: nothing read), and the rows of their parts of no tokens, the
    samples beside a packed micro-batch's documents (`Split.beside`; `BESIDE`). The one
    count of start(), log(batch=), the Trainer and Lightning."""

    def __init__(self) -> None:
        self.rows = 0
        self.beside = 0

    def add(self, batch: Any, split: Split, bare: list, rows: int | None = None) -> None:
        """One micro-batch, `split` by `loader_batches`; `bare`: its parts that hold no
        tokens and are not packed (pixels, an `(x, y)`); `rows`: `split.rows(batch)` taken
        as the loader gave it, where the loop's code may take from it since (start()'s
        step_fn: `batch.pop("x")`)."""
        self.rows += (split.rows(batch) if rows is None else rows) or 0
        self.beside += split.beside(batch, bare)

    @property
    def samples(self) -> int | None:
        """The step's samples (None where no micro-batch holds a batched tensor); a packed
        step's are its documents and `beside` instead (`packed_figures`)."""
        return self.rows or None
