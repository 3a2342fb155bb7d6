#!/usr/bin/env bash
# Twelfth-session plan, second device call (same machine, warm Inductor cache for the tc rows): SmolLM2 e2e
# batch 1 in one call: HF static + compile, tc plain and (8, 6, 64) with skinny_linears off, then on, then
# on with every kernel a dependent launch. Issue 5: tree >= 20x HF static + compile, >= 2x its own plain.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
E="treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 --inductor --trees 8,6,64 --repeats 2"
e2e() {  # name, limit, extra args, env...
  local name=$1 limit=$2 extra=$3; shift 3
  env "$@" timeout "$limit" python3 -m $E $extra --json "$OUT/e2e_$name.json" > "$OUT/e2e_$name.log" 2>&1
  echo "e2e $name rc=$?"; grep "^|" "$OUT/e2e_$name.log" | tail -4
}
e2e main 220 "--configs hf_compile,tc_plain,tc_tree" TREECOMPILE_PDL=0
e2e skinny 150 "--configs tc_plain,tc_tree --skinny-linears" TREECOMPILE_PDL=0
e2e skinny_pdl 150 "--configs tc_plain,tc_tree --skinny-linears" TREECOMPILE_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1
