#!/usr/bin/env bash
# Next session's plan, third device call (carry .gguf/smol.gguf.part.ac): SmolLM2 e2e batch 1 with every
# default (skinny, dependent launches, TMA, the merge rule), HF static + compile in the same process; then
# batch 4 and 16 (not measured since the sixth session).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
E="treecompile.bench e2e --model smollm2 --prompts 12 --max-new-tokens 256 --inductor --repeats 2"
timeout 330 python3 -m $E --batch-sizes 1 --trees 8,6,64 --configs hf_compile,tc_plain,tc_chain,tc_tree \
  --json "$OUT/e2e_b1.json" --plot "$OUT/e2e_b1.png" > "$OUT/e2e_b1.log" 2>&1
echo "e2e b1 rc=$?"; grep -E "^\| 1" "$OUT/e2e_b1.log" | tail -6
timeout 200 python3 -m $E --batch-sizes 4,16 --trees 4,6,32 --configs tc_plain,tc_tree \
  --json "$OUT/e2e_b416.json" --plot "$OUT/e2e_b416.png" > "$OUT/e2e_b416.log" 2>&1
echo "e2e b4/16 rc=$?"; grep -E "^\| (4|16)" "$OUT/e2e_b416.log" | tail -6
