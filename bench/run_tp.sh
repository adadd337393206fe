#!/usr/bin/env bash
# Tensor parallelism against data parallelism and one rank (issue 21): the
# trainer on Qwen2.5-0.5B (24 layers, hidden 896, 14 heads, 2 KV heads, head
# dim 64, intermediate 4864, vocabulary 151936, q/k/v biases, tied
# embeddings), float32, AdamW, T tokens a sequence (text_bytes data: the
# token ids are bytes, the vocabulary is the model's), local batch 1, on one
# rank (2 threads) and on 2 ranks (1 thread each) as DP 2 (FSDP over both,
# global batch 2), TP 2 with sequence parallelism and TP 2 without it (global
# batch 1). The corpus: README.md and docs/DESIGN.md repeated.
# Prints per run: tokens/s and the step time (the last step's line: STEPS - 1
# warmup steps before it), forward + backward a step, the peak RSS of the
# largest rank, the activations rank 0 reports (src/train/run.c, log_memory),
# and the collectives a step: tensor parallelism's (none of it overlapped)
# and FSDP's (all-gathers and reduce-scatters, their share hidden behind
# compute: log_fsdp_stats).
# The peer, in the same run where torch is importable: PyTorch's tensor
# parallelism (bench/peers/torch_tp_step.py: transformers' Qwen2 with the same
# shapes and the same plan, torch.distributed.tensor.parallel on gloo, 2 ranks
# of 1 thread) with and without sequence parallelism, and whether torch's
# context_parallel runs on CPU at all (bench/peers/torch_cp_probe.py).
# LOGS=DIR keeps every run's log there.
# usage: [RUNS="one_rank dp2 tp2 tp2_no_sp torch_tp2 torch_tp2_no_sp"] [LOGS=DIR] bench/run_tp.sh [STEPS] [T]
#        (defaults: 3 steps, T 1024)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-3}
T=${2:-1024}
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for _ in $(seq 20); do cat README.md docs/DESIGN.md; done > "$work/corpus.txt"
cat > "$work/run.yaml" <<YAML
model: {name: qwen2, vocab_size: 151936, hidden_size: 896, intermediate_size: 4864, num_hidden_layers: 24,
        num_attention_heads: 14, num_key_value_heads: 2, max_position_embeddings: 32768,
        rope_theta: 1000000.0, rms_norm_eps: 1.0e-6, attention_bias: true, tie_word_embeddings: true}
model_init_dtype: float32
data: {dataset_type: text_bytes, path: $work/corpus.txt, seq_len: $T, valid_fraction: 0.0}
optimizer: {_target_: AdamW}
training: {steps: $steps, local_batch_size: 1, eval_interval: 0, eval_batches: 0, log_interval: 1}
fsdp_config: {mix_precision: {param_dtype: float32, reduce_dtype: float32, output_dtype: float32}}
checkpoint: {save_interval: 0}
YAML
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores," \
     "$(grep -o -w -E 'avx512f|avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | paste -sd' ' -)," \
     "load $(cut -d' ' -f1-3 /proc/loadavg); Qwen2.5-0.5B, float32, T $T, batch 1 a rank, $steps steps"
printf '%-15s %5s %6s %8s %8s %8s %9s %9s %9s %9s %7s\n' run ranks global tok/s step_s fwd+bwd peakRSS acts \
  tp_coll fsdp_coll hidden
run() { # label ranks global extra...
  local label=$1 ranks=$2 global=$3
  shift 3
  [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $label "* ]] && return 0
  local launcher=() threads=2
  [ "$ranks" -gt 1 ] && launcher=(mpirun --oversubscribe --allow-run-as-root --mca btl "self,tcp" -np "$ranks") threads=1
  local log=$work/$label.log
  OMP_NUM_THREADS=$threads timeout 3000 "${launcher[@]}" "$bin" train "$work/run.yaml" \
    --set training.global_batch_size="$global" --set checkpoint.output_dir="$work/out" "$@" > "$log" 2>&1 ||
    { tail -20 "$log"; echo "$label failed"; return 0; }
  rm -rf "$work/out"
  [ -n "${LOGS:-}" ] && mkdir -p "$LOGS" && cp "$log" "$LOGS/"
  python3 - "$log" "$label" "$ranks" "$global" <<'PY'
import re, sys
log, label, ranks, glob = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
text = open(log).read()
tps = re.findall(r"\| +(\d+) tok/s", text)[-1]
fb = re.search(r"forward \+ backward ([0-9.]+) s", text).group(1)
mem = re.findall(r"memory rank (\d+): peak RSS ([0-9.]+) MiB.*activations ([0-9.]+), corpus", text)
peak = max(float(m[1]) for m in mem)
acts = float(mem[0][2])
step_s = glob * int(re.search(r"seq_len: (\d+)", open(log.rsplit("/", 1)[0] + "/run.yaml").read()).group(1)) / float(tps)
tp = re.search(r"tensor parallelism a step: ([0-9.]+) s", text)
fsdp = re.search(r"collectives in flight ([0-9.]+) s, compute waited [0-9.]+ s of it \((\d+)% hidden", text)
fs = fsdp.group(1) if fsdp else "-"
print(f"{label:<15} {ranks:>5} {glob:>6} {tps:>8} {step_s:>8.2f} {float(fb):>8.2f} {peak:>9.0f} {acts:>9.0f} "
      f"{tp.group(1) if tp else '-':>9} {fs:>9} {fsdp.group(2) + '%' if fsdp else '-':>7}")
PY
}
run one_rank 1 1
run dp2 2 2
run tp2 2 1 --set parallel.tensor_parallel_size=2
run tp2_no_sp 2 1 --set parallel.tensor_parallel_size=2 --set parallel.sequence_parallel=false

peer() { # label extra...
  local label=$1
  shift
  [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $label "* ]] && return 0
  python3 -c 'import torch, transformers' 2> /dev/null || { echo "$label: torch or transformers not importable"; return 0; }
  local log=$work/$label.log
  OMP_NUM_THREADS=1 timeout 3000 torchrun --standalone --nproc_per_node=2 bench/peers/torch_tp_step.py --threads 1 \
    --steps $((steps - 1)) --warmup 1 --batch 1 --seq "$T" "$@" > "$log" 2>&1 || true
  [ -n "${LOGS:-}" ] && mkdir -p "$LOGS" && cp "$log" "$LOGS/"
  python3 - "$log" "$label" <<'PY'
import re, sys
log, label = sys.argv[1], sys.argv[2]
text = open(log).read()
line = next((l for l in text.splitlines() if l.startswith("torch_tp ")), None)
if line is None or "FAILED" in line:
    print(f"{label}: {line or 'no result line'}")
    sys.exit(0)
tps = float(re.search(r"tokens_per_s=([0-9.]+)", line).group(1))
step_s = float(re.search(r"step_s=([0-9.]+)", line).group(1))
peak = max(int(x) for x in re.search(r"peak_rss_mib_per_rank=\[([0-9, ]+)\]", line).group(1).split(","))
print(f"{label:<15} {2:>5} {1:>6} {tps:>8.0f} {step_s:>8.2f} {'-':>8} {peak:>9} {'-':>9} {'-':>9} {'-':>9} {'-':>7}")
PY
}
peer torch_tp2 --sp
peer torch_tp2_no_sp
if [ -z "${RUNS:-}" ] && python3 -c 'import torch' 2> /dev/null; then
  timeout 300 torchrun --standalone --nproc_per_node=2 bench/peers/torch_cp_probe.py > "$work/cp_probe.log" 2>&1 || true
  grep '^torch_cp rank 0' "$work/cp_probe.log" || { echo "torch_cp: the probe printed no result:"; tail -5 "$work/cp_probe.log"; }
fi
