#!/usr/bin/env bash
# Next session's plan, third device call (carry .gguf/smol.gguf.part.ac): SmolLM2 assembled; e2e batch 1, plain and
# tree (8, 6, 64) with every default (HF static + compile in the same process), then with the three launch savers
# on (issue 5: the top-k merge and the draft fold are tree-only savings; the cascade's fused merge also speeds the
# plain decode).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
E="treecompile.bench e2e --model smollm2 --prompts 12 --max-new-tokens 256 --inductor --repeats 2 --batch-sizes 1"
timeout 260 python3 -m $E --trees 8,6,64 --configs hf_compile,tc_plain,tc_tree \
  --json "$OUT/e2e_b1.json" > "$OUT/e2e_b1.log" 2>&1
echo "e2e b1 rc=$?"; grep -E "^\| 1" "$OUT/e2e_b1.log" | tail -4
TREECOMPILE_TOPK_FUSED_MERGE=1 TREECOMPILE_DRAFT_FOLD=1 TREECOMPILE_COMPILED_COMMIT=1 timeout 220 \
  python3 -m $E --trees 8,6,64 --configs tc_plain,tc_tree --json "$OUT/e2e_b1_fused.json" > "$OUT/e2e_b1_fused.log" 2>&1
echo "e2e b1 fused rc=$?"; grep -E "^\| 1" "$OUT/e2e_b1_fused.log" | tail -3
