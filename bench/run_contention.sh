#!/usr/bin/env bash
# Contention: the AdamW step and the bf16 train step (31M model) on all cores,
# then with one core held by another process (a busy loop pinned to the last
# core), hypertrain and PyTorch side by side in the same run, same threads.
# Prints each one's slowdown and hypertrain's against PyTorch's (goal <= 1.2).
# hypertrain runs as it starts by itself (idle OpenMP threads spin briefly,
# src/base/openmp.c) and, for comparison, with libgomp's default spin.
# usage: bench/run_contention.sh [STEPS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-3}
threads=${2:-$(nproc)}
for b in build/release/bench_adamw build/release/bench_train_step; do
  [ -x "$b" ] || { echo "build first: make build" >&2; exit 1; }
done
python3 -c 'import torch, transformers' 2> /dev/null || { echo "needs torch + transformers" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $threads threads, $steps steps"
busy_pid=
start_busy() { taskset -c "$(($(nproc) - 1))" sh -c 'while :; do :; done' & busy_pid=$!; sleep 0.5; }
stop_busy() { kill "$busy_pid"; wait "$busy_pid" 2> /dev/null || true; }
field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }
measure() { # label -> prints "ours ours_default_spin peer" (ns/param for adamw, tok/s for the step)
  case $1 in
    adamw)
      a=$(OMP_NUM_THREADS=$threads build/release/bench_adamw --steps "$steps")
      b=$(GOMP_SPINCOUNT=300000 OMP_NUM_THREADS=$threads build/release/bench_adamw --steps "$steps")
      c=$(python3 bench/peers/torch_adamw_step.py --threads "$threads" --steps "$steps" | tail -1)
      echo "$(field "$a" ns_per_param) $(field "$b" ns_per_param) $(field "$c" ns_per_param)" ;;
    step)
      a=$(OMP_NUM_THREADS=$threads build/release/bench_train_step --dtype bfloat16 --steps "$steps")
      b=$(GOMP_SPINCOUNT=300000 OMP_NUM_THREADS=$threads build/release/bench_train_step --dtype bfloat16 --steps "$steps")
      c=$(python3 bench/peers/torch_train_step.py --dtype bfloat16 --threads "$threads" --steps "$steps")
      echo "$(field "$a" tokens_per_s) $(field "$b" tokens_per_s) $(field "$c" tokens_per_s)" ;;
  esac
}
for what in adamw step; do
  read -r q1 d1 p1 <<< "$(measure $what)"
  start_busy
  read -r q2 d2 p2 <<< "$(measure $what)"
  stop_busy
  python3 - "$what" "$q1" "$d1" "$p1" "$q2" "$d2" "$p2" <<'PY'
import sys
what, q1, d1, p1, q2, d2, p2 = sys.argv[1], *map(float, sys.argv[2:])
# slowdown: time ratio (ns/param grows; tok/s shrinks)
slow = (lambda a, b: b / a) if what == "adamw" else (lambda a, b: a / b)
unit = "ns/param" if what == "adamw" else "tok/s"
sq, sd, sp = slow(q1, q2), slow(d1, d2), slow(p1, p2)
print(f"{what}: hypertrain {q1:.3f} -> {q2:.3f} {unit} ({sq:.2f}x slower), with libgomp's default spin "
      f"{d1:.3f} -> {d2:.3f} ({sd:.2f}x), pytorch {p1:.3f} -> {p2:.3f} ({sp:.2f}x); "
      f"hypertrain's slowdown / pytorch's: {sq / sp:.2f} (default spin: {sd / sp:.2f})")
PY
done
