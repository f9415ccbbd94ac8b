"""Attention: for each probe sample of the newest eval, a layers × heads overview of one
number per head (its entropy, its largest weight). One head's map travels only when the
page opens it (`head_map`, the widget's "attention" message); a page with no kernel (the
HTML export) gets every map of the newest eval with the overview (`maps=True`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..lifecycle import is_ended


def build(att: Mapping[str, Any] | None,
          latest: Mapping[str, tuple[int, float]] | None = None,
          maps: bool = False, events: list[Mapping[str, Any]] | None = None
          ) -> dict[str, Any]:
    """`att`: {step, samples: [{tokens, maps: {module: [heads, T, S]}}]} → the overview:
    {step, modules, heads, samples: [{tokens, shapes, entropy, peak}], logit?}.
    `latest` {key: (step, value)}: each head's largest logit at that probe, for the
    overview. `maps=True` adds each sample's maps as one uint8 [L, H, T, S] block (×255:
    attention rows sum to 1, so 1/255 resolution is what a colour scale shows).
    `events`: the run's events, among which a probe event saying the probe is off, or
    that the model has no attention (a Mamba's, whose probe goes on for its health),
    gives the panel its `note`, shown where no map comes."""
    if not att or not att["samples"]:
        note = next((str(e["message"]) for e in events or () if e.get("kind") == "probe"
                     and (e.get("data") or {}).get("missing") in (None, "attention")), None)
        return {"note": note} if note else {}
    samples = []
    # one module list for every sample (a sample may lack a module another has)
    modules = module_list(att)
    heads = 1
    for s in att["samples"]:
        got = s["maps"]
        if not got:
            continue
        arrays = [np.asarray(got[m], dtype=np.float32) if m in got
                  else np.zeros((0, 0, 0), dtype=np.float32) for m in modules]
        # modules differ in shape (encoder-decoder: self T×T, cross T×S; GQA: heads):
        # pad into one [L, H, T, S] block, each module's own shape alongside
        h = max(max(a.shape[0] for a in arrays), 1)
        t = max(max(a.shape[1] for a in arrays), 1)
        k = max(max(a.shape[2] for a in arrays), 1)
        stack = np.zeros((len(arrays), h, t, k), dtype=np.float32)
        for i, a in enumerate(arrays):
            stack[i, : a.shape[0], : a.shape[1], : a.shape[2]] = a
        ent, peak = head_summary(stack)
        tokens = list(s["tokens"]) if s.get("tokens") else None
        one: dict[str, Any] = {"tokens": tokens, "shapes": [list(a.shape) for a in arrays],
                               "entropy": ent, "peak": peak}
        if maps:
            one["maps"] = np.clip(np.rint(stack * 255), 0, 255).astype(np.uint8)
        samples.append(one)
        heads = max(heads, h)
    if not samples:
        return {}
    out: dict[str, Any] = {"step": int(att["step"]), "modules": modules, "heads": heads,
                           "samples": samples}
    for one in samples:  # every sample padded to the same heads (the view indexes [l, h])
        one["entropy"], one["peak"] = (_pad_heads(one["entropy"], heads),
                                       _pad_heads(one["peak"], heads))
        if maps and one["maps"].shape[1] < heads:
            one["maps"] = np.pad(one["maps"],
                                 ((0, 0), (0, heads - one["maps"].shape[1]), (0, 0), (0, 0)))
    logit = np.full((len(modules), heads), np.nan, dtype=np.float32)
    for i, m in enumerate(modules):
        for h in range(heads):
            got = (latest or {}).get(f"attn/max_logit/{m}/{h}")
            if got is not None and got[0] == out["step"]:
                logit[i, h] = got[1]
    if np.isfinite(logit).any():
        out["logit"] = logit
    return out


def waiting(meta: Mapping[str, Any], step: int) -> str:
    """What the panel says while it holds no map: when the first comes, where the run's
    options tell (`meta["run"]`: start()'s eval_every, a loop's probe_every, at the first of
    their steps from `step` on), that the probe is off, or that the run ended without one."""
    run = meta.get("run") or {}
    opts = run.get("options") or {}
    if opts.get("attention_samples") == 0:
        return "no attention maps: the probe is off (attention_samples=0)"
    if is_ended(str(meta.get("state"))):
        return "no attention maps: the run ended before an eval took them"
    def at(every: Any) -> int | None:
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            return None
        return max(1, -(-int(step) // every)) * every  # the eval under way at its step too
    if (n := at(run.get("eval_every"))) is not None:
        last = opts.get("max_steps")  # start()'s last step: a val_fn evaluates there too
        if isinstance(last, int) and 0 < last < n:
            if run.get("val_fn"):
                n = last
            else:
                return (f"no attention maps: eval_every={run['eval_every']} is past the "
                        f"run's last step, {last}, and no val_fn evaluates at its end")
        return f"no attention maps yet: they come with the first eval, at step {n}"
    if (n := at(opts.get("probe_every"))) is not None:
        return f"no attention maps yet: they come with the first eval, or the probe at step {n}"
    return "no attention maps yet: they come with the first eval"


def module_list(att: Mapping[str, Any]) -> list[str]:
    """The overview's rows: every sample's modules, in the order the probe wrote them."""
    return list(dict.fromkeys(m for s in att["samples"] for m in s["maps"]))


def head_map(maps: Mapping[str, Any], module: str, head: int) -> np.ndarray | None:
    """One head's [T, S] weights from a sample's {module: [heads, T, S]} (float32), or None
    where the sample has no such module or head."""
    a = maps.get(module)
    if a is None or not 0 <= head < np.shape(a)[0]:
        return None
    return np.asarray(a[head], dtype=np.float32)


def _pad_heads(a: np.ndarray, heads: int) -> np.ndarray:
    """[L, h] → [L, heads], NaN where a sample's modules have fewer heads."""
    if a.shape[1] >= heads:
        return a
    return np.pad(a, ((0, 0), (0, heads - a.shape[1])), constant_values=np.nan)


def head_summary(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[L, H, T, S] maps → (entropy, peak), each [L, H]: the mean over attending query rows
    (rows summing to ~1; padded and fully masked rows sum to 0) of the row's entropy in nats,
    and of its largest weight. NaN for a head with no such row (a padded slot)."""
    rows = stack.sum(-1) > 0.5  # [L, H, T]
    p = np.clip(stack, 1e-12, None)
    ent_rows = -(stack * np.log(p)).sum(-1)
    peak_rows = stack.max(-1)
    n = rows.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ent = np.where(n > 0, (ent_rows * rows).sum(-1) / n, np.nan)
        peak = np.where(n > 0, (peak_rows * rows).sum(-1) / n, np.nan)
    return ent.astype(np.float32), peak.astype(np.float32)
