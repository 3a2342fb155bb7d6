#!/usr/bin/env bash
# Next session's plan, third device call (carry .gguf/smol.gguf.part.ac): SmolLM2 assembled; e2e batch 1 with every
# default (every config, HF static + compile in the same process); then plain and tree again with L2 hints before
# the dependency waits (cascade and skinny GEMMs, four tiles a program), the A/B for issue 5's small kernels.
# If device time is left after this call: tests/gpu/tile_sweep.py (stage-1 tiles at the 8B shapes, ~100 s).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
E="treecompile.bench e2e --model smollm2 --prompts 12 --max-new-tokens 256 --inductor --repeats 2 --batch-sizes 1"
timeout 330 python3 -m $E --trees 8,6,64 --configs hf_compile,tc_plain,tc_chain,tc_tree \
  --json "$OUT/e2e_b1.json" --plot "$OUT/e2e_b1.png" > "$OUT/e2e_b1.log" 2>&1
echo "e2e b1 rc=$?"; grep -E "^\| 1" "$OUT/e2e_b1.log" | tail -6
TREECOMPILE_CASCADE=l2_prefetch=4 TREECOMPILE_SKINNY_L2_PREFETCH=4 timeout 200 python3 -m $E --trees 8,6,64 \
  --configs tc_plain,tc_tree --json "$OUT/e2e_b1_l2.json" > "$OUT/e2e_b1_l2.log" 2>&1
echo "e2e b1 l2 rc=$?"; grep -E "^\| 1" "$OUT/e2e_b1_l2.log" | tail -3
