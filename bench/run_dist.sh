#!/usr/bin/env bash
# Data parallel on one machine, the 31M benchmark model (bench_models.h) in
# bf16 with FP32 main params and Muon + AdamW, trained on the fortunes corpus:
# one rank x THREADS threads against RANKS ranks x 1 thread (sharded, Muon
# allgather and deredundancy, and replicated), then 4 ranks oversubscribed;
# beside them PyTorch FSDP2 (fully_shard, gloo) on the same model, ranks,
# threads and batch (bench/peers/torch_fsdp2_step.py; skipped without torch).
# Prints per run: tokens/s (the log's moving average at the last step), the
# time a step spends in forward + backward and in the optimizer, the FSDP
# collectives a step and the share of them compute hid, and every rank's
# peak RSS against the plan the run logs (src/train/run.c, log_memory).
# usage: bench/run_dist.sh [STEPS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
threads=${2:-2}
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/run.yaml" <<YAML
model: {name: qwen2, vocab_size: 8192, hidden_size: 512, intermediate_size: 1408, num_hidden_layers: 8,
        num_attention_heads: 8, num_key_value_heads: 2, max_position_embeddings: 256, attention_bias: true}
model_init_dtype: bfloat16
data: {path: /usr/share/games/fortunes, seq_len: 256, valid_fraction: 0.02}
training: {steps: $steps, local_batch_size: 2, global_batch_size: 8, eval_interval: 0, eval_batches: 0,
           log_interval: 1}
fsdp_config: {mix_precision: {param_dtype: bfloat16, output_dtype: float32}}
checkpoint: {save_interval: 0}
YAML
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; 31M model, bf16, global batch 8 x 256"
run() { # label ranks threads extra...
  local label=$1 ranks=$2 th=$3
  shift 3
  local launcher=()
  [ "$ranks" -gt 0 ] && launcher=(mpirun --oversubscribe --allow-run-as-root --mca btl self,vader -np "$ranks")
  OMP_NUM_THREADS=$th "${launcher[@]}" "$bin" train "$work/run.yaml" \
    --set checkpoint.output_dir="$work/$label" "$@" > "$work/$label.log" 2>&1 ||
    { tail -20 "$work/$label.log"; exit 1; }
  local log=$work/$label.log tps times fsdp mem
  tps=$(grep -oE '[0-9]+ tok/s' "$log" | tail -1)
  times=$(sed -n 's/.*time a step (over [0-9]* steps): forward + backward \([0-9.]*\) s, gradient sync \([0-9.]*\) s, optimizer \([0-9.]*\) s.*/fwd+bwd \1 s, sync \2 s, optimizer \3 s/p' "$log")
  fsdp=$(sed -n 's/.*collectives in flight \([0-9.]*\) s, compute waited \([0-9.]*\) s of it (\([0-9]*%\) hidden); at most \([0-9.]*\) MiB.*/collectives \1 s a step, \3 hidden, units \4 MiB/p' "$log")
  mem=$(sed -n 's/.*memory rank \([0-9]*\): peak RSS \([0-9.]*\) MiB .* planned before allocating \([0-9.]*\) MiB (\([-+0-9.%]*\)).*/\2 (plan \3, \4)/p' "$log" | paste -sd, -)
  printf '%-22s %2s x %s: %10s | %s | %s | peak RSS MiB (plan, error): %s\n' "$label" "${ranks/#0/1}" "$th" "$tps" \
    "$times" "${fsdp:-no FSDP collectives}" "$mem"
}
run one_rank 0 "$threads"
run sharded_allgather 2 1
run sharded_deredundancy 2 1 --set optimizer.muon_config.muon_comm_strategy=allgather_deredundency
run sharded_no_prefetch 2 1 --set optimizer.muon_config.muon_comm_strategy=allgather_deredundency \
  --set fsdp_config.prefetch=false
run replicated 2 1 --set fsdp_config.shard_size=1
run sharded_4_allgather 4 1
run sharded_4_deredundancy 4 1 --set optimizer.muon_config.muon_comm_strategy=allgather_deredundency
run hsdp_2x2_allgather 4 1 --set fsdp_config.shard_size=2
run hsdp_2x2_deredundancy 4 1 --set fsdp_config.shard_size=2 \
  --set optimizer.muon_config.muon_comm_strategy=allgather_deredundency

# The peer: PyTorch FSDP2 on the same model, batch and threads (random tokens).
if python3 -c 'import torch, transformers' 2> /dev/null; then
  for cfg in "1 $threads" "2 1"; do
    set -- $cfg
    # (gloo sometimes aborts in its teardown, after the line is printed: the line is what counts)
    OMP_NUM_THREADS=$2 timeout 1800 torchrun --standalone --nproc_per_node="$1" bench/peers/torch_fsdp2_step.py \
      --steps "$steps" --threads "$2" > "$work/torch.out" 2> "$work/torch.err" || true
    grep '^torch_fsdp2' "$work/torch.out" || tail -5 "$work/torch.err"
  done
else
  echo "torch_fsdp2: skipped (no torch)"
fi
