#!/usr/bin/env bash
# Twentieth session, fifth call (carry .gguf/smol.gguf.part.1; the head back in the working tree): SmolLM2
# assembled; e2e batch 1 with the pairwise-count ranking: plain and (8, 6, 64) per-hook draft, then (8, 6, 64)
# with the whole draft round compiled.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "SmolLM2 not assembled"; exit 3; }
timeout ${T1:-220} python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --repeats 2 --configs tc_plain,tc_tree --trees "8,6,64" --json "$OUT/e2e_b1.json" > "$OUT/e2e_b1.log" 2>&1
echo "e2e b1 rc=$?"; grep -E "^\|" "$OUT/e2e_b1.log" | tail -4
TREECOMPILE_COMPILED_DRAFT=1 timeout ${T2:-170} python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 \
  --prompts 12 --max-new-tokens 256 --inductor --repeats 2 --configs tc_tree --trees "8,6,64" \
  --json "$OUT/e2e_b1_draft.json" > "$OUT/e2e_b1_draft.log" 2>&1
echo "e2e b1 compiled draft rc=$?"; grep -E "^\|" "$OUT/e2e_b1_draft.log" | tail -3
