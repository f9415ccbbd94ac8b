"""The loss a step returns, and the masked token mean the seeds ask for."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX, additive_01, attention_tokens, is_encoder_decoder, reads_tokens


def masked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy averaged over real tokens only.

    `logits` is [..., V], `labels` and `mask` are [...] (mask: 1 for a real token, 0 for
    padding; a float additive one, 0.0 for a real token and a negative for padding, is
    read as one where some entry is negative and none positive: zeros alone are a 0/1
    mask with nothing to train on). Padding neither adds to the
    numerator nor to the denominator, so a batch of short lines and a batch of long ones
    weigh each token equally. A label of -100 (Hugging Face's padded label,
    `cross_entropy`'s `ignore_index`) is padding too.

    >>> loss = masked_cross_entropy(logits, targets, attention_mask)
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: "
            "logits must be labels' shape plus a vocabulary dimension"
        )
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none"
    )
    # an ignored label's loss is 0: left in the count, it would dilute the mean
    m = (labels.reshape(-1) != IGNORE_INDEX).to(per_token.dtype)
    if mask is not None:
        if mask.shape != labels.shape:
            raise ValueError(
                f"mask {tuple(mask.shape)} does not match labels {tuple(labels.shape)}: "
                "pass one 0/1 entry per label"
            )
        m = m * additive_01(mask, zeros_real=False).reshape(-1).to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp_min(1.0)


@dataclass
class StepOutput:
    """What a `step_fn` returned, checked: a scalar loss and, optionally, a token mask."""

    loss: torch.Tensor
    mask: torch.Tensor | None = None
    reduction: str = "as returned by step_fn"


def batch_mask(batch: object, out: object) -> torch.Tensor | None:
    """The tokens of a `{'logits', 'labels'}` step that returns no mask: the batch's
    `attention_mask`, its `[:, 1:]` where the labels are shifted by one (None without one).
    Not the labels' -100s: a masked LM's unmasked tokens, a fine-tuning prompt's, are
    real tokens that take no loss."""
    if not (isinstance(out, dict) and "loss" not in out and out.get("mask") is None
            and isinstance(batch, Mapping)):
        return None
    am, labels = batch.get("attention_mask"), out.get("labels")
    if not (isinstance(am, torch.Tensor) and isinstance(labels, torch.Tensor)
            and am.dim() == labels.dim() == 2 and am.shape[0] == labels.shape[0]):
        return None
    if am.shape[1] == labels.shape[1]:
        return attention_tokens(am)
    return attention_tokens(am[:, 1:]) if am.shape[1] == labels.shape[1] + 1 else None


def input_mask(batch: object) -> torch.Tensor | None:
    """The batch's own `attention_mask` (2-d): the tokens the forward read, which the data
    figures count (tokens/s, padding, lengths). Not a step's loss mask, which may leave out
    real tokens (a fine-tuning prompt's, a masked LM's unmasked ones, the first of each
    shifted row). None for a batch whose input is not tokens (`reads_tokens`: a speech
    model's frames mask)."""
    am = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not reads_tokens(batch):
        return None
    return attention_tokens(am) if isinstance(am, torch.Tensor) and am.dim() == 2 else None


def check_not_copying(batch: object, out: object, model: object = None) -> None:
    """Refuse `{'logits', 'labels'}` whose labels are the batch's own inputs: nbwatch's loss
    compares logits[:, t] with labels[:, t], so unshifted labels (what a Hugging Face causal
    LM takes, shifting inside) would train the model to copy its input. Not for an
    encoder-decoder (`is_encoder_decoder`: a T5, a BART, a module that holds one): its
    decoder reads the labels shifted right, so labels equal to the source are a copy
    task, rightly aligned."""
    if not (isinstance(out, dict) and "loss" not in out and "logits" in out and "labels" in out
            and isinstance(batch, Mapping)):
        return
    if is_encoder_decoder(model):
        return
    labels, inputs = out["labels"], batch.get("input_ids")
    if (isinstance(labels, torch.Tensor) and isinstance(inputs, torch.Tensor)
            and labels.shape == inputs.shape
            # the inputs themselves, or HF's labels: the inputs with -100 on padding
            and bool(((labels == inputs) | (labels == IGNORE_INDEX)).all())
            and bool((labels != IGNORE_INDEX).any())):
        raise ValueError(
            "step_fn's labels equal the batch's input_ids, so the loss would teach the model "
            "to copy its input: with {'logits', 'labels'}, labels[:, t] must be the token "
            "that follows position t. Shift them: {'logits': logits[:, :-1], 'labels': "
            "input_ids[:, 1:], 'mask': mask[:, 1:]}, or return {'loss': out.loss} from a "
            "Hugging Face model given labels=input_ids (it shifts inside)")


def parse_step_output(out: object) -> StepOutput:
    """Check what `step_fn(model, batch)` returned; raise an error that names the fix."""
    hint = (
        "step_fn(model, batch) must return the loss tensor, or a dict with 'loss' and "
        "optionally 'mask' (1 for real tokens), or 'logits' + 'labels' (+ 'mask')"
    )
    if out is None:
        raise TypeError(f"step_fn returned None; did you forget `return loss`? {hint}")
    mask = None
    reduction = "as returned by step_fn"
    if isinstance(out, dict):
        mask = out.get("mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise TypeError(f"step_fn's 'mask' is a {type(mask).__name__}, not a tensor; {hint}")
        if mask is not None:  # an additive one (0.0 real, negative padding) as 0/1
            mask = additive_01(mask, zeros_real=False)  # it weighs the loss
        if "loss" in out:
            loss = out["loss"]
        elif "logits" in out and "labels" in out:
            loss = masked_cross_entropy(out["logits"], out["labels"], mask)
            reduction = "masked token mean (nbwatch.masked_cross_entropy)"
        else:
            raise KeyError(f"step_fn returned a dict with keys {sorted(out)}; {hint}")
        if mask is not None and "labels" in out and mask.shape != out["labels"].shape:
            raise ValueError(
                f"step_fn's mask {tuple(mask.shape)} does not match its labels "
                f"{tuple(out['labels'].shape)}: pass one 0/1 entry per label"
            )
    else:
        loss = out
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"step_fn's loss is a {type(loss).__name__}, not a tensor; {hint}")
    if loss.is_complex():
        raise TypeError(f"step_fn's loss is a complex tensor ({loss.dtype}); return a real "
                        "loss (e.g. its .real or .abs())")
    if loss.numel() != 1:
        raise ValueError(
            f"step_fn's loss has shape {tuple(loss.shape)}, not a scalar: reduce it "
            "(e.g. nbwatch.masked_cross_entropy or .mean()) before returning it"
        )
    if not loss.requires_grad:
        raise ValueError(
            "step_fn's loss does not require grad: it was computed under torch.no_grad() "
            "or from detached tensors, so backward() has nothing to do"
        )
    return StepOutput(loss if loss.dim() == 0 else loss.reshape(()), mask, reduction)
