#!/usr/bin/env bash
# DeepSeek-V3 throughput (issue 22): bench_train_step --model dsv3 against its
# transformers peer (bench/peers/torch_train_step.py --model dsv3, eager
# attention: the same 141M-parameter model with Multi-Latent Attention and
# DeepSeekMoE, the same batch 4 x 256, 2 threads) in float32 and bfloat16;
# then the trainer itself on the same model with MindFormers' recipe 4.2
# (configs/seeds/mindformers_muon_deepseek_v3.yaml: Muon + AdamW, QK-clip,
# bf16 with FP32 main params, byte corpus) on one rank, for the optimizer's
# share of its step, with Newton-Schulz in float32 (the recipe's) and in
# bfloat16, and with AdamW alone for the optimizer's cost without Muon.
# MODEL dsv3-dense: every layer's MLP dense (MLA alone).
# Needs torch + transformers for the peer.
# usage: bench/run_dsv3.sh [STEPS] [dsv3|dsv3-dense]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-5}
name=${2:-dsv3}
batch=4
bin=build/release
[ -x "$bin/bench_train_step" ] || { echo "build first: make build" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) $(nproc) cores;" \
     "load $(cut -d' ' -f1-3 /proc/loadavg); --model $name, batch $batch x 256"
for dtype in float32 bfloat16; do
  ours=$(OMP_NUM_THREADS=2 "$bin/bench_train_step" --model "$name" --dtype "$dtype" --batch $batch --steps "$steps")
  peer=$(python3 bench/peers/torch_train_step.py --model "$name" --attn eager --dtype "$dtype" --batch $batch \
         --threads 2 --steps "$steps" | tail -1)
  python3 - "$ours" "$peer" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
# deepseek_v3's correction biases: params of hypertrain's store that nothing trains, transformers' buffers
assert a["trained_params"] == b["params"], f"hypertrain trains {a['trained_params']} params, transformers {b['params']}"
print(f"{a['dtype']}: hypertrain {a['tokens_per_s']:.0f} tok/s (MFU {a['mfu']:.2f}, peak RSS {a['peak_rss_mib']:.0f} MiB, "
      f"formula {a['formula_mib']:.0f}; forward {a['forward_ms']:.0f} ms, backward {a['backward_ms']:.0f}, AdamW "
      f"{a['update_ms']:.0f}), transformers {b['tokens_per_s']:.0f} tok/s (peak RSS {b['peak_rss_mib']:.0f} MiB): "
      f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x; {b['params']} trained params both, {a['params']} with the biases")
PY
done
dense=1; [ "$name" = dsv3-dense ] && dense=8
model="--set model.vocab_size=8192 --set model.hidden_size=512 --set model.intermediate_size=1408
  --set model.num_hidden_layers=8 --set model.num_attention_heads=8 --set model.num_key_value_heads=8
  --set model.q_lora_rank=192 --set model.kv_lora_rank=128 --set model.qk_nope_head_dim=64
  --set model.qk_rope_head_dim=32 --set model.v_head_dim=64 --set model.rope_interleave=true
  --set model.rope_scaling.type=default --set model.n_routed_experts=32 --set model.num_experts_per_tok=4
  --set model.moe_intermediate_size=352 --set model.n_shared_experts=1 --set model.n_group=4
  --set model.topk_group=2 --set model.routed_scaling_factor=2.5 --set model.norm_topk_prob=true
  --set model.first_k_dense_replace=$dense --set data.seq_len=256 --set model_init_dtype=bfloat16
  --set training.steps=$((steps + 2)) --set training.log_interval=$((steps + 2)) --set training.eval_interval=0
  --set checkpoint.save_interval=0 --set training.local_batch_size=$batch --set training.global_batch_size=$batch"
out=$(mktemp -d)
for run in "Muon float32" "Muon bfloat16" "AdamW float32"; do
  set -- $run
  log=$(OMP_NUM_THREADS=2 "$bin/hypertrain" train configs/seeds/mindformers_muon_deepseek_v3.yaml $model \
        --set optimizer.type=$1 --set optimizer.muon_config.muon_ns_dtype=$2 --set checkpoint.output_dir="$out/$1$2" 2>&1)
  python3 - "$log" "$1" "$2" <<'PY'
import re, sys
log, opt_type, ns = sys.argv[1:]
if "time a step" not in log:
    sys.exit("the trainer did not finish:\n" + log[-3000:])
speed = re.findall(r"(\d+) tok/s \| MFU +([0-9.]+)%", log)[-1]
fb, opt = (float(x) for x in re.search(r"forward \+ backward ([0-9.]+) s.*optimizer ([0-9.]+) s", log).groups())
what = f"Muon + AdamW, Newton-Schulz in {ns}" if opt_type == "Muon" else "AdamW alone"
print(f"trainer, MindFormers recipe 4.2, {what}, 1 rank: {speed[0]} tok/s, MFU {speed[1]}%; "
      f"forward + backward {fb:.3f} s, optimizer {opt:.3f} s: {100 * opt / (fb + opt):.0f}% of the step")
PY
done
rm -rf "$out"
