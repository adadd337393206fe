#!/usr/bin/env bash
# Pipeline parallelism (issue 43): the bubble each schedule leaves, measured,
# against the formula (P - 1) / (m + P - 1), and tokens/s beside PyTorch's
# torch.distributed.pipelining on the same model and schedule, in one run.
# The model: configs/default.yaml's decoder (byte vocabulary 256, hidden 256,
# intermediate 688, 8 heads, 2 KV heads, q/k/v biases, untied embeddings)
# with 8 layers instead of 4 (P = 4 stages then hold 2 layers each), float32,
# AdamW (lr 1e-3, weight decay 0.01; clip 1.0) for both, micro-batches of
# B = 2 sequences of T = 256 tokens, m of them a step (hypertrain:
# global_batch_size = 2 m on one data-parallel rank a stage). One thread a
# rank: hypertrain under mpirun -np P with OMP_NUM_THREADS=1 (btl self,tcp),
# the peer (bench/peers/torch_pipeline_step.py: transformers' Qwen2 layers
# split the same way, PipelineStage + Schedule1F1B / ScheduleGPipe, gloo)
# under torchrun --nproc_per_node P with torch.set_num_threads(1).
# For P in PS, m in MS, schedule in SCHEDS: hypertrain, then the peer,
# alternating. Prints one row each: the formula's bubble, each engine's
# measured bubble (the stages' mean share of the step's micro-batches not
# spent computing: waits and exchanges count as idle in both), tokens/s
# (hypertrain: its metrics.jsonl over steps 2..STEPS; the peer: STEPS - 1
# timed steps after one untimed) and hypertrain's over torch's, and the
# 1-minute load before each pair. hypertrain's measured bubble covers every
# step of its run (the first included: it logs one figure at the end).
# More ranks than cores: the stages share cores, and the figures measure
# that sharing as much as the schedule (the row says so).
# usage: [PS="2 4"] [MS="4 8 16"] [SCHEDS="1f1b gpipe"] [LOGS=DIR] bench/run_pipeline.sh [STEPS]
#        (default 4 steps)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-4}
B=2 T=256 L=8
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/run.yaml" <<YAML
model: {name: qwen2, vocab_size: 256, hidden_size: 256, intermediate_size: 688, num_hidden_layers: $L,
        num_attention_heads: 8, num_key_value_heads: 2, max_position_embeddings: 512, rope_theta: 10000.0,
        rms_norm_eps: 1.0e-6, attention_bias: true, tie_word_embeddings: false}
model_init_dtype: float32
data: {dataset_type: text_bytes, path: /usr/share/games/fortunes, seq_len: $T, valid_fraction: 0.0}
optimizer: {_target_: AdamW, adamw_config: {adamw_lr: 0.001, adamw_weight_decay: 0.01}}
training: {steps: $steps, local_batch_size: $B, max_norm: 1.0, eval_interval: 0, eval_batches: 0, log_interval: 1}
fsdp_config: {mix_precision: {param_dtype: float32, reduce_dtype: float32, output_dtype: float32}}
checkpoint: {save_interval: 0}
YAML
cores=$(nproc)
torch_ok=1
python3 -c 'import torch, transformers' 2> /dev/null || torch_ok=0
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $cores cores, load" \
     "$(cut -d' ' -f1-3 /proc/loadavg); $L layers x hidden 256, float32, AdamW, micro-batch $B x $T, $steps steps;" \
     "torch $(python3 -c 'import torch; print(torch.__version__.split("+")[0])' 2> /dev/null || echo absent)"
printf '%-2s %3s %-6s %8s %9s %9s %9s %9s %6s %6s  %s\n' P m sched formula ht_bubble pt_bubble ht_tok/s pt_tok/s ratio load \
  "stages computing (hypertrain | torch)"
for P in ${PS:-2 4}; do
  for m in ${MS:-4 8 16}; do
    for sched in ${SCHEDS:-1f1b gpipe}; do
      label=p${P}_m${m}_$sched
      load=$(cut -d' ' -f1 /proc/loadavg)
      hlog=$work/$label.hypertrain.log tlog=$work/$label.torch.log
      OMP_NUM_THREADS=1 timeout 1200 mpirun --oversubscribe --mca btl self,tcp -np "$P" "$bin" train "$work/run.yaml" \
        --set parallel.pipeline_parallel_size="$P" --set parallel.pipeline_schedule="$sched" \
        --set training.global_batch_size=$((B * m)) --set checkpoint.output_dir="$work/out" > "$hlog" 2>&1 ||
        echo "# $label: hypertrain failed (exit $?): $(tail -1 "$hlog")"
      [ -f "$work/out/metrics.jsonl" ] && cp "$work/out/metrics.jsonl" "$work/$label.metrics.jsonl"
      rm -rf "$work/out"
      if [ "$torch_ok" = 1 ]; then
        # (gloo sometimes aborts in its teardown, after the line is printed: the line is what counts)
        OMP_NUM_THREADS=1 timeout 1200 torchrun --standalone --nproc_per_node="$P" bench/peers/torch_pipeline_step.py \
          --schedule "$sched" --micro "$m" --batch $B --seq $T --layers $L --threads 1 \
          --warmup 1 --steps $((steps - 1)) > "$tlog" 2>&1 || true
      else
        echo "torch or transformers not importable" > "$tlog"
      fi
      [ -n "${LOGS:-}" ] && mkdir -p "$LOGS" && cp "$hlog" "$tlog" "$LOGS/" &&
        { [ ! -f "$work/$label.metrics.jsonl" ] || cp "$work/$label.metrics.jsonl" "$LOGS/"; }
      python3 - "$hlog" "$work/$label.metrics.jsonl" "$tlog" "$P" "$m" "$sched" "$load" "$cores" <<'PY'
import json, os, re, sys
hlog, metrics, tlog, P, m, sched, load, cores = sys.argv[1:]
P, m, cores = int(P), int(m), int(cores)
formula = 100.0 * (P - 1) / (m + P - 1)
text = open(hlog).read()
line = re.search(r"pipeline a step \((\w+)\): .*", text)
ht_bubble, ht_stages = "-", "-"
if line:
    ht_bubble = re.search(r"bubble measured ([0-9.]+)%", line.group(0)).group(1) + "%"
    ht_stages = " ".join(re.findall(r"stage \d+ (\d+)% computing", line.group(0)))
ht_tps = "-"
if os.path.exists(metrics):
    rows = [json.loads(l) for l in open(metrics) if l.strip()]
    timed = [r for r in rows if r["step"] >= 2] or rows
    if timed:
        # the steps' tokens over their summed time (every step has the same tokens)
        ht_tps = len(timed) / sum(1.0 / r["tokens_per_s"] for r in timed)
ttext = open(tlog).read()
tl = next((l for l in ttext.splitlines() if l.startswith("torch_pipeline ")), None)
pt_bubble, pt_tps, pt_stages = "-", "-", "-"
if tl:
    pt_bubble = re.search(r"bubble_measured=([0-9.]+%)", tl).group(1)
    pt_tps = float(re.search(r"tokens_per_s=([0-9.]+)", tl).group(1))
    pt_stages = " ".join(re.search(r"computing=\[([^\]]*)\]", tl).group(1).replace("%", "").split(", "))
ratio = f"{ht_tps / pt_tps:.2f}" if isinstance(ht_tps, float) and isinstance(pt_tps, float) else "-"
fmt = lambda x: f"{x:.0f}" if isinstance(x, float) else x
note = f"  ({P} ranks on {cores} cores: oversubscribed)" if P > cores else ""
print(f"{P:<2} {m:>3} {sched:<6} {formula:>7.1f}% {ht_bubble:>9} {pt_bubble:>9} {fmt(ht_tps):>9} {fmt(pt_tps):>9} "
      f"{ratio:>6} {load:>6}  {ht_stages} | {pt_stages}{note}")
if not tl:
    print(f"#   torch: {(ttext.strip().splitlines() or ['no output'])[-1][:200]}")
PY
    done
  done
done
