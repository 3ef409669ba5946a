#!/bin/bash
# Run transformers' own Trainer tests without the callback (twice), with monitor and with default; compare.
# usage: benchmarks/engine_suites/run_hf.sh TESTS_ROOT RESULTS_DIR [TEST_FILE ...]
#   TESTS_ROOT: a folder holding transformers' tests/ package (tests/__init__.py,
#               tests/trainer/__init__.py, tests/trainer/trainer_test_utils.py and the test files),
#               e.g. a sparse checkout of the transformers tag matching the installed version.
#   TEST_FILE:  paths relative to TESTS_ROOT (default: the files listed below).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
ROOT=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); shift 2
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=(tests/trainer/test_trainer_callback.py tests/trainer/test_trainer_checkpointing.py
  tests/trainer/test_trainer_resume.py tests/trainer/test_trainer_optimizers.py tests/trainer/test_trainer_data.py)
cd "$ROOT"
for f in "${FILES[@]}"; do
  tag=$(basename "${f%.py}")
  for mode in none none2 monitor default; do   # none2: the baseline again (unseeded tests show up)
    m=$mode; [ "${m#none}" != "$m" ] && m=""
    rm -f "$OUT/$tag-$mode.jsonl"
    GG_ATTACH=$m GG_RECORD="$OUT/$tag-$mode.jsonl" OMP_NUM_THREADS=1 PYTHONPATH="$HERE:$ROOT:$REPO" \
      python -m pytest -q -p hf_attach -p no:cacheprovider --timeout 300 -o addopts="" \
      --junitxml="$OUT/junit-$tag-$mode.xml" "$f" > "$OUT/log-$tag-$mode.txt" 2>&1
    echo "$tag $mode rc=$?"
  done
done
python "$HERE/compare.py" "$OUT"
