#!/usr/bin/env bash
# Twenty-fifth session, second and third device calls (after tests/gpu/session27.sh with GGUF part 0, the shipped
# head moved out; this call carries .gguf/smol.gguf.part.1 and .whl, the head back in the tree). loop_profile
# (first call, random weights) put a batch-16 (4, 6, 32) round at 2.3 plain steps, which at tau ~3.2 should win;
# e2e measured 0.86x on 16 prompts. The per-prompt rounds of the 56-prompt CPU run say why: a batch runs until
# its slowest request, which cuts the effective tau at batch 16 from 3.29 to 2.69. This measures it on the GPU:
# e2e batch 16 and 4, the first 48 held-out prompts (batches must be full: 3 of 16), plain and four trees down to (2, 3, 6), with each row's occupancy
# (the share of request-round slots still running) and rounds per batch.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
timeout ${T_E2E:-500} python3 -m treecompile.bench e2e --model smollm2 --batch-sizes ${BATCHES:-16,4} --prompts ${PROMPTS:-48} \
  --max-new-tokens 256 --inductor --repeats 1 --configs tc_plain,tc_tree --trees "${TREES:-4,6,32;4,4,16;2,3,6;8,6,64}" \
  --json "$OUT/e2e_batch.json" > "$OUT/e2e_batch.log" 2>&1
echo "e2e rc=$?"; tail -16 "$OUT/e2e_batch.log"
