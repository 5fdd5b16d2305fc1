#!/usr/bin/env bash
# The whole test suite on a GPU host in one device call: every test file but the timing-sensitive
# ones in one pytest-xdist run of $WORKERS workers a GPU, each worker on one GPU of $GPUS in turn
# (tests/conftest.py reads PYTEST_GPUS), the large-memory tests on one worker (--dist loadgroup);
# then the timing-sensitive files ($TIMING: CUDA-graph replay verdicts, timing, generation, training
# graphs) alone on the first GPU, one worker. Ends by $DEADLINE seconds.
#
#   DEADLINE=580 GPUS=0,1 WORKERS=8 OUT=/tmp/out bash tools/gpu_tests.sh
#
# Writes $OUT/tests-all.txt, $OUT/tests-timing.txt and $OUT/tests.txt (each file's last line:
# pytest's summary, then rc=), and $OUT/install.txt.
set -u
START=$(date +%s)
left() { echo $(( ${DEADLINE:-300} - ($(date +%s) - START) )); }
OUT=${OUT:?set OUT to a folder}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TIMING=${TIMING:-"tests/test_generate.py tests/test_stepgraphs.py tests/test_timing.py tests/test_traingraphs.py"}
# the console script (tests/test_cli.py runs it) as `make setup` installs it; no network on a device
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.txt" 2>&1 \
    || echo "pip install -e . failed: tests/test_cli.py's console-script tests will fail" | tee -a "$OUT/install.txt"
GPUS=${GPUS:-0}
IFS=, read -r -a gpus <<< "$GPUS"
deselect=()
for t in $TIMING; do deselect+=(--ignore "$t"); done
PYTEST_GPUS=$GPUS timeout $(( $(left) - 120 )) python -m pytest -q -p no:cacheprovider -rf \
    -n $(( ${WORKERS:-4} * ${#gpus[@]} )) --dist loadgroup "${deselect[@]}" tests > "$OUT/tests-all.txt" 2>&1
echo "rc=$?" >> "$OUT/tests-all.txt"
CUDA_VISIBLE_DEVICES=${gpus[0]} timeout $(( $(left) - 5 )) python -m pytest -q -p no:cacheprovider -rf \
    $TIMING > "$OUT/tests-timing.txt" 2>&1
echo "rc=$?" >> "$OUT/tests-timing.txt"
for f in "$OUT"/tests-all.txt "$OUT"/tests-timing.txt; do
  echo "$(basename "$f"): $(grep -E 'passed|failed|error' "$f" | tail -1) $(tail -1 "$f")"
done | tee "$OUT/tests.txt"
