#!/usr/bin/env bash
# Issue 4, the 64-row o and down through wide slices split over K (carry .whl; any H100 or H200; ~450-580 s).
# Why: an MMA-tile program rereads its 64 rows of x (64 x K) from L2 for every output slice, so the 8B o
# (32-wide slices: 128 programs) and down read about twice their weight's bytes again in x, and run 1.16-1.33x
# their weight-read floor on the slower H100 (notes/gpu-2026-12-05-s41) where the 1-row gemv runs ~1.05-1.2x. A
# slice four times as wide split four ways over K keeps the program count and reads a quarter of that x. The
# verify's o and down are skinny_linear_norm_out launches, which take split-K entries since this session.
#   1. the norm-out and split-K GPU tests (the new epilogue path on the GPU, before anything is timed);
#   2. `skinny_sweep.py wide 64 "8b o|8b down"` (wide64.json; T_SWEEP, default 120 s; 0 skips it);
#   3. 8B rounds, VARIANTS (default "default table default table"; "table" installs wide64.json through
#      variant.py --table), each only while DEADLINE (default 585 s from the start) leaves ~110 s for it.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic CLOCKS=${CLOCKS-1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
. tests/gpu/rounds_lib.sh
if [ "${T_TESTS:-90}" != 0 ]; then
  timeout ${T_TESTS:-90} python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_skinny_linear.py \
    -k "norm_out or split_k" > "$OUT/tests.log" 2>&1
  echo "tests rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
fi
if [ "${T_SWEEP:-120}" != 0 ]; then
  timeout ${T_SWEEP:-120} python3 tests/gpu/skinny_sweep.py "$OUT/wide64.json" wide 64 "8b o|8b down" \
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
