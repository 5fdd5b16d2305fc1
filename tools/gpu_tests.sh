#!/usr/bin/env bash
# The whole test suite on a multi-GPU host in one device call: the test files in shards, one per GPU
# (pytest-xdist, $WORKERS workers each, files balanced by size), then the timing-sensitive files
# ($TIMING: CUDA-graph replay verdicts, timing, generation, training graphs) alone on the first GPU,
# one worker. Ends by $DEADLINE seconds.
#
#   DEADLINE=300 GPUS=0,1,2,3 WORKERS=4 OUT=/tmp/out bash tools/gpu_tests.sh
#
# Writes $OUT/tests-<gpu>.txt per shard, $OUT/tests-timing.txt and $OUT/tests.txt (each file's last
# line: pytest's summary, then rc=).
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
IFS=, read -r -a gpus <<< "${GPUS:-0,1,2,3}"
mapfile -t shards < <(python - "${#gpus[@]}" $TIMING <<'PY'
import os, sys
n, timing = int(sys.argv[1]), set(sys.argv[2:])
files = sorted((f for f in os.listdir("tests") if f.startswith("test_") and f.endswith(".py")),
               key=lambda f: -os.path.getsize(os.path.join("tests", f)))
shards, sizes = [[] for _ in range(n)], [0] * n
sizes[0] = sum(os.path.getsize(t) for t in timing)  # the first GPU runs the timing files after its shard
for f in files:
    if f"tests/{f}" in timing:
        continue
    i = sizes.index(min(sizes))
    shards[i].append(f"tests/{f}")
    sizes[i] += os.path.getsize(os.path.join("tests", f))
for s in shards:
    print(" ".join(s))
PY
)
for i in "${!gpus[@]}"; do
  ( CUDA_VISIBLE_DEVICES=${gpus[$i]} timeout $(( $(left) - 10 )) python -m pytest -q -p no:cacheprovider \
      -n "${WORKERS:-4}" ${shards[$i]} > "$OUT/tests-${gpus[$i]}.txt" 2>&1
    echo "rc=$?" >> "$OUT/tests-${gpus[$i]}.txt"
    if [ "$i" = 0 ]; then
      CUDA_VISIBLE_DEVICES=${gpus[0]} timeout $(( $(left) - 5 )) python -m pytest -q -p no:cacheprovider \
          $TIMING > "$OUT/tests-timing.txt" 2>&1
      echo "rc=$?" >> "$OUT/tests-timing.txt"
    fi ) &
done
wait
for f in "$OUT"/tests-*.txt; do echo "$(basename "$f"): $(grep -E 'passed|failed|error' "$f" | tail -1) $(tail -1 "$f")"; done \
    | tee "$OUT/tests.txt"
