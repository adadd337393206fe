#!/usr/bin/env bash
# The whole-step figures of bench/RESULTS.md's "Issue 11" section in one run:
# hypertrain's bench_train_step and its PyTorch peer side by side, on the 31M
# model (batch 8 x 256, f32 and bf16; batch 1 at seq 2048 and 8192; recompute)
# and Qwen2.5-0.5B's architecture (batch 4 x 512, bf16 and f32). About 15
# minutes on 2 cores; run it on a quiet machine. Needs torch + transformers.
# usage: bench/run_issue11.sh [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
B=build/release/bench_train_step
[ -x "$B" ] || { echo "build first: make build" >&2; exit 1; }
P="python3 bench/peers/torch_train_step.py --threads $threads"
export OMP_NUM_THREADS=$threads
echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $threads threads"
echo "## 31M, batch 8 x 256"
for dt in float32 bfloat16; do $B --dtype $dt --steps 3; $P --dtype $dt --steps 3 --warmup 1; done
echo "## 31M long sequences, batch 1"
for T in 2048 8192; do
  $B --dtype float32 --steps 1 --batch 1 --seq $T
  $P --dtype float32 --steps 1 --warmup 1 --batch 1 --seq $T
done
$B --dtype float32 --steps 1 --batch 1 --seq 2048 --recompute
echo "## Qwen2.5-0.5B, batch 4 x 512"
for dt in bfloat16 float32; do
  $B --model qwen2.5-0.5b --dtype $dt --steps 1 --batch 4 --seq 512
  $P --model qwen2.5-0.5b --dtype $dt --steps 1 --warmup 1 --batch 4 --seq 512
done
