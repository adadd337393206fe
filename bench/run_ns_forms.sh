#!/usr/bin/env bash
# Newton-Schulz of one matrix in each of hypertrain's forms (FP32 standard,
# FP32 Gram, bf16 standard, bf16 torch) against torch.optim.Muon's own bf16
# iteration, on the same CPU, 2 threads, taken in turns (ROUNDS times each
# side): bench_muon's "Newton-Schulz of one R x C matrix" line and
# bench/peers/torch_ns.py's. Legacy coefficients on torch's side, asym5 on
# hypertrain's (the same FLOPs: five iterations).
# usage: bench/run_ns_forms.sh [ROUNDS] [RxC ...]   (default: 2, 1024x1024 896x4864 256x688)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
shift || true
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(1024x1024 896x4864 256x688)
bin=build/release/bench_muon
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for shape in "${shapes[@]}"; do
  r=${shape%x*} c=${shape#*x}
  for _ in $(seq "$rounds"); do
    OMP_NUM_THREADS=2 "$bin" --rows "$r" --size "$c" --params 2 --steps 1 --no-peer | grep "matrix:"
    OMP_NUM_THREADS=2 python3 bench/peers/torch_ns.py --rows "$r" --cols "$c"
  done
done
