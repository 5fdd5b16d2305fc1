#!/usr/bin/env bash
# The whole test suite on a GPU host in one device call: every test file but the timing-sensitive
# ones in one pytest-xdist run of $WORKERS workers a GPU, each worker on one GPU of $GPUS in turn
# (tests/conftest.py reads PYTEST_GPUS), the large-memory tests on one worker (--dist loadgroup);
# then the timing-sensitive files ($TIMING: CUDA-graph replay verdicts, timing, generation, training
# graphs) alone on the first GPU, one worker. Ends by $DEADLINE seconds.
#
#   DEADLINE=580 GPUS=0,1 WORKERS=8 OUT=/tmp/out bash tools/gpu_tests.sh
#
# PART=i/n (1-based) runs the i-th of n parts of the test files (balanced by size; the timing files
# with the last part), for a host too small to run the whole suite in one call:
#   PART=1/2 DEADLINE=580 GPUS=0 WORKERS=12 OUT=/tmp/out bash tools/gpu_tests.sh
# FILES="tests/test_a.py tests/test_b.py" runs those files only (what a change touches), the timing
# files among them alone after the rest as always.
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
IFS=/ read -r part parts <<< "${PART:-1/1}"
mapfile -t files < <(python - "$part" "$parts" $TIMING <<'PY'
import os, sys
part, parts, timing = int(sys.argv[1]), int(sys.argv[2]), {os.path.basename(t) for t in sys.argv[3:]}
files = sorted((f for f in os.listdir("tests") if f.startswith("test_") and f.endswith(".py") and f not in timing),
               key=lambda f: (-os.path.getsize(os.path.join("tests", f)), f))
sizes = [0] * parts
for f in files:  # largest first, each to the lightest part
    i = sizes.index(min(sizes))
    sizes[i] += os.path.getsize(os.path.join("tests", f))
    if i == part - 1:
        print(f"tests/{f}")
PY
)
if [ -n "${FILES:-}" ]; then  # the named files: the timing ones among them keep their own run
  files=() timing=()
  for f in $FILES; do
    case " $TIMING " in *" $f "*) timing+=("$f") ;; *) files+=("$f") ;; esac
  done
  TIMING="${timing[*]}"
fi
[ "$part" = "$parts" ] || TIMING=""
reserve=5; [ -n "$TIMING" ] && reserve=120  # the timing files' time after
if [ ${#files[@]} -gt 0 ]; then  # (no file named would make pytest collect every one)
  PYTEST_GPUS=$GPUS timeout $(( $(left) - reserve )) python -m pytest -q -p no:cacheprovider -rf \
      -n $(( ${WORKERS:-4} * ${#gpus[@]} )) --dist loadgroup "${files[@]}" > "$OUT/tests-all.txt" 2>&1
  echo "rc=$?" >> "$OUT/tests-all.txt"
fi
if [ -n "$TIMING" ]; then
  CUDA_VISIBLE_DEVICES=${gpus[0]} timeout $(( $(left) - 5 )) python -m pytest -q -p no:cacheprovider -rf \
      $TIMING > "$OUT/tests-timing.txt" 2>&1
  echo "rc=$?" >> "$OUT/tests-timing.txt"
fi
for f in "$OUT"/tests-all.txt "$OUT"/tests-timing.txt; do
  [ -f "$f" ] || continue
  echo "$(basename "$f"): $(grep -E 'passed|failed|error' "$f" | tail -1) $(tail -1 "$f")"
done | tee "$OUT/tests.txt"
