#!/usr/bin/env bash
# Preemption under mpirun: how large a model's stop checkpoint fits a grace
# period. For each depth, a Qwen2-style model of hidden 1024, intermediate
# 2816 (bf16, FP32 main params, Muon + AdamW, default.yaml's corpus) trains on
# 2 ranks under `hypertrain launch --grace GRACE`; right after step 1 the
# launcher gets SIGTERM (what a scheduler sends). Prints the time from the
# signal to the exit (the step in progress finished, then the save), the exit
# status (75: the stop checkpoint completed; otherwise the grace period ended
# first) and the save's own time and size.
# usage: bench/run_stop_grace.sh [GRACE_SECONDS] [LAYERS ...]   (default: 30, 8 12 14)
set -euo pipefail
cd "$(dirname "$0")/.."
grace=${1:-30}
shift || true
layers=("$@")
[ ${#layers[@]} -gt 0 ] || layers=(8 12 14)
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, 2 ranks, grace $grace s"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for L in "${layers[@]}"; do
  d=$scratch/L$L
  mkdir -p "$d"
  "$bin" launch --grace "$grace" -- mpirun --oversubscribe --allow-run-as-root --mca btl self,tcp -np 2 \
    "$bin" train configs/default.yaml --set model.hidden_size=1024 --set model.intermediate_size=2816 \
    --set model.num_hidden_layers="$L" --set model.num_attention_heads=16 --set model.num_key_value_heads=4 \
    --set data.seq_len=64 --set training.local_batch_size=1 --set training.global_batch_size=2 \
    --set training.steps=1000 --set training.log_interval=1 --set training.eval_interval=0 \
    --set checkpoint.output_dir="$d/out" --set checkpoint.save_interval=100000 > "$d/log" 2>&1 &
  pid=$!
  for _ in $(seq 60000); do grep -q "step     1/" "$d/log" && break; sleep 0.1; done
  t0=$(date +%s.%N)
  kill -TERM "$pid"
  rc=0
  wait "$pid" || rc=$?
  t1=$(date +%s.%N)
  params=$(sed -nE 's/.*Model: ([0-9.]+M) parameters.*/\1/p' "$d/log" | head -1)
  step=$(sed -nE 's/.*step     1\/1000 .* \| ([0-9hms]+) elapsed.*/\1/p' "$d/log" | head -1)
  saved=$(sed -nE 's/.*saved checkpoint .* in ([0-9.]+ s).*/\1/p' "$d/log" | head -1)
  size=$(du -sh "$d"/out/step_* 2> /dev/null | head -1 | cut -f1)
  printf '%2d layers, %s params (step 1: %s): exit %d after %.1f s; save %s, %s\n' "$L" "$params" "$step" "$rc" \
    "$(echo "$t1 - $t0" | bc)" "${saved:-not completed}" "${size:-}"
done
