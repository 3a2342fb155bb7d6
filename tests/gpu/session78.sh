#!/usr/bin/env bash
# Issue 4: the verify's 64-row o and down with wide slices split over K (carry .whl; any H100 or H200; ~300-585 s).
# Why: an MMA-tile program rereads its 64 rows of x (64 x K) from L2 for every output slice, so the 8B o (32-wide
# slices: 128 programs) and down read about twice their weight's bytes again in x, and run 1.16-1.33x their
# weight-read floor on the slower H100 (notes/gpu-2026-12-05-s41) where the 1-row gemv runs ~1.05-1.2x. A slice
# four times as wide split four ways over K keeps the program count and reads a quarter of that x. The verify's o
# and down are skinny_linear_norm_out launches, which take split-K entries through the measured table.
#   1. the split-K norm-out GPU tests, bfloat16 (5 tests; T_TESTS, default 60 s);
#   2. `skinny_sweep.py wide 64 "8b o|8b down"` (wide64.json; T_SWEEP, default 130 s; 0 skips it);
#   3. 8B rounds, VARIANTS (default "default table default table"; "table": wide64.json through variant.py
#      --table), each only while DEADLINE (default 585 s from the start) leaves ~110 s.
# Outcome, fifty-fifth session, a slower H100 (notes/gpu-2026-12-07-s55): refuted. Every wide or split config ran
# slower than the shipped tiles (o 16.4 against 14.7 us, down 46.5 against 45.2; a split q/k/v + rope, since
# removed, 25.2 against 21.7); the table variant's verify(64) 6.611 ms against 6.433-6.449 for the defaults. Not
# yet run on an H200.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic CLOCKS=${CLOCKS-1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
. tests/gpu/rounds_lib.sh
if [ "${T_TESTS:-60}" != 0 ]; then
  timeout ${T_TESTS:-60} python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_skinny_linear.py \
    -k "(norm_out_keeps and bfloat16 and (False-2 or False-3 or False-4 or True-2)) or norm_out_refuses" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
fi
if [ "${T_SWEEP:-130}" != 0 ]; then
  timeout ${T_SWEEP:-130} python3 tests/gpu/skinny_sweep.py "$OUT/wide64.json" wide 64 "8b o|8b down" \
    > "$OUT/wide64.log" 2>&1
  echo "wide sweep rc=$? at $(( $(date +%s) - t0 )) s"; cut -c1-330 "$OUT/wide64.log" | tail -4
fi
for v in ${VARIANTS:-default table default table}; do
  if [ $(( $(date +%s) - t0 + 110 )) -gt "${DEADLINE:-585}" ]; then echo "stop before $v: $(( $(date +%s) - t0 )) s"; break; fi
  case $v in
    default) run_rounds "$v";;
    table) [ -s "$OUT/wide64.json" ] && run_rounds "$v" -- python3 tests/gpu/variant.py --table "$OUT/wide64.json" \
      treecompile.bench;;
    *) echo "unknown variant $v";;
  esac
done
echo "done at $(( $(date +%s) - t0 )) s"
