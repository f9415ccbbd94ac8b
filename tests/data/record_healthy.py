"""Record the 'healthy run' fixture that the alert tests replay.

    OMP_NUM_THREADS=1 taskset -c 0 nbwatch demo --steps 5000 --eval-every 250 \
        --run-dir /tmp/healthy
    python tests/data/record_healthy.py /tmp/healthy tests/data/healthy_demo.npz
    PYTHONPATH=. python tests/data/record_alert_reference.py tests/data/alert_reference.json

Pinned to one core, one thread, so that other work on the machine cannot make its
throughput drop (`throughput_drop` rightly fires on a run that did). Keeps what the rules
read: per-step scalars (no system figures; the training batch's `train_logits/log_z` and
`max_abs` among them), the weight std of each layer at each histogram step, and the
attention maps (uint8) of every fourth eval. The alert reference replays this fixture:
record it again after.
"""

import sys

import numpy as np

import nbwatch
from nbwatch.alerts import weight_std


def main(run_dir: str, out: str) -> None:
    run = nbwatch.open_run(run_dir)
    df = run.df
    # the spike score is the engine's own figure: the replay derives it again
    cols = [c for c in df.columns if not c.startswith(("system/", "update_ratio/", "spike/"))]
    names = [n for n in run.reader.histogram_names() if n.startswith("weight/")]
    hist_steps = run.histograms(names[0])[0]
    stds = np.zeros((len(hist_steps), len(names)), dtype=np.float32)
    for j, n in enumerate(names):
        steps, edges, counts = run.histograms(n)
        stds[:, j] = [weight_std(e, c) for e, c in zip(edges, counts)]
    att_steps = run.reader.attention_steps()[::4]
    modules = sorted(run.attention(att_steps[0]))
    att = np.stack([[np.round(run.attention(s)[m] * 255).astype(np.uint8) for m in modules]
                    for s in att_steps])
    np.savez_compressed(
        out, steps=df.index.to_numpy(), columns=np.array(cols),
        scalars=df[cols].to_numpy(dtype=np.float32), hist_steps=hist_steps,
        hist_layers=np.array([n.removeprefix("weight/") for n in names]), weight_std=stds,
        attention_steps=np.array(att_steps), attention_modules=np.array(modules),
        attention=att,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
