"""Each rank its own kind of batch, under torchrun (used by tests/test_distributed.py).

    torchrun --nproc_per_node=2 tests/scripts/data_ranks.py RUN_DIR CASE

CASE: counts (DDP, a loop of one's own, `log(loss, batch=...)`: rank 0 packed rows, rank 1
padded ones); zeros (DDP, `start()`: a step_fn's float 0/1 mask, rank 1's zeros alone at
its third step, rank 0's at its fourth); bad (DDP, a loop of one's own, `log(mask=...)`:
rank 1's mask holds 0.5 at its third step); probe (FSDP2, a loop of one's own with
`val=`: a model without attention); kernel (FSDP2, a tiny Llama on an attention kernel
that returns no weights).
"""

import os
import sys

import torch
import torch.distributed as dist

import nbwatch
from nbwatch.demo import TinyGPT
from tests.scripts.group import leave_group

STEPS = 4


def packed(lengths: list[int]) -> dict[str, torch.Tensor]:
    ids = torch.arange(sum(lengths))[None] % 50 + 1
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def padded(lengths: list[int], T: int = 12) -> dict[str, torch.Tensor]:
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = (torch.arange(T)[None] % 50 + 1) * mask
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}


# each step's documents (rank 0, packed) and rows (rank 1, padded)
PACKED = [[7, 3, 12], [5, 9], [11, 4, 8, 1], [6, 6]]
PADDED = [[12, 5], [3, 8, 10], [4], [12, 12, 1]]


class MlpLM(torch.nn.Module):
    """An LM without attention: an embedding, an MLP block, a head."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(
            torch.nn.Linear(d, d), torch.nn.GELU()) for _ in range(2)])
        self.lm_head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = x + b(x)
        return self.lm_head(x)


class HandAttention(torch.nn.Module):
    """Attention computed by hand (no SDPA, no weights returned): the probe sees none."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return (q @ k.transpose(-1, -2) / 8).softmax(-1) @ v


def opaque(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kw):
    """An attention kernel that returns no weights (as flash attention's)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        m = attention_mask[..., :k.shape[-2]]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    return (s.softmax(-1) @ v).transpose(1, 2).contiguous(), None


def main() -> None:
    run_dir, case = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    try:
        if case in ("counts", "zeros", "bad"):
            ddp(run_dir, case, rank)
        else:
            fsdp(run_dir, case, rank)
    finally:
        leave_group()


def ddp(run_dir: str, case: str, rank: int) -> None:
    model = torch.nn.parallel.DistributedDataParallel(
        TinyGPT(vocab=64, d=16, layers=1, heads=2, ctx=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=run_dir, rank_every=2, dist_timeout=30,
                          display=False, hist_every=10**6)
    if case == "zeros":
        def step_fn(net, batch):
            i = batch["i"]
            ids = torch.arange(12)[None].repeat(2, 1) % 50 + 1
            mask = torch.ones(2, 11)
            mask[1, 6:] = 0.0
            if (rank, i) in ((1, 2), (0, 3)):
                mask = torch.zeros(2, 11)  # an additive mask of a batch with no padding
            return {"logits": net(ids[:, :-1]), "labels": ids[:, 1:], "mask": mask}

        mon.start(step_fn, [{"i": i} for i in range(STEPS)], max_steps=STEPS, rank_every=2,
                  dist_timeout=30, display=False)
        mon.wait()
        return
    with mon:
        for i in range(STEPS):
            batch = (packed(PACKED[i]) if rank == 0 else padded(PADDED[i]))
            ids = batch["input_ids"]
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                     ids[:, 1:].flatten())
            loss.backward()
            if case == "bad":  # and a second backward pass: one forward's loss is logged
                model(ids).sum().mul(0.0).backward()
            opt.step()
            opt.zero_grad()
            if case == "bad":
                mask = torch.ones(2, 6)
                if rank == 1 and i == 2:
                    mask[0, 0] = 0.5
                mon.log(loss=loss, mask=mask)
            else:
                mon.log(loss=loss, batch=batch)


def fsdp(run_dir: str, case: str, rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    if case == "kernel":
        import transformers as tf

        tf.AttentionInterface.register("opaque", opaque)
        cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=64,
                             attn_implementation="opaque")
        model = tf.LlamaForCausalLM(cfg)
        blocks = list(model.model.layers)
    else:
        model = MlpLM()
        if case == "unseen":  # blocks of attention the probe cannot see
            model.blocks = torch.nn.ModuleList([HandAttention() for _ in range(2)])
        blocks = list(model.blocks)
    for b in blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    val = {"input_ids": torch.arange(10)[None].repeat(2, 1) + 1}
    mon = nbwatch.Monitor(model, opt, run_dir=run_dir, rank_every=2, dist_timeout=30,
                          display=False, probe_batch=val, hist_every=10**6)
    with mon:
        for i in range(STEPS):
            ids = torch.arange(12)[None].repeat(2, 1) % 50 + 1 + rank
            out = model(input_ids=ids) if case == "kernel" else model(ids)
            logits = out.logits if hasattr(out, "logits") else out
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                     ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss, val=float(loss.detach()) if i % 2 else None)
    if case == "kernel":
        assert model.config._attn_implementation == "opaque", model.config._attn_implementation


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
