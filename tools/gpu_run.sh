#!/usr/bin/env bash
# One device call's work on a multi-GPU host: the named test files on GPU 0 (pytest-xdist, $PYTEST_ARGS)
# while bench/suite.py runs rows of $PROBLEMS on the other GPUs, both ending by $DEADLINE seconds.
#
#   DEADLINE=540 TESTS="tests/test_codegen_welford.py ..." PROBLEMS="17_*,60_*" LEVELS=2 GPUS=1,2,3 \
#       OUT=/tmp/out bash tools/gpu_run.sh
#
# Before the device call: `git rev-parse --short HEAD > .commit` (untracked, so it travels with the
# checkout; a device copy's .git may be stale): env.txt and bench/e2e.py's provenance read it first.
# Delete it after, or local runs report that commit.
# KernelBench is read from $KB (default ../shared/kernelbench; a device call carries a copy inside the
# checkout). Writes $OUT/env.txt (date, commit, GPUs, versions), $OUT/pytest.txt, $OUT/suite.jsonl and
# $OUT/suite.log. TESTS or PROBLEMS empty: that half is skipped.
set -u
START=$(date +%s)
left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - START) )); }
OUT=${OUT:?set OUT to a folder}
KB=$(cd "${KB:-../shared/kernelbench}" 2>/dev/null && pwd || echo "${KB:-../shared/kernelbench}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u; cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null  # .commit: a device copy's .git may be stale
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/env.txt" 2>&1
if [ -n "${TESTS:-}" ]; then
  ( CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 20 )) python -m pytest -q --maxfail=10 -p no:cacheprovider \
      ${PYTEST_ARGS:-} $TESTS > "$OUT/pytest.txt" 2>&1; echo "rc=$?" >> "$OUT/pytest.txt" ) &
fi
if [ -n "${PROBLEMS:-}" ]; then
  (cd bench && python suite.py --kernelbench "$KB" \
      --levels "${LEVELS:-2}" --problems "$PROBLEMS" --gpus "${GPUS:-1,2,3}" --profile \
      --out "$OUT/suite.jsonl" --stop-after $(( $(left) - 30 )) > "$OUT/suite.log" 2>&1)
fi
wait
tail -3 "$OUT/pytest.txt" 2>/dev/null; tail -2 "$OUT/suite.log" 2>/dev/null
