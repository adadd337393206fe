#!/usr/bin/env bash
# Time to the first step from a Hugging Face folder (issue 41, goal 5):
# Qwen2.5-0.5B's architecture with random bf16 weights (made once by
# bench/peers/torch_first_step.py --make), batch 4 x 512 on the default
# corpus, bf16 with FP32 main params (AdamW), 2 threads. hypertrain: from
# `hypertrain train` to its "step 1" line; PyTorch + transformers: from the
# interpreter's start to the end of its first step (import, from_pretrained,
# one AdamW step). Taken in turns, ROUNDS times each. BEFORE=another
# hypertrain binary (an earlier build) takes its turn too, for a before and
# after in one run. Each line names the bf16 GEMM kernel the run chose by
# timing (it decides whether an FP32 copy of the weights is made).
# usage: [BEFORE=bin] bench/run_first_step.sh [ROUNDS] [DIR]   (default: 2, build/bench/qwen2.5-0.5b-random)
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
  for b in ${BEFORE:+"$BEFORE"} "$bin"; do
    log="$scratch/log$r.$(basename "$(dirname "$b")")"
    t0=$(date +%s.%N)
    OMP_NUM_THREADS=2 "$b" train configs/default.yaml --set model.from_pretrained="$dir" \
      --set model_init_dtype=bfloat16 --set fsdp_config.mix_precision.param_dtype=bfloat16 \
      --set optimizer._target_=AdamW --set data.seq_len=512 --set training.local_batch_size=4 \
      --set training.global_batch_size=4 --set training.steps=2 --set training.log_interval=1 \
      --set training.eval_interval=0 --set training.eval_batches=0 --set checkpoint.save_interval=0 \
      --set checkpoint.output_dir="$scratch/out$r" \
      > "$log" 2>&1 &
    pid=$!
    for _ in $(seq 60000); do grep -q "step     1/" "$log" && break; kill -0 "$pid" 2> /dev/null || break; sleep 0.05; done
    t1=$(date +%s.%N)
    kill -KILL "$pid" 2> /dev/null || true
    wait "$pid" 2> /dev/null || true
    rm -rf "$scratch/out$r"
    load=$(sed -nE 's/.*loaded weights from .*/x/p' "$log" | head -1)
    gemm=$(sed -nE 's/.*GEMM kernels: bf16 ([a-z0-9_]+).*/\1/p' "$log" | head -1)
    step=$(grep -c "step     1/" "$log" || true)
    printf '{"engine": "hypertrain%s", "seconds_to_first_step": %.2f, "weights_loaded": "%s", "bf16_gemm": "%s", "reached_step": %s}\n' \
      "$([ "$b" = "$bin" ] || echo " (before: $b)")" "$(echo "$t1 - $t0" | bc)" "${load:+yes}" "$gemm" "$step"
  done
  OMP_NUM_THREADS=2 python3 bench/peers/torch_first_step.py "$dir" --threads 2
done
echo "# load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
