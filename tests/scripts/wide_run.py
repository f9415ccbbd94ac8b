"""A run of a 12-layer, 12-head GPT-2 (built from a config, no download) trained by a real
`transformers.Trainer` under `nbwatch.hf`, with a gradient spike injected into one layer at
one step: the dashboard-at-scale fixture of the browser tests, the README's screenshots and
benchmarks/dashboard.py.

    python tests/scripts/wide_run.py RUN_DIR [STEPS] [LAYERS] [HEADS]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

SPIKE_LAYER = 7  # transformer.h.7.mlp.c_fc's grads ×1000 at SPIKE_STEP
SPIKE_STEP = 30


class Padded(torch.utils.data.Dataset):
    """Token sequences of random length (`shortest` to `T`), right-padded to `T`, labels
    −100 on the pads (also tests/test_hf.py's data)."""

    def __init__(self, n: int, seed: int, vocab: int = 128, T: int = 32, shortest: int = 8):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(shortest, T + 1, (1,), generator=g))
            mask = (torch.arange(T) < length).long()
            ids = torch.randint(1, vocab, (T,), generator=g) * mask
            self.items.append({"input_ids": ids, "attention_mask": mask,
                               "labels": ids.masked_fill(mask == 0, -100)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def spike_layer_name(layers: int = 12) -> str:
    return f"transformer.h.{min(SPIKE_LAYER, layers - 1)}.mlp.c_fc"


def make_trainer(out: str | Path, steps: int = 60, layers: int = 12, heads: int = 12,
                 delay: float = 0.0, eval_steps: int | None = None):
    """The Trainer (its model's spike hook installed); `delay` seconds of data loading per
    batch make a run last while a browser watches it."""
    import transformers as tf

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = tf.GPT2Config(n_layer=layers, n_head=heads, n_embd=8 * heads, vocab_size=128,
                        n_positions=64, bos_token_id=0, eos_token_id=0,
                        attn_implementation="eager")
    model = tf.GPT2LMHeadModel(cfg)
    spiked = model.get_submodule(spike_layer_name(layers)).weight
    seen = [0]

    def spike(g: torch.Tensor) -> torch.Tensor:
        seen[0] += 1  # one backward per optimizer step here
        return g * 1000 if seen[0] == SPIKE_STEP else g

    spiked.register_hook(spike)
    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, logging_steps=1, report_to=[], save_strategy="no",
        eval_strategy="steps", eval_steps=eval_steps or max(steps // 3, 1), learning_rate=1e-3,
        warmup_steps=5, max_grad_norm=0.0, use_cpu=True, disable_tqdm=True, seed=0,
        log_level="error")
    collate = None
    if delay:
        def collate(items: list[dict]) -> dict:
            time.sleep(delay)
            return {k: torch.stack([it[k] for it in items]) for k in items[0]}
    return tf.Trainer(model=model, args=args, train_dataset=Padded(256, 0),
                      eval_dataset=Padded(8, 1), data_collator=collate)


def write(run_dir: Path, steps: int = 60, layers: int = 12, heads: int = 12) -> Path:
    """A finished run in `run_dir`."""
    import nbwatch.hf

    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(out, steps, layers, heads)
        nbwatch.hf.start(trainer, run_dir=run_dir, display=False).wait()
    return Path(run_dir)


if __name__ == "__main__":
    a = sys.argv[1:]
    write(Path(a[0]), *(int(x) for x in a[1:4]))
