#!/usr/bin/env bash
# The AdamW-step benchmark side by side: hypertrain's fused AdamW + cast back
# (build/.../bench_adamw) and PyTorch's torch.optim.AdamW on FP32 masters + the
# copy back into bf16 (bench/peers/torch_adamw_step.py, its fastest CPU
# implementation), same sizes (48 x 1024x1024), same run, same thread count.
# usage: bench/run_adamw.sh [STEPS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-5}
threads=${2:-2}
bin=${BENCH_ADAMW:-build/release/bench_adamw}
[ -x "$bin" ] || { echo "build first (make build), or set BENCH_ADAMW=path/to/bench_adamw" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nproc) cores, $threads threads, $steps timed steps after 2 warmup; load: $(cut -d' ' -f1-3 /proc/loadavg)"
ours=$(OMP_NUM_THREADS=$threads "$bin" --steps "$steps")
peer=$(python3 bench/peers/torch_adamw_step.py --threads "$threads" --steps "$steps")
echo "$ours"
echo "$peer"
python3 - "$ours" "$(echo "$peer" | tail -1)" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"hypertrain {a['ns_per_param']:.3f} ns/param ({a['gb_per_s']:.1f} GB/s), pytorch ({b['impl']}) "
      f"{b['ns_per_param']:.3f} ns/param, ratio {b['ns_per_param'] / a['ns_per_param']:.2f}x (median); "
      f"best-of: {a['best_ns_per_param']:.3f} vs {b['best_ns_per_param']:.3f}, "
      f"{b['best_ns_per_param'] / a['best_ns_per_param']:.2f}x")
PY
