#!/usr/bin/env bash
# RAN in the thirty-seventh session (the prefetch lost 1-2% and was removed; TREECOMPILE_WEIGHT_PREFETCH no longer exists).
# Next session, second device call (after tests/gpu/session57.sh; carry .whl): SmolLM2-shaped rounds (random
# weights, batch 1) with and without the L2 weight prefetch: loop_profile's plain and (8, 4, 32) rounds (round,
# draft graph, verify + commit). ~200 s.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
for pf in 0 1; do
  TREECOMPILE_WEIGHT_PREFETCH=$pf BATCHES=1 SHAPES="1,1,1;8,4,32" DRAFT_VOCAB=12288 timeout 150 \
    python3 tests/gpu/loop_profile.py "$OUT/loop_pf$pf.json" - fused-only > "$OUT/loop_pf$pf.log" 2>&1
  echo "loop_profile prefetch=$pf rc=$?"; python3 tests/gpu/loop_summary.py "$OUT/loop_pf$pf.json"
done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v "^raw.tgz$") && ls -la "$OUT"
