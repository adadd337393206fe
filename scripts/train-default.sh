#!/usr/bin/env bash
# Trains the default model (configs/default.yaml) on the default corpus (the
# English text of Debian's fortunes package). The run ends by printing where
# the final weights, the metrics and the loss plot are.
# Extra arguments are passed on, e.g. --set training.steps=50. Run again, it
# resumes from runs/default/latest (a finished run only evaluates and writes its final weights
# again, without saving the same step twice); --set checkpoint.overwrite=true starts over.
set -euo pipefail
cd "$(dirname "$0")/.."
exec build/release/hypertrain train configs/default.yaml --set checkpoint.restore_from=latest "$@"
