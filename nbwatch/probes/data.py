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
