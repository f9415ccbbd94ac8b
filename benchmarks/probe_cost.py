"""What the eval-time probe pass costs, against the bare forward it wraps.

    python benchmarks/probe_cost.py

For the demo's TinyGPT (SDPA) and a 12-layer, 12-head GPT-2 (eager and SDPA attention), on
a probe batch of 2 sequences: the bare forward (no_grad, eval mode), and the probe pass as
`evaluate()` runs it: attention maps, per-head entropy and max logit, block RMS, output
logits, turned into the recorded figures. Median of 20 runs after 3 warm-ups, same process.
A training step never runs any of it.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nbwatch.alerts import health  # noqa: E402
from nbwatch.demo import TinyGPT  # noqa: E402
from nbwatch.evaluation import _eager_weights_returned  # noqa: E402
from nbwatch.probes.activations import capture_block_rms, logit_figures, output_logits  # noqa: E402
from nbwatch.probes.attention import capture_attention  # noqa: E402


def timed(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def probe(model, forward):
    with capture_attention(model, 2, 64) as maps, torch.no_grad(), \
            _eager_weights_returned(model), capture_block_rms(model, 2) as rms:
        out = forward()
    logits = output_logits(out)
    return health.figures(maps.entropy, maps.max_logit, rms,
                          logit_figures(logits) if logits is not None else {})


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cases = []
    tiny = TinyGPT(vocab=96, d=128, layers=4, heads=4, ctx=128).eval()
    idx = torch.randint(1, 96, (2, 128))
    cases.append(("TinyGPT 4×4, SDPA, T=128", tiny, lambda: tiny(idx)))
    try:
        import transformers as tf

        for attn in ("eager", "sdpa"):
            cfg = tf.GPT2Config(n_layer=12, n_head=12, n_embd=384, vocab_size=1000,
                                n_positions=128, bos_token_id=0, eos_token_id=0,
                                attn_implementation=attn)
            m = tf.GPT2LMHeadModel(cfg).eval()
            ids = torch.randint(0, 1000, (2, 128))
            kw = {"output_attentions": True} if attn == "eager" else {}
            cases.append((f"GPT-2 12×12, {attn}, T=128", m,
                          lambda m=m, ids=ids, kw=kw: m(input_ids=ids, **kw)))
    except ImportError:
        print("(transformers not installed: GPT-2 cases skipped)")
    for name, model, fwd in cases:
        def bare(fwd=fwd):
            with torch.no_grad():
                fwd()
        base = timed(bare)
        full = timed(lambda model=model, fwd=fwd: probe(model, fwd))
        n = len(probe(model, fwd))
        print(f"{name:>28}: bare forward {base * 1e3:7.1f} ms | probe pass {full * 1e3:7.1f} ms "
              f"= {full / base:4.2f}× | {n} figures", flush=True)


if __name__ == "__main__":
    main()
