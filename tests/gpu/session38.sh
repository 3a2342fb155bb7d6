#!/usr/bin/env bash
# Next session, after tests/gpu/session27.sh (GGUF part 0, head moved out); this call carries
# .gguf/smol.gguf.part.1 and .whl, the head back in the tree. The twenty-sixth session shipped the 65-256-row
# skinny tiles (loop_profile: batch-4 rounds of 96-128 verify rows 12-13% cheaper) but had no e2e with them, and
# its shrink e2e stopped before batch 16. (1) e2e at batch 4 and 16 with the tiles (now the default), trees of
# 64-256 verify rows, no shrinking; (2) batch 16 with shrinking: tree (4, 4, 16) only, after batch 1 and 4 of the
# same speculator (the sizes it shrinks onto), so the batch-16 row compares with (1)'s. ~250 s each.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
E2E="--model smollm2 --prompts 48 --max-new-tokens 256 --inductor --repeats 1"
timeout ${T_E2E1:-270} python3 -m treecompile.bench e2e $E2E --batch-sizes 4,16 --configs tc_plain,tc_tree \
  --trees "${TREES:-4,4,16;4,5,24;4,6,32}" --no-shrink-batch --json "$OUT/e2e_tiles.json" > "$OUT/e2e_tiles.log" 2>&1
echo "e2e tiles rc=$?"; grep "^\[e2e\] batch" "$OUT/e2e_tiles.log" | grep -v warm-up
timeout ${T_E2E2:-270} python3 -m treecompile.bench e2e $E2E --batch-sizes 1,4,16 --configs tc_tree --trees 4,4,16 \
  --shrink-batch --json "$OUT/e2e_shrink16.json" > "$OUT/e2e_shrink16.log" 2>&1
echo "e2e shrink rc=$?"; grep "^\[e2e\] batch" "$OUT/e2e_shrink16.log" | grep -v warm-up
