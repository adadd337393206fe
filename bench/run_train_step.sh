#!/usr/bin/env bash
# The train-step benchmark side by side: hypertrain and PyTorch (the peer,
# bench/peers/torch_train_step.py) on the same 31M model, same machine, same
# run, same thread count, for float32 and bfloat16. Prints both JSON lines and
# the ratio. Needs torch + transformers (tools/reference/requirements.txt).
# usage: bench/run_train_step.sh [STEPS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-5}
threads=${2:-2}
bin=build/release/bench_train_step
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nproc) cores, $threads threads, $steps timed steps after 2 warmup"
for dtype in float32 bfloat16; do
  ours=$(OMP_NUM_THREADS=$threads "$bin" --dtype "$dtype" --steps "$steps")
  peer=$(python3 bench/peers/torch_train_step.py --dtype "$dtype" --threads "$threads" --steps "$steps")
  echo "$ours"
  echo "$peer"
  python3 - "$ours" "$peer" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"{a['dtype']}: hypertrain {a['tokens_per_s']:.0f} tok/s, pytorch {b['tokens_per_s']:.0f} tok/s, "
      f"ratio {a['tokens_per_s'] / b['tokens_per_s']:.2f}x")
PY
done
