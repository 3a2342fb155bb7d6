#!/usr/bin/env bash
# Twenty-seventh session, after tests/gpu/session27.sh (GGUF part 0, head moved out); this call carries
# .gguf/smol.gguf.part.1 and .whl, the head back in the tree. Shrinking's A/B in one process: every row
# at batch 4 and 16 timed with shrinking off and, on the same speculator and graphs, on ("+shrink" rows,
# passes alternating; --shrink-ab). The sizes it shrinks onto (1, 4) run first. ~480 s.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
timeout ${T_E2E:-560} python3 -m treecompile.bench e2e --model smollm2 --prompts 48 --max-new-tokens 256 --inductor \
  --repeats 2 --batch-sizes 1,4,16 --configs tc_plain,tc_tree --trees "${TREES:-4,4,16}" --shrink-ab \
  --json "$OUT/e2e_ab.json" > "$OUT/e2e_ab.log" 2>&1
echo "e2e ab rc=$?"; grep "^\[e2e\] batch" "$OUT/e2e_ab.log" | grep -v warm-up
