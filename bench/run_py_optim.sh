#!/usr/bin/env bash
# The optimizer step from Python (issue 23): hypertrain.optim against torch.optim on
# Qwen2.5-0.5B's tensors, 2 threads, each optimizer in its own process
# (bench/peers/py_optim_step.py): AdamW on all 494M values (torch: fused=True),
# Muon on the matrices of MUON_LAYERS of the 24 layers (default 2: 14 matrices;
# torch.optim.Muon's bf16 Newton-Schulz takes minutes a step on all 24 on a CPU
# without native bf16), Newton-Schulz in bf16 (torch's own) and in float32 (torch's
# iteration computed in float32) on both sides. Needs the package installed (make python) and torch.
# Prints each run's line, then the ratios.
# usage: [MUON_LAYERS=2] bench/run_py_optim.sh [STEPS]   (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-3}
python3 -c 'import torch, hypertrain._C' || { echo "needs torch and the package: make python" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores," \
     "$(grep -o -w -E 'avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | paste -sd' ' -), load $(cut -d' ' -f1-3 /proc/loadavg)"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
muon="--layers ${MUON_LAYERS:-2}"
for run in "torch_adamw" "hypertrain_adamw" "torch_muon --ns-dtype bfloat16 $muon" \
           "hypertrain_muon --ns-dtype bfloat16 $muon" "torch_muon --ns-dtype float32 $muon" \
           "hypertrain_muon --ns-dtype float32 $muon"; do
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=2 python3 bench/peers/py_optim_step.py --threads 2 --steps "$steps" --opt $run | tee -a "$out"
done
python3 - "$out" <<'PY'
import re, sys
runs = {}
for line in open(sys.argv[1]):
    name = line.split()[1] + (" " + line.split()[2] if "ns_dtype" in line.split()[2] else "")
    runs[name] = (float(re.search(r"step_s=([0-9.]+)", line).group(1)), float(re.search(r"peak_rss_mib=([0-9.]+)", line).group(1)))
t, h = runs["torch_adamw"], runs["hypertrain_adamw"]
print(f"AdamW: hypertrain {t[0] / h[0]:.2f}x torch fused's speed, peak RSS {h[1] / t[1]:.2f}x")
for dt in ("bfloat16", "float32"):
    t, h = runs["torch_muon ns_dtype=" + dt], runs["hypertrain_muon ns_dtype=" + dt]
    print(f"Muon ({dt} Newton-Schulz): hypertrain {t[0] / h[0]:.2f}x torch.optim.Muon's speed, peak RSS {h[1] / t[1]:.2f}x")
PY
