#!/usr/bin/env bash
# FP32 main params as copies or as residual16 (optimizer.main_param_storage,
# issue 41 goal 4) on Qwen2.5-0.5B's shapes from a Hugging Face folder (random
# bf16 weights, made once by bench/peers/torch_first_step.py --make): batch
# 4 x 512, bf16, Muon + AdamW, STEPS steps, 2 threads, one run after the other,
# both on the bf16 GEMM kernel KERNEL (default widened: no FP32 copy of the
# weights; the kernel chosen by timing may differ from run to run and with it
# the compute copies, which would hide the difference measured here).
# Prints, for each storage, the peak RSS of the whole process (GNU time), the
# main params' bytes the optimizer logged and the seconds of the last step.
# usage: KERNEL=widened bench/run_main_storage.sh [STEPS] [DIR]   (default: 2, build/bench/qwen2.5-0.5b-random)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-2}
dir=${2:-$PWD/build/bench/qwen2.5-0.5b-random}
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
[ -x /usr/bin/time ] || { echo "needs GNU time (apt-get install time)" >&2; exit 1; }
[ -f "$dir/model.safetensors" ] || { mkdir -p "$dir"; python3 bench/peers/torch_first_step.py --make "$dir"; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, load $(cut -d' ' -f1-3 /proc/loadavg)"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for storage in fp32 residual16; do
  /usr/bin/time -f "%M" -o "$scratch/rss" env OMP_NUM_THREADS=2 "$bin" train configs/default.yaml \
    --set model.from_pretrained="$dir" --set model_init_dtype=bfloat16 \
    --set fsdp_config.mix_precision.param_dtype=bfloat16 --set data.seq_len=512 \
    --set training.local_batch_size=4 --set training.global_batch_size=4 --set training.steps="$steps" \
    --set training.log_interval=1 --set training.eval_interval=0 --set training.eval_batches=0 \
    --set checkpoint.save_interval=0 --set checkpoint.save_optimizer=false --set kernels.bf16_gemm="${KERNEL:-widened}" \
    --set optimizer.main_param_storage=$storage --set checkpoint.output_dir="$scratch/$storage" \
    > "$scratch/log" 2>&1 || { tail -5 "$scratch/log"; exit 1; }
  main=$(sed -nE 's/.*FP32 main params: on.*\(([0-9.]+) MiB\).*/\1/p' "$scratch/log")
  tps=$(tail -1 "$scratch/$storage/metrics.jsonl" | sed -nE 's/.*"tokens_per_s": ([0-9.]+).*/\1/p')
  printf '{"storage": "%s", "peak_rss_mib": %.0f, "main_params_mib": %s, "last_step_tokens_per_s": %s}\n' \
    "$storage" "$(echo "$(cat "$scratch/rss") / 1024" | bc -l)" "${main:-null}" "${tps:-null}"
done
