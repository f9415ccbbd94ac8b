"""Data-side figures: padding ratio, sequence lengths, real tokens."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

# The figure that counts a GPU mask's entries other than 0 and 1, copied with the step's
# other figures (no sync of its own); `bad_mask` reads it on the host.
BAD = "_mask_bad"
# The step's float masks of zeros alone (an additive one of a batch with no padding, read
# as a 0/1 one with nothing to train on), counted on its device; `zeros_mask` says it.
ZEROS = "_mask_zeros"
IGNORE_INDEX = -100  # cross_entropy's default ignore_index: a padded label, no loss
MASK_FIGURES = ("tokens/real", "data/seq_len_mean", "data/seq_len_max", "_padded")
_HOW = ("pass a 0/1 (or bool) attention mask, 1 for a real token and 0 for padding "
        "(e.g. batch['attention_mask'], or input_ids != pad_id)")


def attention_tokens(mask: torch.Tensor) -> torch.Tensor:
    """A batch's own `attention_mask` as the tokens it marks real: `mask != 0` (one op on
    its device, no read), so a packer's segment ids (1, 2, 3 … a document, 0 padding) are
    real tokens, not a mask the run is refused for; a bool mask as it is; a float one
    first through `additive_01` (an additive mask's real tokens are its 0.0s)."""
    if mask.dtype == torch.bool:
        return mask
    return (additive_01(mask) if mask.is_floating_point() else mask) != 0


def additive_01(mask: torch.Tensor, zeros_real: bool = True) -> torch.Tensor:
    """A float mask as a 0/1 one: an additive attention mask (0.0 where a token is attended,
    a negative where it is masked: -inf, torch.finfo(dtype).min, -1e4), told by having no
    positive entry, as 1.0 where it is 0 and 0.0 where negative; any other float mask (a
    0/1 one, one of other values that `check_mask` refuses) as it is; other dtypes as they
    are. On its device, no read (the choice is made there). A float mask of zeros alone
    (`zeros_real`) is an additive one that masks nothing, every token real: a batch's
    attention_mask, which counts tokens. For a mask that weighs the loss (`zeros_real`
    False) it is a 0/1 one with no token to train on (a response truncated away), and an
    additive one must mask something: training on a prompt it was meant to leave out
    would go unseen, an unpadded additive batch's loss of 0 would not."""
    if not mask.is_floating_point() or mask.numel() == 0:
        return mask
    m = mask.detach()
    as_is = m.amax() > 0 if zeros_real else (m.amax() > 0) | (m.amin() >= 0)
    return torch.where(as_is, m, (m == 0).to(m.dtype))


def check_mask(mask: torch.Tensor, who: str,
               why: str = "the padding ratio and tokens/s would be wrong",
               how: str = _HOW) -> None:
    """Refuse a mask that holds other values than 0 and 1 (a bool mask needs no look). On a
    GPU this waits for it (one host sync): the loops call it on the first step only, and
    on CPU masks, where it costs no sync. `why`: what such a mask would spoil; `how`: the
    mask to pass instead."""
    if mask.is_complex():
        raise TypeError(f"{who}: the mask is a complex tensor ({mask.dtype}); {how}")
    if mask.dtype == torch.bool:
        return
    m = mask.detach()
    if m.numel() == 0:
        return
    lo, hi = torch.aminmax(m)  # one pass: an int mask in [0, 1] is 0/1
    ok = lo.item() >= 0 and hi.item() <= 1  # (on a CPU each op costs ~30 µs cold)
    if ok and m.is_floating_point():
        ok = not bool(torch.frac(m).count_nonzero())  # 0.5 (in [0, 1], not 0 or 1)
    if not ok:
        bad = (m != 0) & (m != 1)
        seen = torch.unique(m[bad]).tolist()
        shown = ", ".join(f"{v:g}" for v in seen[:5]) + (" …" if len(seen) > 5 else "")
        also = ("; an additive attention mask (0.0 where a token is attended, a negative "
                "where masked) is read as one where no entry is positive"
                if m.is_floating_point() and bool((m < 0).any()) else "")
        raise ValueError(
            f"{who}: the mask holds {shown} besides 0 and 1, so {why}; {how}{also}")


def mask_stats(mask: torch.Tensor, count_bad: bool = False) -> dict[str, torch.Tensor]:
    """Figures of a [batch, T] (or [T]) 0/1 mask, as 0-dim tensors on the mask's device.

    No host sync here: the runner copies every step's figures in one go. `count_bad`
    (a GPU mask, not bool: see `batch_figures`) adds `BAD`, the count of its entries other
    than 0 and 1.
    """
    m = mask.detach()
    m = m.reshape(1 if m.dim() == 1 else m.shape[0], -1)
    lengths = m.sum(dim=1, dtype=torch.float32)  # no float copy of the mask first
    tokens = lengths.sum()
    out = {
        "lengths": lengths,
        "tokens": tokens,
        "data/seq_len_mean": lengths.mean(),
        "data/seq_len_max": lengths.max(),
    }
    if count_bad:
        f = m.float()
        out[BAD] = (f * (f - 1.0)).count_nonzero().float()  # 0 exactly where m is 0 or 1
    return out


@dataclass
class MaskFigures:
    """What one optimizer step's masks give: `names`/`parts`, 0-dim device tensors to copy
    with the step's other figures (a GPU mask's); `host`, figures already on the host (a
    CPU mask's, computed there without a torch op); the padded token count; the sequence
    lengths (for the length histogram)."""

    names: list[str]
    parts: list[torch.Tensor]
    host: dict[str, float]
    padded: float
    lengths: torch.Tensor

    def into(self, names: list[str], parts: list[torch.Tensor], host: dict[str, float]
             ) -> torch.Tensor:
        """Add these to a step's device figures (`names`, `parts`) and its host figures
        (with `_padded`, the padded token count); returns the sequence lengths."""
        names += self.names
        parts += self.parts
        host.update(self.host)
        host["_padded"] = self.padded
        return self.lengths


def batch_figures(masks: list[torch.Tensor]) -> MaskFigures:
    """Figures of one optimizer step's masks (one per micro-batch): real tokens, mean (over
    all their sequences) and max sequence length, the padded token count and the lengths.
    No host sync: CPU masks are read and checked on the host (`check_mask`'s refusal for
    a bad one), a GPU mask's figures stay on its device, with `BAD` for one not bool."""
    on_host = host_figures(masks)
    if on_host is not None:
        return on_host
    for m in masks:
        if m.device.type == "cpu" or m.is_complex():
            check_mask(m, "the batch's mask")
    dev = next((m.device for m in masks if m.device.type != "cpu"), None)
    # one device for all (host masks go up without a wait), each counted where it came
    figs = [mask_stats(m if dev is None else m.to(dev, non_blocking=True),
                       count_bad=m.device.type != "cpu" and m.dtype != torch.bool)
            for m in masks]
    names = ["tokens/real", "data/seq_len_mean", "data/seq_len_max"]
    bad = [f[BAD] for f in figs if BAD in f]
    padded = float(sum(m.numel() for m in masks))
    if len(figs) == 1:
        f = figs[0]
        parts = [f["tokens"], f["data/seq_len_mean"], f["data/seq_len_max"]]
        if bad:
            names.append(BAD)
            parts.append(bad[0])
        return MaskFigures(names, parts, {}, padded, f["lengths"])
    tokens = torch.stack([f["tokens"] for f in figs]).sum()
    # over every sequence of the step: micro-batches of unequal sizes weigh as many
    mean = tokens / sum(int(f["lengths"].numel()) for f in figs)
    mx = torch.stack([f["data/seq_len_max"] for f in figs]).max()
    parts = [tokens, mean, mx]
    if bad:
        names.append(BAD)
        parts.append(torch.stack([b.to(tokens.device) for b in bad]).sum())
    return MaskFigures(names, parts, {}, padded, torch.cat([f["lengths"] for f in figs]))


def host_figures(masks: list[torch.Tensor]) -> MaskFigures | None:
    """`batch_figures` of CPU masks, read in place with numpy and plain Python. The same
    figures as `mask_stats` (float32 lengths, whose sums of 0/1 are exact; the mean
    length is over every sequence of the step's micro-batches), in fewer calls: just
    after a backward pass each call runs cold (tens of µs on a CPU, whatever it does;
    benchmarks/README.md). None where numpy cannot read a mask (a GPU or bf16
    one), one is empty, or one is not 0/1 (the torch path then refuses it)."""
    arrays = []
    for m in masks:
        if (m.device.type != "cpu" or m.is_complex() or m.dtype == torch.bfloat16
                or m.numel() == 0):
            return None
        try:
            a = (m.detach() if m.requires_grad else m).numpy()
        except (RuntimeError, TypeError):  # sparse, a tensor subclass: torch reads it
            return None
        kind = a.dtype.kind
        if kind == "f":
            with np.errstate(all="ignore"):  # 1e30 overflows: not 0/1 all the same
                ok = not np.count_nonzero(a * (a - 1))  # 0 exactly where a is 0 or 1
        elif kind == "i":  # as unsigned, a negative entry is > 1 too: one reduction
            ok = a.view(a.dtype.str.replace("i", "u")).max() <= 1
        else:
            ok = kind == "b" or a.max() <= 1
        if not ok:
            return None
        arrays.append(a.reshape(1 if a.ndim == 1 else a.shape[0], -1))
    lengths = [a.sum(axis=1, dtype=np.float32) for a in arrays]
    every = lengths[0] if len(lengths) == 1 else np.concatenate(lengths)
    per = [n.tolist() for n in lengths]
    tokens = float(sum(sum(n) for n in per))
    host = {"tokens/real": tokens,
            "data/seq_len_mean": float(np.float32(tokens / sum(len(n) for n in per))),
            "data/seq_len_max": max(max(n) for n in per)}
    return MaskFigures([], [], host, float(sum(m.numel() for m in masks)),
                       torch.from_numpy(every))


def bad_mask(values: dict[str, float]) -> str | None:
    """On the host: if the step's GPU mask held other values than 0 and 1, drop the
    figures drawn from it from `values` and return what to say; None for a good mask."""
    n = values.pop(BAD, 0.0)
    if not n:
        return None
    for k in MASK_FIGURES:
        values.pop(k, None)
    return (f"the step's mask holds {n:.0f} entries other than 0 and 1: its padding ratio, "
            f"sequence lengths and tokens/s are left out of the record; {_HOW}")


def zeros_mask(values: dict[str, float]) -> str | None:
    """On the host: what to say where the step's float mask was zeros alone (`ZEROS`)."""
    if not values.pop(ZEROS, 0.0):
        return None
    return ("step_fn's mask is a float mask of zeros alone, read as a 0/1 mask with no token "
            "to train on: its loss (masked_cross_entropy's) is 0, its tokens none. An "
            "additive mask (0.0 where a token is attended) of a batch with no padding is "
            "zeros alone too: pass it as a bool or 0/1 mask (mask == 0)")


NOTED = (BAD, ZEROS)  # a step's mask counts, each said once a run (`mask_notes`)


def mask_notes(values: dict[str, float], said: set[str], who: str = "") -> list[str]:
    """On the host: what to say of a step's mask counts (`NOTED`, popped from `values`, a
    bad mask's figures dropped with them), each once a run: `said` holds those said
    already. `who` opens each (under torchrun, the rank whose batch it was: rank 0 says
    every rank's, from the counts their rows carry to the ranks' meeting)."""
    out = []
    for key, note in ((BAD, bad_mask(values)), (ZEROS, zeros_mask(values))):
        if note is not None and key not in said:
            said.add(key)
            out.append(who + note)
    return out


def decoder_mask(batch: Any) -> Any:
    """The positions an encoder-decoder model's logits are for, from its batch: its
    `decoder_attention_mask`, else its labels that are not -100 (what the loss counts);
    None where it holds neither. Its `attention_mask` is the encoder's: the source's
    padding, not the target's."""
    if not isinstance(batch, Mapping):
        return None
    m = batch.get("decoder_attention_mask")
    if isinstance(m, torch.Tensor):
        return additive_01(m)
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() == 2 and not labels.is_floating_point():
        return labels != IGNORE_INDEX
    return None


# A model input that is not tokens: speech features (Whisper's log-mel frames), raw audio
# (wav2vec2's samples), images. A batch of one and no input_ids has no tokens to count:
# its attention_mask marks frames or samples (Whisper's feature extractor's, for
# SpecAugment), not tokens.
NOT_TOKENS = ("input_features", "input_values", "pixel_values")


def reads_tokens(batch: Any) -> bool:
    """False for a dict batch whose model input is not tokens (`NOT_TOKENS`) and that
    holds no `input_ids`; True for any other (a vision-language batch's text tokens
    count: it has input_ids). A look at its keys, no op."""
    if not isinstance(batch, Mapping) or isinstance(batch.get("input_ids"), torch.Tensor):
        return True
    return not any(isinstance(batch.get(k), torch.Tensor) for k in NOT_TOKENS)


def input_tokens(batch: Any) -> torch.Tensor | None:
    """The tokens of a batch's input, for the data figures: its `attention_mask`
    (`attention_tokens`), else every token of a 2-D (or one sequence's 1-D) integer
    `input_ids` real (as the Trainer's `num_input_tokens_seen` counts them); None for a
    batch of neither, or one whose input is not tokens (`reads_tokens`: speech features,
    raw audio, pixels, whose attention_mask counts frames or samples): samples/s only. An
    encoder-decoder's are its source's, the encoder's input, in every loop: never its
    target's (`decoder_mask`, what its loss weighs).
    None too for an attention_mask that is not one of its tokens (a model's own 4-D
    [batch, 1, T, T] mask: neither 1- or 2-D nor input_ids' shape; nor is every input_ids
    token real, it masks the padding) and for an empty batch.
    One op on the batch's device at most, no read."""
    if not isinstance(batch, Mapping) or not reads_tokens(batch):
        return None
    mask = batch.get("attention_mask")
    ids = batch.get("input_ids")
    if isinstance(mask, torch.Tensor):
        tokens = mask.dim() in (1, 2) or (isinstance(ids, torch.Tensor)
                                           and mask.shape == ids.shape)
        return attention_tokens(mask) if tokens and mask.numel() else None
    if (isinstance(ids, torch.Tensor) and ids.ndim in (1, 2) and not ids.is_floating_point()
            and ids.numel()):  # ([T]: one sequence, one sample: `batch_samples`)
        return torch.ones_like(ids, dtype=torch.bool)
    return None


def is_encoder_decoder(model: Any) -> bool:
    """A model whose logits are the decoder's (T5, BART, Whisper): its config says so, or
    that of the Hugging Face model it holds (a LightningModule's, under DDP's wrapper), or
    it holds PyTorch's own `nn.Transformer` (an encoder and a decoder)."""
    mods = model.modules() if isinstance(model, torch.nn.Module) else [model]
    return any(isinstance(m, torch.nn.Transformer)
               or getattr(getattr(m, "config", None), "is_encoder_decoder", False) is True
               for m in mods)


# A packed step's documents, copied with its other figures; `packed_figures` reads them.
DOCS = ("_docs", "_doc_len_max")
BESIDE = "_beside"  # a host figure: rows of its batches of no tokens, samples beside them
# Host positions give their documents' lengths one a document (tests turn it off to run
# an accelerator's counts by length on the CPU).
EXACT_ON_CPU = True


def packed_positions(batch: Any) -> torch.Tensor | None:
    """The `position_ids` of a packed batch (Hugging Face's `DataCollatorWithFlattening`:
    sequences laid end to end in a row, each one's positions from 0, no attention_mask),
    else None. A batch of one sequence a row passes too: its documents are its rows."""
    if not isinstance(batch, Mapping) or batch.get("attention_mask") is not None:
        return None
    pos = batch.get("position_ids")
    if (isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.numel()
            and not pos.is_floating_point() and not pos.is_complex()):
        return pos
    return None


class LengthCounts(NamedTuple):
    """Sequence lengths as counts by length (`counts[n]`: how many of n tokens), on their
    device: a packed step's documents, a vector the size of a row, not of the batch."""

    counts: torch.Tensor

    def lengths(self) -> np.ndarray:
        """One length an entry (float32), for the `data/seq_len` histogram: of host
        counts (a CPU step's, or a device's read from the step's copy)."""
        c = self.counts.numpy().astype(np.int64)
        return np.repeat(np.arange(c.size, dtype=np.float32), c)


def documents(positions: list[torch.Tensor], names: list[str], parts: list[torch.Tensor],
              rows: list[torch.Tensor] | None = None) -> torch.Tensor | LengthCounts:
    """A packed step's documents, from its micro-batches' `position_ids`: how many (the
    positions 0) and the longest (the largest position + 1) added to `names`/`parts`, as
    0-dim tensors on their device copied with the step's other figures (no sync); returns
    their lengths, for the `data/seq_len` histogram: from host positions, one a document
    (`doc_lengths`); from a device's, counts by length (`doc_length_counts`). `rows`: the
    masks of the step's micro-batches that are not packed (padded ones, beside the packed
    under accumulation): each row one sample more, of its mask's sum long."""
    # one device for all: a host part goes up without a wait (without non_blocking, a
    # pageable copy to CUDA waits for the stream), a device's never comes down (a sync)
    dev = next((t.device for t in [*positions, *(rows or [])] if t.device.type != "cpu"),
               positions[0].device)
    positions = [p.to(dev, non_blocking=True) for p in positions]
    if len(positions) == 1:
        p = positions[0]
        docs, longest = (p == 0).sum(), p.max()
    else:
        docs = torch.stack([(p == 0).sum() for p in positions]).sum()
        longest = torch.stack([p.max() for p in positions]).max()
    docs, longest = docs.float(), longest.float() + 1
    lens = row_lengths([m.to(dev, non_blocking=True) for m in rows or []])
    if lens:  # shapes tell how many rows; their longest is read with the step's copy
        docs = docs + sum(int(n.numel()) for n in lens)
        longest = torch.stack([longest, *(n.max() for n in lens)]).max()
    names += DOCS
    parts += [docs, longest]
    if EXACT_ON_CPU and all(t.device.type == "cpu" for t in [*positions, *lens]):
        return torch.cat([doc_lengths(positions), *lens]) if lens else doc_lengths(positions)
    return doc_length_counts(positions, lens, max((int(m.shape[-1]) for m in rows or []),
                                                  default=0))


def row_lengths(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's length (its mask's sum, float32) of each [batch, T] (or [T]) mask."""
    return [m.detach().reshape(1 if m.dim() == 1 else m.shape[0], -1)
            .sum(dim=1, dtype=torch.float32) for m in masks]


def doc_lengths(positions: list[torch.Tensor]) -> torch.Tensor:
    """Host positions' documents' lengths, one a document (its last position + 1): what
    the host reads at no cost, fewer ops there than `doc_length_counts`."""
    out = []
    for p in positions:
        end = torch.ones_like(p, dtype=torch.bool)
        end[:, :-1] = p[:, 1:] == 0  # the token before a document's first
        out.append((p[end] + 1).float())
    return torch.cat(out)


def doc_length_counts(positions: list[torch.Tensor], rows: list[torch.Tensor] | None = None,
                      width: int = 0) -> LengthCounts:
    """A packed step's documents' lengths, for the `data/seq_len` histogram, as counts by
    length on the positions' device (a shape the host knows: no sync, and a copy of a
    row's size, not the batch's): a document's length is its last position + 1, its last
    token the one before a position 0 or a row's last. One carried on from a row before
    counts its positions there too; one longer than the step's longest row counts as that
    long (the vector's last entry). `rows`: the lengths (`row_lengths`) of the padded rows
    of the step's micro-batches not packed, `width` their masks' widest, counted beside."""
    size = max(width, *(int(p.shape[-1]) for p in positions)) + 1
    counts = torch.zeros(size, device=positions[0].device)
    for p in positions:
        end = torch.ones(p.shape, dtype=torch.float32, device=p.device)
        end[:, :-1] = p[:, 1:] == 0  # the token before a document's first
        # int64 indices, whatever the positions' integer type (no copy for int64 ones)
        counts.scatter_add_(0, (p.long() + 1).clamp_(0, size - 1).reshape(-1),
                            end.reshape(-1))
    for n in rows or []:  # a row's length is at most its mask's width: within the vector
        n = n.to(counts.device, non_blocking=True)  # no wait (`documents`)
        counts.scatter_add_(0, n.long().clamp_(0, size - 1), torch.ones_like(n))
    return LengthCounts(counts)


def all_real(masks: list[torch.Tensor]) -> MaskFigures:
    """`batch_figures` of masks known to be all ones (packed micro-batches that came
    without one: a packed row has no padding), from their shapes alone: no op on the
    device, nothing to read."""
    rows = [(1 if m.dim() == 1 else int(m.shape[0]), int(m.shape[-1])) for m in masks]
    tokens = float(sum(r * t for r, t in rows))
    n = sum(r for r, _ in rows)
    host = {"tokens/real": tokens, "data/seq_len_mean": tokens / n,
            "data/seq_len_max": float(max(t for _, t in rows))}
    return MaskFigures([], [], host, tokens,
                       torch.cat([torch.full((r,), float(t)) for r, t in rows]))


def packed_figures(values: dict[str, float]) -> float | None:
    """On the host: a packed step's sequence figures are its documents', not its rows'
    (`data/seq_len_mean` the real tokens over the documents, `data/seq_len_max` the
    longest); returns its samples, the documents and the rows of its batches of no tokens
    (`BESIDE`: a loader's `(x, y)` beside them), or None for a step not packed."""
    beside = values.pop(BESIDE, 0.0)
    docs, longest = (values.pop(k, None) for k in DOCS)
    if not docs or longest is None:
        return None
    tokens = values.get("tokens/real")
    if tokens is not None:
        values["data/seq_len_mean"] = tokens / docs
        values["data/seq_len_max"] = longest
    return docs + beside
