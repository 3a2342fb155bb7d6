#!/usr/bin/env bash
# Next session (carry .whl; random weights, no GGUF). A batch-1 round runs GEMMs at row counts no sweep has
# timed: the draft lanes' 4 rows (and the head's q/k/v over 1152 and its 12288-id LM head, which have no table
# entry at all, so cuBLAS), the (4, 4, 16) verify's 16 rows and the (4, 6, 32) verify's 32, which borrow the 8-
# and 64-row tiles (the sweep also tries the gemv kernel, now allowed up to 16 rows). At 16 rows those cost ~15 us a layer against the 1-row gemv's ~10.6 (ops/skinny_linear.py
# _MEASURED), ~0.14 ms a verify: most of what separates a (4, 4, 16) round (1.10 ms) from the ~1.0 ms that
# issue 5's 2.0x needs. PART=1 (default; ~520 s, timeout_s 600): the "mid" sweep, then loop_profile at batch 1
# with its winners registered. PART=2 (~200 s): the same loop_profile on the shipped table, the baseline.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh || exit 3
R=$PWD; cd /tmp
if [ "${PART:-1}" = 1 ]; then
  timeout ${T_SWEEP:-330} python3 $R/tests/gpu/skinny_sweep.py "$OUT/mid_sweep.json" mid > "$OUT/mid_sweep.log" 2>&1
  echo "sweep rc=$?"; cut -c1-150 "$OUT/mid_sweep.log" | tail -24
  runs="tiles"
else
  runs="shipped"
fi
for tag in $runs; do
  tiles=$([ "$tag" = tiles ] && echo "$OUT/mid_sweep.json" || true)
  SKINNY_TILES=$tiles BATCHES=1 SHAPES="${SHAPES:-4,4,16;4,6,32;8,6,64}" DRAFT_VOCAB=12288 timeout ${T_PROF:-180} \
    python3 $R/tests/gpu/loop_profile.py "$OUT/loop_$tag.json" - fused-only > "$OUT/loop_$tag.log" 2>&1
  echo "loop_profile $tag rc=$?"
  python3 $R/tests/gpu/loop_summary.py "$OUT/loop_$tag.json"
done
