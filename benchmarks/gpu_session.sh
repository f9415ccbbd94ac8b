#!/usr/bin/env bash
# One device call's worth of issue 44's checks on a GPU machine (the device tool's `run`,
# timeout_s 590): the GPU tests on CUDA, then gpu_check's own-loop workloads with
# profiler traces, then the Trainer and torch.compile workloads. Each part has its own
# time limit, so a slow one leaves the others their time; everything lands in $OUT
# (at most 8 files: the traces go as one archive).
#   bash benchmarks/gpu_session.sh            # OUT defaults to ./gpu_out
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
  git log --oneline -1 2>/dev/null
} 2>&1 | tee "$OUT/machine.txt"
# the step path on CUDA: norms, clip, skip, scaler, pinned copy, no sync (any thread)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.log"
timeout 300 python3 benchmarks/gpu_check.py --only gpt2,nanogpt,tiny,foreach,clip \
  --trace "$OUT/traces" 2>&1 | tee "$OUT/gpu_check_own.log"
timeout 120 python3 benchmarks/gpu_check.py --only trainer,compiled \
  2>&1 | tee "$OUT/gpu_check_frameworks.log"
if [ -d "$OUT/traces" ]; then  # the ops tables always; the Chrome traces if under 16 MB
  (cd "$OUT" && tar -czf traces_txt.tgz traces/*.txt; tar -czf traces.tgz traces/*.json)
  rm -rf "$OUT/traces"
  if [ "$(stat -c %s "$OUT/traces.tgz")" -gt 16000000 ]; then
    rm "$OUT/traces.tgz"; echo "Chrome traces over 16 MB: not kept" | tee -a "$OUT/machine.txt"
  fi
fi
