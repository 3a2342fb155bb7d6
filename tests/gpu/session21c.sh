#!/usr/bin/env bash
# Next session's plan, third device call (carry .gguf/smol.gguf.part.ac): the stage-1 tile sweep at the 8B verify and
# decode shapes; SmolLM2 assembled; e2e batch 1 (every config, HF static + compile in the same process).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
timeout 100 python3 tests/gpu/tile_sweep.py "$OUT/tile_sweep.json" "2048:64,2048:1" > "$OUT/tile_sweep.log" 2>&1
echo "tile sweep rc=$?"; grep -E "shipped|best" "$OUT/tile_sweep.log" | cut -c1-140
bash tests/gpu/smol_setup.sh || exit 3
E="treecompile.bench e2e --model smollm2 --prompts 12 --max-new-tokens 256 --inductor --repeats 2"
timeout 330 python3 -m $E --batch-sizes 1 --trees 8,6,64 --configs hf_compile,tc_plain,tc_chain,tc_tree \
  --json "$OUT/e2e_b1.json" --plot "$OUT/e2e_b1.png" > "$OUT/e2e_b1.log" 2>&1
echo "e2e b1 rc=$?"; grep -E "^\| 1" "$OUT/e2e_b1.log" | tail -6
