#!/usr/bin/env bash
# Generation speed (issue 44): `hypertrain generate` against transformers'
# generate on the same random float32 Qwen2 weights (made once by
# bench/peers/hf_generate.py --make: the default config's byte-level model,
# and a 62M one of vocab 32000), greedy, a 32-token prompt and 128 new tokens,
# 2 threads, taken in turns ROUNDS times. Each prints the prompt's time (to
# the first new token) and the tokens/s of the rest, and the new tokens
# themselves, which must agree.
# usage: bench/run_generate.sh [ROUNDS] [DIR]   (default: 3, build/bench/generate)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
dir=${2:-$PWD/build/bench/generate}
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "build first: make build" >&2; exit 1; }
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for size in default small; do
  [ -f "$dir/$size/model.safetensors" ] || { mkdir -p "$dir/$size"; python3 bench/peers/hf_generate.py "$dir/$size" --make "$size"; }
  vocab=$(python3 -c "import json; print(json.load(open('$dir/$size/config.json'))['vocab_size'])")
  prompt=$(python3 -c "import random; random.seed(1); print(','.join(str(random.randrange($vocab)) for _ in range(32)))")
  for r in $(seq "$rounds"); do
    log=$(mktemp)
    OMP_NUM_THREADS=2 "$bin" generate "$dir/$size" --prompt-ids "$prompt" --max-new-tokens 128 > "$log.out" 2> "$log"
    sed -nE "s/.*the prompt's [0-9]+ in ([0-9.]+) s, then ([0-9.]+) tokens\/s/{\"engine\": \"hypertrain\", \"model\": \"$size\", \"prompt_s\": \1, \"tokens_per_s\": \2, /p" "$log" | tr -d '\n'
    printf '"tokens": "%s"}\n' "$(tr -d '\n' < "$log.out")"
    rm -f "$log" "$log.out"
    OMP_NUM_THREADS=2 python3 bench/peers/hf_generate.py "$dir/$size" --prompt-ids "$prompt" --new 128 --threads 2 |
      sed "s/\"engine\": \"transformers\"/\"engine\": \"transformers\", \"model\": \"$size\"/"
  done
done
