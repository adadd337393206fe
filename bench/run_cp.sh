#!/usr/bin/env bash
# Context parallelism at long context (issue 21): the trainer on Qwen2.5-0.5B's
# layer shapes (hidden 896, 14 heads, 2 KV heads, head dim 64, intermediate
# 4864, q/k/v biases, rope theta 1e6, tied embeddings) with 2 layers and the
# byte vocabulary (256: data.dataset_type text_bytes), float32, AdamW, local
# batch 1, on 1 rank (2 threads) and on 2 and 4 ranks (1 thread each) as
# ring 2, Ulysses 2, ring 4 and Ulysses 2 x ring 2 (Ulysses 4 cannot split 2
# key/value heads). DP = ranks / CP = 1 in every run, so the global batch is 1.
# The corpus: README.md and docs/DESIGN.md repeated to 4.5 MB (windows of T + 1).
# Prints per run: tokens/s (the last step's line: STEPS - 1 warmup steps
# before it), forward + backward a step, the peak RSS of the largest rank and
# the activations rank 0 reports (src/train/run.c, log_memory: the decoder's
# plan_activations plus context parallelism's buffers), that figure against
# a + b·Tc fitted from the one-rank runs at the two smallest T (every buffer
# of plan_activations is B·T x a width, so Tc = T / CP should give
# a + b·T / CP), and the run's "context parallelism a step" figures.
# LOGS=DIR keeps every run's log there.
# usage: [RUNS="one_rank ring4 ..."] [LOGS=DIR] bench/run_cp.sh [STEPS] [T...]   (defaults: 2 steps,
#        T = 8192 16384, every run); the fit needs two one-rank runs in the T given
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-2}
shift || true
lengths=("${@:-8192 16384}")
read -r -a lengths <<< "${lengths[*]}"
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for _ in $(seq 60); do cat README.md docs/DESIGN.md; done > "$work/corpus.txt"
longest=$(printf '%s\n' "${lengths[@]}" | sort -n | tail -1)
cat > "$work/run.yaml" <<YAML
model: {name: qwen2, vocab_size: 256, hidden_size: 896, intermediate_size: 4864, num_hidden_layers: 2,
        num_attention_heads: 14, num_key_value_heads: 2, max_position_embeddings: $longest,
        rope_theta: 1000000.0, rms_norm_eps: 1.0e-6, attention_bias: true, tie_word_embeddings: true}
model_init_dtype: float32
data: {dataset_type: text_bytes, path: $work/corpus.txt, seq_len: 1024, valid_fraction: 0.0}
optimizer: {_target_: AdamW}
training: {steps: $steps, local_batch_size: 1, global_batch_size: 1, eval_interval: 0, eval_batches: 0,
           log_interval: 1}
fsdp_config: {mix_precision: {param_dtype: float32, reduce_dtype: float32, output_dtype: float32}}
checkpoint: {save_interval: 0}
YAML
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores," \
     "$(grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | paste -sd' ' -)," \
     "load $(cut -d' ' -f1-3 /proc/loadavg); 2-layer Qwen2.5-0.5B shapes, vocab 256, float32, batch 1, $steps steps"
printf '%-14s %5s %6s %6s %8s %8s %9s %9s %9s %6s %8s %8s %6s\n' run ranks T Tc tok/s fwd+bwd peakRSS acts predict \
  ratio a2a ring hidden
fit=$work/fit # "T activations-MiB" of the one-rank runs
: > "$fit"
run() { # label ranks cp T extra...
  local label=$1 ranks=$2 cp=$3 T=$4
  shift 4
  [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $label "* ]] && return 0
  local launcher=() threads=2
  [ "$ranks" -gt 1 ] && launcher=(mpirun --oversubscribe --allow-run-as-root --mca btl "self,tcp" -np "$ranks") threads=1
  local log=$work/$label.$T.log
  OMP_NUM_THREADS=$threads timeout 1500 "${launcher[@]}" "$bin" train "$work/run.yaml" --set data.seq_len="$T" \
    --set checkpoint.output_dir="$work/out" "$@" > "$log" 2>&1 || { tail -20 "$log"; echo "$label T=$T failed"; return 0; }
  rm -rf "$work/out"
  [ -n "${LOGS:-}" ] && mkdir -p "$LOGS" && cp "$log" "$LOGS/"
  python3 - "$log" "$label" "$ranks" "$cp" "$T" "$fit" <<'PY'
import re, sys
log, label, ranks, cp, T, fit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
text = open(log).read()
tps = re.findall(r"\| +(\d+) tok/s", text)[-1]
fb = re.search(r"forward \+ backward ([0-9.]+) s", text).group(1)
mem = re.findall(r"memory rank (\d+): peak RSS ([0-9.]+) MiB.*activations ([0-9.]+), corpus", text)
peak = max(float(m[1]) for m in mem)
acts = float(mem[0][2])
Tc = T // cp
if ranks == 1:
    open(fit, "a").write(f"{T} {acts}\n")
pts = sorted(tuple(map(float, l.split())) for l in open(fit))
predict, ratio = "-", "-"
if len(pts) >= 2:
    (t0, a0), (t1, a1) = pts[0], pts[1]
    b = (a1 - a0) / (t1 - t0)
    p = a0 + b * (Tc - t0)
    predict, ratio = f"{p:.0f}", f"{acts / p:.3f}"
cpl = re.search(r"Ulysses all-to-all ([0-9.]+) s; ring traffic ([0-9.]+) s in flight, (\d+)% of", text)
a2a, ring, hid = cpl.groups() if cpl else ("-", "-", "-")
print(f"{label:<14} {ranks:>5} {T:>6} {Tc:>6} {tps:>8} {float(fb):>8.2f} {peak:>9.0f} {acts:>9.0f} {predict:>9} "
      f"{ratio:>6} {a2a:>8} {ring:>8} {hid + '%' if cpl and float(ring) > 0 else '-':>6}")
PY
}
for T in "${lengths[@]}"; do
  run one_rank 1 1 "$T"
done
for T in "${lengths[@]}"; do
  run ring2 2 2 "$T" --set parallel.ring_attention_size=2
  run ulysses2 2 2 "$T" --set parallel.ulysses_parallel_size=2
  run ring4 4 4 "$T" --set parallel.ring_attention_size=4
  run ulysses2_ring2 4 4 "$T" --set parallel.ulysses_parallel_size=2 --set parallel.ring_attention_size=2
done
