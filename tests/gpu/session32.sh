#!/usr/bin/env bash
# Twenty-fifth session, first device call (carry .whl; random weights, no GGUF): why trees lose to plain decode at
# batch 16 (e2e: plain 12940 tokens/s, (4, 6, 32) 11182 at tau 3.19: a round costs 3.7 plain steps there against
# 1.9 at batch 1). loop_profile at batch 16 and 1 for plain, (4, 6, 32) and (8, 6, 64), Inductor + fused
# projections, 12288-id head: draft / verify graph times and their kernel tables.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/prof"
bash tests/gpu/install.sh || exit 3
R=$PWD; cd /tmp  # the repository root would shadow the installed package
BATCHES=${BATCHES:-16,1} SHAPES=${SHAPES:-"1,1,1;4,6,32;8,6,64"} DRAFT_VOCAB=12288 timeout ${T_PROF:-420} \
  python3 $R/tests/gpu/loop_profile.py "$OUT/loop_profile_batch.json" "$OUT/prof" fused-only > "$OUT/loop_profile_batch.log" 2>&1
echo "loop_profile rc=$?"
python3 - "$OUT/loop_profile_batch.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if "error" in r:
        print(r["shape"], r.get("batch"), r["error"][:300]); continue
    print(r["shape"], "B", r["batch"], "round %.3f (sync %.3f) draft %.3f verify %.3f idle %.3f ms" % (
        r["ms_per_round_lookahead"], r["ms_per_round_sync"], r["draft_gpu_ms"], r["verify_commit_gpu_ms"],
        r["idle_ms_per_round_lookahead"]))
PY
ls "$OUT/prof"
