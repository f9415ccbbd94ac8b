"""Norms as every probe takes them: in float32 whatever the tensors' dtype, and ratios
that are NaN, not huge, where a denominator is zero. No sync."""

from __future__ import annotations

import torch

_TO_FP32 = (torch.float32, torch.float16, torch.bfloat16)  # widened to float32 by the norm


def norms_fp32(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`torch._foreach_norm` in float32, whatever the tensors' dtype: an fp16 gradient
    still scaled by a GradScaler would overflow to inf in its own dtype (and a good step
    read as non-finite), a bf16 one keeps 3 digits."""
    try:
        return tuple(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    except TypeError:  # a torch before the dtype argument
        return tuple(n.float() for n in torch._foreach_norm(tensors))
    except NotImplementedError:  # a sparse gradient (nn.Embedding(sparse=True)): the
        if not any(t.is_sparse for t in tensors):  # norm of its coalesced values; asked
            raise  # only then, so that a dense step pays nothing for it
        return norms_fp32([t.coalesce()._values() if t.is_sparse else t for t in tensors])
    except RuntimeError:  # float64 or complex, which a float32 norm refuses to narrow:
        if all(t.dtype in _TO_FP32 for t in tensors):  # asked only then, as above
            raise
        return _norms_mixed(tensors)


def _norms_mixed(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The float32 norms of tensors some of which are float64 or complex: those in their
    own precision (a complex one's norm is real), then made float32."""
    wide = [i for i, t in enumerate(tensors) if t.dtype not in _TO_FP32]
    narrow = [i for i, t in enumerate(tensors) if t.dtype in _TO_FP32]
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for i, n in zip(wide, torch._foreach_norm([tensors[i] for i in wide])):
        out[i] = n.float()
    if narrow:
        for i, n in zip(narrow, norms_fp32([tensors[i] for i in narrow])):
            out[i] = n
    return tuple(out)


def ratio(delta_sq: torch.Tensor, weight_sq: torch.Tensor) -> torch.Tensor:
    """√delta_sq / √weight_sq, NaN where the weights' norm is 0 (no sync)."""
    den = weight_sq.sqrt()
    return delta_sq.sqrt() / torch.where(den > 0, den, torch.nan)
