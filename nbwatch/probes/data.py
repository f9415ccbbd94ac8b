"""Data-side figures: padding ratio, sequence lengths, real tokens."""

from __future__ import annotations

import torch


def mask_stats(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Figures of a [batch, T] (or [T]) 0/1 mask, as 0-dim tensors on the mask's device.

    No host sync here: the runner copies every step's figures in one go.
    """
    m = mask.detach()
    if m.dim() == 1:
        m = m.unsqueeze(0)
    m = m.reshape(m.shape[0], -1).float()
    lengths = m.sum(dim=1)
    tokens = lengths.sum()
    return {
        "lengths": lengths,
        "tokens": tokens,
        "data/padding_ratio": 1.0 - tokens / max(m.numel(), 1),
        "data/seq_len_mean": lengths.mean(),
        "data/seq_len_max": lengths.max(),
    }


def batch_figures(masks: list[torch.Tensor]
                  ) -> tuple[list[str], list[torch.Tensor], float, torch.Tensor]:
    """Figures of one optimizer step's masks (one per micro-batch): names, 0-dim device
    tensors (real tokens, mean and max sequence length), the padded token count and the
    sequence lengths (for the length histogram). No host sync."""
    figs = [mask_stats(m) for m in masks]
    names = ["tokens/real", "data/seq_len_mean", "data/seq_len_max"]
    if len(figs) == 1:
        f = figs[0]
        return names, [f["tokens"], f["data/seq_len_mean"], f["data/seq_len_max"]], \
            float(masks[0].numel()), f["lengths"]
    tokens = torch.stack([f["tokens"] for f in figs]).sum()
    mean = torch.stack([f["data/seq_len_mean"] for f in figs]).mean()
    mx = torch.stack([f["data/seq_len_max"] for f in figs]).max()
    parts = [tokens, mean, mx]
    lengths = torch.cat([f["lengths"] for f in figs])
    return names, parts, float(sum(m.numel() for m in masks)), lengths
