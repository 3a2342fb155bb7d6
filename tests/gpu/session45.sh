#!/usr/bin/env bash
# Thirtieth session, right after tests/gpu/session27.sh (GGUF part 0; head and notes/ out of the tree); carry
# .gguf/smol.gguf.part.1 and .whl, the head back. SmolLM2 at batch 1, 4 and 16 (48 prompts, shrinking on, every
# default: now the compiled draft round and a code object per batch size). Until the twenty-ninth session the
# per-hook draft lanes compiled one variant per step on one code object: at (4, 4, 16) the third batch size passed
# Dynamo's recompile limit (8) and its lanes ran eager. Compare with the twenty-seventh session's batch 4 (1.83x)
# and batch 16 (2, 3, 6) 1.26x. ~450 s.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
timeout ${T_E2E:-540} python3 -m treecompile.bench e2e --model smollm2 --prompts 48 --max-new-tokens 256 --inductor \
  --repeats 2 --batch-sizes 1,4,16 --configs tc_plain,tc_tree --trees "${TREES:-4,4,16;2,3,6}" \
  --json "$OUT/e2e_batch.json" > "$OUT/e2e_batch.log" 2>&1
echo "e2e rc=$?"; grep "^\[e2e\] batch" "$OUT/e2e_batch.log" | grep -v warm-up
