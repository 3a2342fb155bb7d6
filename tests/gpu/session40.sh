#!/usr/bin/env bash
# Twenty-seventh session, right after tests/gpu/session39.sh on the same machine (GGUF assembled; carry .whl):
# batch 1 over all 56 held-out prompts, plain against (4, 4, 16) and (10, 6, 64), one process. ~260 s.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f /tmp/models/ready ] || { echo "GGUF not assembled: run session27.sh + session39.sh first"; exit 3; }
timeout ${T_E2E:-330} python3 -m treecompile.bench e2e --model smollm2 --prompts 56 --max-new-tokens 256 --inductor \
  --repeats 1 --batch-sizes 1 --configs tc_plain,tc_tree --trees "${TREES:-4,4,16;10,6,64}" \
  --json "$OUT/e2e_b1_56.json" > "$OUT/e2e_b1_56.log" 2>&1
echo "e2e b1 rc=$?"; grep "^\[e2e\] batch" "$OUT/e2e_b1_56.log" | grep -v warm-up
