#!/usr/bin/env bash
# Data parallel on one machine, the 31M benchmark model (bench_models.h) in
# bf16 with FP32 main params and Muon + AdamW, trained on the fortunes corpus:
# one rank x THREADS threads against RANKS ranks x 1 thread (sharded, Muon
# allgather and deredundancy, and replicated), then 4 ranks oversubscribed for
# memory. Prints tokens/s (the log's moving average at the last step), the
# step's Muon + AdamW time, and each rank's peak resident memory (GNU time).
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
  OMP_NUM_THREADS=$th "${launcher[@]}" /usr/bin/time -f 'peak_rss_kb %M' "$bin" train "$work/run.yaml" \
    --set checkpoint.output_dir="$work/$label" "$@" > "$work/$label.log" 2>&1 ||
    { tail -20 "$work/$label.log"; exit 1; }
  local tps rss
  tps=$(grep -oE '[0-9]+ tok/s' "$work/$label.log" | tail -1)
  rss=$(grep -oE 'peak_rss_kb [0-9]+' "$work/$label.log" | awk '{ s = s (NR > 1 ? ", " : "") int($2 / 1024) } END { print s }')
  printf '%-28s %4s rank(s) x %s thread(s): %12s, peak RSS per rank (MiB): %s\n' "$label" "${ranks/#0/1}" "$th" "$tps" "$rss"
}
run one_rank 0 "$threads"
run sharded_allgather 2 1
run sharded_deredundancy 2 1 --set optimizer.muon_config.muon_comm_strategy=allgather_deredundency
run replicated 2 1 --set fsdp_config.shard_size=1
run sharded_4_ranks 4 1
