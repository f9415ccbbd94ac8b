"""The demo: a small decoder-only Transformer learning characters of Python's own source.

Text comes from the standard library's `.py` files (present on every machine); a sample
is a run of consecutive lines, so lengths vary and batches are padded to their longest
line, which gives the data-side figures something to show. Used by `nbwatch demo`, the
quickstart notebook, the tests and the benchmarks.
"""

from __future__ import annotations

import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .probes.loss import masked_cross_entropy

PAD = 0
VOCAB = 128  # ASCII; anything else becomes '?'


# -- model --------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fused: no weights kept
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 128, layers: int = 4, heads: int = 4,
                 ctx: int = 128):
        super().__init__()
        self.ctx = ctx
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)

    @torch.no_grad()
    def generate(self, prompt: str, n: int = 60, temperature: float = 0.8, seed: int = 0) -> str:
        """Sampled with a temperature (greedy decoding of a small model repeats one character:
        `def ______`); seeded, so that samples at successive evals compare."""
        idx = torch.tensor([encode(prompt)], device=self.head.weight.device)
        g = torch.Generator(device=idx.device).manual_seed(seed)
        for _ in range(n):
            logits = self(idx[:, -self.ctx:])[:, -1].float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=g)
            idx = torch.cat([idx, nxt], dim=1)
        return decode(idx[0].tolist())


# -- data ---------------------------------------------------------------------------------
def encode(text: str) -> list[int]:
    return [b if 0 < b < VOCAB else ord("?") for b in text.encode("ascii", "replace")]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) if i != PAD else "" for i in ids)


def stdlib_text(max_files: int = 60) -> list[str]:
    """Lines of the standard library's top-level modules, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:max_files]
    if not files:
        raise FileNotFoundError(f"no Python sources under {root} to train the demo on")
    lines: list[str] = []
    for f in files:
        lines += [ln for ln in f.read_text(encoding="utf-8", errors="replace").splitlines()
                  if ln.strip()]
    return lines


def make_samples(lines: list[str], ctx: int, seed: int = 0, max_lines: int = 6) -> list[list[int]]:
    """Runs of 1..max_lines consecutive lines, each at most ctx + 1 characters."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(lines):
        take = rng.randint(1, max_lines)
        text = "\n".join(lines[i : i + take]) + "\n"
        ids = encode(text)[: ctx + 1]
        if len(ids) >= 8:
            out.append(ids)
        i += take
    return out


def collate(samples: list[list[int]]) -> dict[str, torch.Tensor]:
    """Pad to the longest sample: input ids, next-char labels and the mask of real labels."""
    T = max(len(s) for s in samples) - 1
    ids = torch.full((len(samples), T + 1), PAD, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.tensor(s)
    x, y = ids[:, :-1], ids[:, 1:]
    return {"input_ids": x, "labels": y, "mask": (y != PAD).long()}


class Batches:
    """Shuffled batches of samples, reshuffled each epoch (a DataLoader in miniature)."""

    def __init__(self, samples: list[list[int]], batch_size: int, shuffle: bool = True,
                 seed: int = 0):
        self.samples, self.batch_size, self.shuffle = samples, batch_size, shuffle
        self.rng = random.Random(seed)

    def __iter__(self):
        order = list(range(len(self.samples)))
        if self.shuffle:
            self.rng.shuffle(order)
        for i in range(0, len(order) - self.batch_size + 1, self.batch_size):
            yield collate([self.samples[j] for j in order[i : i + self.batch_size]])

    def __len__(self) -> int:
        return len(self.samples) // self.batch_size


# -- the pieces a Monitor needs -----------------------------------------------------------
def step_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Logits, labels and mask: nbwatch takes the loss as the mean over real tokens."""
    return {"logits": model(batch["input_ids"]), "labels": batch["labels"], "mask": batch["mask"]}


@dataclass
class Demo:
    model: TinyGPT
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train: Batches
    val: list[dict[str, torch.Tensor]]
    probe_batch: dict[str, torch.Tensor]
    probe_tokens: list[list[str]]
    config: dict[str, Any]

    step_fn = staticmethod(step_fn)

    def val_fn(self, model: nn.Module) -> float:
        total = count = 0.0
        for b in self.val:
            logits = model(b["input_ids"])
            n = float(b["mask"].sum())
            total += float(masked_cross_entropy(logits, b["labels"], b["mask"])) * n
            count += n
        return total / max(count, 1.0)

    def sample_fn(self, model: TinyGPT) -> str:
        return model.generate("def ", 60)

    def start_kwargs(self) -> dict[str, Any]:
        """Everything `Monitor.start` needs but `max_steps`."""
        return dict(step_fn=self.step_fn, train_data=self.train, val_fn=self.val_fn,
                    sample_fn=self.sample_fn, probe_batch=self.probe_batch,
                    probe_tokens=self.probe_tokens)


def make_demo(
    d: int = 128, layers: int = 4, heads: int = 4, ctx: int = 128, batch_size: int = 16,
    lr: float = 3e-3, max_steps: int = 600, warmup: int = 50, seed: int = 0, val_batches: int = 4,
) -> Demo:
    """Model, optimizer, cosine-with-warmup schedule and data of the demo run."""
    torch.manual_seed(seed)
    lines = stdlib_text()
    split = int(len(lines) * 0.9)
    train = make_samples(lines[:split], ctx, seed)
    val_samples = make_samples(lines[split:], ctx, seed + 1)
    val = [collate(val_samples[i : i + batch_size])
           for i in range(0, min(len(val_samples), val_batches * batch_size), batch_size)]
    model = TinyGPT(VOCAB, d, layers, heads, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(max_steps - warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    probe = collate(val_samples[:2])
    tokens = [[decode([t]) or "·" for t in row] for row in probe["input_ids"].tolist()]
    config = dict(model="TinyGPT", d=d, layers=layers, heads=heads, ctx=ctx,
                  batch_size=batch_size, lr=lr, warmup=warmup, schedule="linear warmup + cosine",
                  optimizer="AdamW", weight_decay=0.1, data="stdlib *.py lines",
                  train_samples=len(train), seed=seed)
    return Demo(model, opt, sched, Batches(train, batch_size, seed=seed), val, probe, tokens,
                config)
