"""The routed experts of a Mixture-of-Experts model, for the model FLOPs a token costs: a
token goes through top-k of E experts, so each expert's weights count k/E times.

Experts are the parameters under a module named `experts` (Hugging Face's Mixtral,
Qwen-MoE, OLMoE, DeepSeek; a hand-written `nn.ModuleList`) with a router beside it: a
sibling named `gate` or `router` whose weight has one row per expert. A shared expert
beside them counts whole; a module named `experts` without a router (a dense ensemble)
is no MoE. E is that container's length, its `num_experts`, or its fused weights' leading
dimension; k the block holding it says (`top_k`, `num_experts_per_tok`), else the model's
config (`num_experts_per_tok`, its `text_config`'s for a multimodal model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

_K_NAMES = ("top_k", "num_experts_per_tok", "num_experts_per_token", "moe_top_k")
_CONFIG_K = _K_NAMES[1:]  # a config's `top_k` is generation's (sampling), not routing's


@dataclass
class Experts:
    """{id(param): k/E} for every routed expert's parameter whose k is known; `unknown`:
    the paths of expert containers whose k is not (their weights count whole)."""

    share: dict[int, float] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    def active(self, params: list[nn.Parameter]) -> float:
        """How many of `params` one token's matmuls use."""
        return float(sum(p.numel() * self.share.get(id(p), 1.0) for p in params))


def find_experts(model: nn.Module) -> Experts:
    """The routed experts of `model` (none: an empty `Experts`)."""
    out = Experts()
    seen: list[str] = []
    for path, m in model.named_modules():
        if path.rsplit(".", 1)[-1] != "experts" or any(path.startswith(s + ".") for s in seen):
            continue
        params = list(m.parameters())
        n = _count(m, params)
        parent = model.get_submodule(path.rpartition(".")[0])
        if not params or not n or n < 2 or not _routed(parent, n):
            continue
        seen.append(path)
        cfg = getattr(model, "config", None)
        k = (_top_k(_K_NAMES, parent, m) or _top_k(_CONFIG_K, cfg)
             or _top_k(_CONFIG_K, getattr(cfg, "text_config", None)))
        if k is None or not 0 < k <= n:
            out.unknown.append(path)
            continue
        for p in params:
            out.share[id(p)] = k / n
    return out


def _routed(parent: nn.Module, n: int) -> bool:
    """Whether a router beside the experts picks among `n` of them: a child of `parent`
    named `gate` or `router` with a weight of `n` rows (its own, or its classifier's)."""
    return any(("gate" in name or "router" in name)
               and any(w.dim() == 2 and w.shape[0] == n for w in child.parameters())
               for name, child in parent.named_children())


def _count(m: nn.Module, params: list[nn.Parameter]) -> int | None:
    if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
        return len(m)
    n = getattr(m, "num_experts", None)
    if isinstance(n, int):
        return n
    fused = [p.shape[0] for p in params if p.dim() == 3]  # [E, out, in] weights
    return fused[0] if fused and len(set(fused)) == 1 else None


def _top_k(names: tuple[str, ...], *holders: object) -> int | None:
    for h in holders:
        for name in names:
            v = getattr(h, name, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def unknown_note(paths: list[str]) -> str:
    """What a run says once where routed experts' top-k is not known."""
    where = ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "")
    return (f"throughput/tflops and MFU count every routed expert's weights for every token "
            f"({where}: how many experts a token goes through is not known), so they are "
            "upper bounds; set `top_k` on the module holding `experts` (or "
            "`num_experts_per_tok` in the model's config) for the true figure")
