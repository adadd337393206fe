#!/usr/bin/env bash
# Qwen2-MoE throughput (issue 12): bench_train_step --model moe against its
# transformers peer (bench/peers/torch_train_step.py --model moe: the same
# 92M-parameter model, same batch 8 x 256, same threads) in float32 and
# bfloat16; then the trainer itself on the same model (byte corpus, Muon +
# AdamW, bf16 with FP32 main params) on 1 rank, on 2 ranks with FSDP alone and
# on 2 ranks with expert_parallel_size 2, with the all-to-all's share of the
# step. Needs torch + transformers for the peer and mpirun for the ranks.
# usage: bench/run_moe.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-5}
bin=build/release
[ -x "$bin/bench_train_step" ] || { echo "build first: make build" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) $(nproc) cores"
for dtype in float32 bfloat16; do
  ours=$(OMP_NUM_THREADS=2 "$bin/bench_train_step" --model moe --dtype "$dtype" --steps "$steps")
  peer=$(python3 bench/peers/torch_train_step.py --model moe --dtype "$dtype" --threads 2 --steps "$steps" | tail -1)
  python3 - "$ours" "$peer" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"{a['dtype']}: hypertrain {a['tokens_per_s']:.0f} tok/s (MFU {a['mfu']:.2f}, peak RSS {a['peak_rss_mib']:.0f} MiB, "
      f"formula {a['formula_mib']:.0f}), transformers {b['tokens_per_s']:.0f} tok/s (peak RSS {b['peak_rss_mib']:.0f} MiB): "
      f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x")
PY
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model="--set model.vocab_size=8192 --set model.hidden_size=512 --set model.intermediate_size=1408
  --set model.num_hidden_layers=8 --set model.num_attention_heads=8 --set model.num_key_value_heads=2
  --set model.moe_intermediate_size=704 --set model.shared_expert_intermediate_size=704
  --set model.mlp_only_layers=[] --set model.output_router_logits=false
  --set training.steps=$((steps + 2)) --set training.log_interval=$((steps + 2)) --set training.eval_interval=0
  --set checkpoint.save_interval=0 --set training.local_batch_size=8 --set training.global_batch_size=16"
out=$(mktemp -d)
for run in "1 1" "2 1" "2 2"; do
  set -- $run
  launch=""; [ "$1" -gt 1 ] && launch="mpirun --oversubscribe -np $1"
  log=$($launch "$bin/hypertrain" train configs/qwen2_moe_tiny.yaml $model --set parallel.expert_parallel_size=$2 \
        --set checkpoint.output_dir="$out/r$1_ep$2" 2>&1)
  echo "trainer, $1 rank(s), expert_parallel_size $2: $(grep -o '[0-9]* tok/s | MFU [0-9.]*%' <<<"$log" | tail -1);" \
       "$(grep -o 'forward + backward.*optimizer [0-9.]* s' <<<"$log")"
done
rm -rf "$out"
