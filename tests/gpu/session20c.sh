#!/usr/bin/env bash
# Fourteenth session, third device call (carry .gguf/smol.gguf.part.ac): SmolLM2 assembled; the kernel tables of
# a SmolLM2-shaped draft and verify round under every default (plain decode and the (8, 6, 64) tree, the
# shipped head's 8k draft vocabulary; issue 5's tree / plain ratio needs to know where a round goes); then
# e2e batch 1 with HF static + compile in the same process.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
mkdir -p "$OUT/prof"
SHAPES="1,1,1;8,6,64" DRAFT_VOCAB=8192 timeout 150 python3 tests/gpu/loop_profile.py "$OUT/loop_profile.json" \
  "$OUT/prof" fused-only > "$OUT/loop_profile.log" 2>&1
echo "loop_profile rc=$?"; grep -E "^\{" "$OUT/loop_profile.log" | cut -c1-400
E="treecompile.bench e2e --model smollm2 --prompts 12 --max-new-tokens 256 --inductor --repeats 2"
timeout 330 python3 -m $E --batch-sizes 1 --trees 8,6,64 --configs hf_compile,tc_plain,tc_chain,tc_tree \
  --json "$OUT/e2e_b1.json" --plot "$OUT/e2e_b1.png" > "$OUT/e2e_b1.log" 2>&1
echo "e2e b1 rc=$?"; grep -E "^\| 1" "$OUT/e2e_b1.log" | tail -6
