#!/usr/bin/env bash
# Fuzzing: every libFuzzer target of tests/fuzz/ (build/fuzz, `make build-fuzz`)
# first replays its committed regression inputs (tests/fuzz/regressions/<name>/),
# then fuzzes for SECONDS from its seed corpus (tests/fuzz/corpus/<name>/, left
# unchanged: new inputs go to a scratch copy) with its dictionary. A crash
# stops the script with the input's path: copy it into regressions/<name>/ with
# the fix. `make test` runs 10 s a target; for hours: scripts/fuzz.sh 3600.
# usage: scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
shift || true
bin=build/fuzz
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config safetensors json metadata hf_index token_bin)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dict_of() { case $1 in config) echo tests/fuzz/config.dict ;; json | metadata | hf_index | safetensors) echo tests/fuzz/json.dict ;; esac; }
for t in "${targets[@]}"; do
  exe=$bin/fuzz_$t
  [ -x "$exe" ] || { echo "fuzz: $exe is missing (make build-fuzz)" >&2; exit 1; }
  if [ -d "tests/fuzz/regressions/$t" ] && [ -n "$(ls -A "tests/fuzz/regressions/$t")" ]; then
    "$exe" -runs=0 "tests/fuzz/regressions/$t"/* > "$work/$t.replay" 2>&1 ||
      { tail -30 "$work/$t.replay"; echo "fuzz $t: a regression input fails again" >&2; exit 1; }
  fi
  mkdir -p "$work/corpus_$t" "$work/crash_$t"
  cp -r "tests/fuzz/corpus/$t/." "$work/corpus_$t/"
  dict=$(dict_of "$t")
  # -rss_limit_mb: the readers cap their allocations well below it; -timeout: nothing may hang.
  if ! "$exe" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
    ${dict:+-dict="$dict"} -artifact_prefix="$work/crash_$t/" "$work/corpus_$t" > "$work/$t.log" 2>&1; then
    tail -40 "$work/$t.log"
    mkdir -p fuzz-crashes
    cp "$work/crash_$t"/* fuzz-crashes/ 2> /dev/null || true
    echo "fuzz $t: FAILED; the input is in fuzz-crashes/ (add it to tests/fuzz/regressions/$t/ with the fix)" >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t.log")
  cov=$(grep -oE 'cov: [0-9]+' "$work/$t.log" | tail -1)
  echo "fuzz $t: ${runs:-?} inputs in ${seconds} s, ${cov:-cov: ?}, no crash"
done
