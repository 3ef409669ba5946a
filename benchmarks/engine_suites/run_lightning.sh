#!/bin/bash
# Run Lightning's own tests (tests/tests_pytorch of the tag matching the installed lightning) without
# the callback, with monitor and with default; print the failures of each run.
# usage: benchmarks/engine_suites/run_lightning.sh TESTS_DIR RESULTS_DIR [TEST_PATH ...]
#   TESTS_DIR: the folder holding tests_pytorch/ (Lightning's repository tests/ folder).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
ROOT=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); shift 2
PATHS=("$@")
[ ${#PATHS[@]} -eq 0 ] && PATHS=(tests_pytorch/trainer/optimization tests_pytorch/trainer/logging_
  tests_pytorch/trainer/connectors/test_callback_connector.py tests_pytorch/callbacks tests_pytorch/checkpointing
  tests_pytorch/core/test_lightning_optimizer.py tests_pytorch/models/test_hooks.py
  tests_pytorch/models/test_restore.py tests_pytorch/models/test_amp.py)
cd "$ROOT"
for mode in none monitor default; do
  m=$mode; [ "$m" = none ] && m=""
  GG_ATTACH=$m OMP_NUM_THREADS=1 PYTHONPATH="$HERE:$ROOT:$REPO" python -m pytest -q -p lightning_attach \
    -p no:cacheprovider --timeout 300 -o addopts="" -W "ignore::FutureWarning" \
    --ignore=tests_pytorch/checkpointing/test_legacy_checkpoints.py \
    --junitxml="$OUT/junit-lightning-$mode.xml" "${PATHS[@]}" > "$OUT/log-lightning-$mode.txt" 2>&1
  echo "lightning $mode rc=$? $(tail -1 "$OUT/log-lightning-$mode.txt")"
  grep '^FAILED' "$OUT/log-lightning-$mode.txt" | sed 's/ - .*//' > "$OUT/failed-lightning-$mode.txt"
done
