#!/usr/bin/env bash
# One device call's A/B of two code generators: for each KernelBench problem of $PROBLEMS (LEVEL/N,
# files under $KB), its generated regions' sources under the same schedules from the solforge
# package in $BASE (a folder holding an older `solforge/`, carried with the call) and from this
# checkout (with its stride hints), timed back to back by tools/ab_codegen.py; ends by $DEADLINE s.
#
# On this machine first:  mkdir -p .run/base && git archive REV solforge | tar -x -C .run/base
#   DEADLINE=560 BASE=.run/base PROBLEMS="2/93 2/31 2/60" SPREAD=6 KB=.kb OUT=$OUT bash tools/gpu_ab.sh
# (carry .run and .kb). Writes $OUT/ab.jsonl (each problem's rows, `us`: [base, head]) and $OUT/ab.log:
# two files, the device returns at most 8.
set -u
START=$(date +%s)
left() { echo $(( ${DEADLINE:-560} - ($(date +%s) - START) )); }
OUT=${OUT:?set OUT to a folder}
BASE=${BASE:?set BASE to a folder holding the older solforge/}
KB=${KB:-.kb}
mkdir -p "$OUT"
tmp=$(mktemp -d)
for p in ${PROBLEMS:?}; do
  level=${p%%/*} n=${p##*/}
  f=$(ls "$KB/level$level/${n}_"*.py 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "no problem $p under $KB" >> "$OUT/ab.log"; continue; }
  [ "$(left)" -gt 60 ] || { echo "$p: not started (deadline)" >> "$OUT/ab.log"; continue; }
  sched=(--spread "${SPREAD:-6}")
  for s in ${SCHEDS:-}; do sched+=(--sched "$s"); done
  {
    echo "== $p ($f)"
    PYTHONPATH=$BASE timeout $(( $(left) - 30 )) python tools/ab_codegen.py dump --problem "$f" "${sched[@]}" \
        --out "$tmp/base.json" \
      && PYTHONPATH=$PWD timeout $(( $(left) - 30 )) python tools/ab_codegen.py dump --problem "$f" "${sched[@]}" \
        --hints --out "$tmp/head.json" \
      && PYTHONPATH=$PWD timeout $(( $(left) - 10 )) python tools/ab_codegen.py time --problem "$f" \
        "$tmp/base.json" "$tmp/head.json" --out "$tmp/rows.json" \
      && python -c "import json, sys; [print(json.dumps({'problem': sys.argv[2], **r})) for r in json.load(open(sys.argv[1]))]" \
        "$tmp/rows.json" "$p" >> "$OUT/ab.jsonl"
  } >> "$OUT/ab.log" 2>&1
done
rm -rf "$tmp"
tail -3 "$OUT/ab.log"
