#!/usr/bin/env bash
# Eighteenth session's second device call (carry .gguf/smol.gguf.part.1; the shipped head back in the working
# tree): SmolLM2 assembled; e2e batch 1 with the seventeenth session's head (held-out CPU tau 3.285 on (8, 6, 64)
# against the old head's 3.068; no GPU numbers yet): plain and four trees from the CPU tau ranking, (12, 6, 64)
# 3.319 and (8, 6, 64) 3.285 beside the 5-step (16, 5, 64) 3.291 and (12, 5, 64) 3.285 (one draft step fewer for
# the same tau; (8, 5, 64) 3.257 is left out); then the (8, 6, 64) row with the whole draft round compiled.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "SmolLM2 not assembled"; exit 3; }
timeout 330 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --repeats 2 --configs tc_plain,tc_tree --trees "8,6,64;12,6,64;16,5,64;12,5,64" --json "$OUT/e2e_b1.json" \
  > "$OUT/e2e_b1.log" 2>&1
echo "e2e b1 rc=$?"; grep -E "^\|" "$OUT/e2e_b1.log" | tail -6
TREECOMPILE_COMPILED_DRAFT=1 timeout 200 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 \
  --prompts 12 --max-new-tokens 256 --inductor --repeats 2 --configs tc_tree --trees "8,6,64" \
  --json "$OUT/e2e_b1_draft.json" > "$OUT/e2e_b1_draft.log" 2>&1
echo "e2e b1 compiled draft rc=$?"; grep -E "^\|" "$OUT/e2e_b1_draft.log" | tail -3
