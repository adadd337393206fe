#!/usr/bin/env bash
# Time to the first step from a Hugging Face folder (issue 41, goal 5):
# Qwen2.5-0.5B's architecture with random bf16 weights (made once by
# bench/peers/torch_first_step.py --make), batch 4 x 512 on the default
# corpus, bf16 with FP32 main params (AdamW), 2 threads. hypertrain: from
# `hypertrain train` to its "step 1" line; PyTorch + transformers: from the
# interpreter's start to the end of its first step (import, from_pretrained,
# one AdamW step). Taken in turns, ROUNDS times each.
# usage: bench/run_first_step.sh [ROUNDS] [DIR]   (default: 2, build/bench/qwen2.5-0.5b-random)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
dir=${2:-$PWD/build/bench/qwen2.5-0.5b-random}
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
[ -f "$dir/model.safetensors" ] || { mkdir -p "$dir"; python3 bench/peers/torch_first_step.py --make "$dir"; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for r in $(seq "$rounds"); do
  t0=$(date +%s.%N)
  OMP_NUM_THREADS=2 "$bin" train configs/default.yaml --set model.from_pretrained="$dir" \
    --set model_init_dtype=bfloat16 --set fsdp_config.mix_precision.param_dtype=bfloat16 \
    --set optimizer._target_=AdamW --set data.seq_len=512 --set training.local_batch_size=4 \
    --set training.global_batch_size=4 --set training.steps=2 --set training.log_interval=1 \
    --set training.eval_interval=0 --set training.eval_batches=0 --set checkpoint.save_interval=0 \
    --set checkpoint.output_dir="$scratch/out$r" \
    > "$scratch/log$r" 2>&1 &
  pid=$!
  for _ in $(seq 60000); do grep -q "step     1/" "$scratch/log$r" && break; sleep 0.05; done
  t1=$(date +%s.%N)
  kill -TERM "$pid" 2> /dev/null || true
  wait "$pid" || true
  load=$(sed -nE 's/.*loaded weights from .*/x/p' "$scratch/log$r" | head -1)
  printf '{"engine": "hypertrain", "seconds_to_first_step": %.2f, "weights_loaded": "%s"}\n' \
    "$(echo "$t1 - $t0" | bc)" "${load:+yes}"
  OMP_NUM_THREADS=2 python3 bench/peers/torch_first_step.py "$dir" --threads 2
done
