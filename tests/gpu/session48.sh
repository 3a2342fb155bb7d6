#!/usr/bin/env bash
# Thirty-first session (carry .whl; random weights). Inductor's combo kernels (`combo_kernels=True`: independent
# small kernels, such as a layer's q and k rope or the draft round's tree bookkeeping, fused into one launch) have
# never been timed here. A batch-1 round of SmolLM2's shape (plain and (4, 4, 16); loop_profile, random weights, so
# round times only) with and without them, then the 8B rounds with them (this session's first call measured the
# 8B rounds without: verify 5.258 / 5.244, decode 4.598 / 4.597, draft 1.230 / 1.233 ms). ~450 s.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1
R=$PWD; cd /tmp
for tag in combo default combo2; do
  flags=$([ "$tag" = default ] || echo "--inductor combo_kernels=True")
  BATCHES=1 SHAPES="1,1,1;4,4,16" DRAFT_VOCAB=12288 timeout ${T_PROF:-150} \
    python3 $R/tests/gpu/variant.py $flags $R/tests/gpu/loop_profile.py "$OUT/loop_$tag.json" - fused-only > "$OUT/loop_$tag.log" 2>&1
  echo "loop_profile $tag rc=$?"; python3 $R/tests/gpu/loop_summary.py "$OUT/loop_$tag.json"
  [ "$tag" = combo ] && { grep -E "Error|error" "$OUT/loop_$tag.log" | head -5; }
done
timeout ${T_ROUNDS:-150} python3 $R/tests/gpu/variant.py --inductor combo_kernels=True treecompile.bench rounds \
  --inductor --nodes 64 --reps 10 --no-hf --json "$OUT/rounds_combo.json" > "$OUT/rounds_combo.log" 2>&1
echo "8B rounds combo rc=$?"; grep -E "^\| treecompile|^- " "$OUT/rounds_combo.log" | cut -c1-100
