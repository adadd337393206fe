#!/usr/bin/env bash
# Proves that transformers loads what hypertrain saves: test_reference and
# test_deepseek export every fixture model (Hugging Face layout, written by hypertrain) and
# test_checkpoint exports a trained checkpoint (`hypertrain export`, sharded
# with an index), each with hypertrain's logits next to it; check_export.py
# loads each folder with AutoModelForCausalLM and compares logits. Needs the Python packages of
# requirements.txt. usage: tools/reference/check_hypertrain_exports.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/release}
(cd "$build" && ./test_reference > /dev/null && ./test_deepseek > /dev/null && ctest -R test_checkpoint > /dev/null)
status=0
for dir in "$build"/scratch/export_* "$build"/scratch/ckpt_export/hf_f32; do
  echo "== $(basename "$dir")"
  python3 tools/reference/check_export.py "$dir" "$dir/hypertrain_logits.safetensors" || status=1
done
exit $status
