#!/usr/bin/env bash
# Thirteenth session, third device call (carry .gguf/smol.gguf.part.ac): assemble the SmolLM2 GGUF, then the
# SmolLM2 e2e, batch 1, 12 held-out prompts, 256 tokens, skinny on: (A) HF static + compile, tc plain and
# (8, 6, 64) in one process; (B) the same tc rows with every kernel a dependent launch. Issue 5: tree >= 20x
# HF static + compile and >= 2x its own plain decode, in one run.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
E="treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 --inductor --trees 8,6,64 --repeats 2 --skinny-linears"
e2e() {  # name, limit, extra args, env...
  local name=$1 limit=$2 extra=$3; shift 3
  env "$@" timeout "$limit" python3 -m $E $extra --json "$OUT/e2e_$name.json" > "$OUT/e2e_$name.log" 2>&1
  echo "e2e $name rc=$?"; grep -E "^\[e2e\] batch|^\|" "$OUT/e2e_$name.log" | tail -8
}
e2e skinny 330 "--configs hf_compile,tc_plain,tc_tree" TREECOMPILE_PDL=0 TREECOMPILE_CASCADE="$(cat /tmp/cascade_env)"
e2e skinny_pdl 180 "--configs tc_plain,tc_tree" TREECOMPILE_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1 TREECOMPILE_CASCADE="$(cat /tmp/cascade_env)"
