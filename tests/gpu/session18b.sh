#!/usr/bin/env bash
# Thirteenth session, second device call (carry .gguf/smol.gguf.part.ab): 8B rounds, one process each, all
# with the shipped skinny table: as shipped; the cascade variant cascade_ab.py chose (/tmp/cascade_env);
# every kernel a dependent launch (ours and Inductor's); both. Issue 4: decode <= 4.39 ms, verify <= 1.15x.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
cp .gguf/smol.gguf.part.* /tmp/models/ 2>/dev/null
CE=$(cat /tmp/cascade_env 2>/dev/null)
echo "cascade variant: '$CE'"
R="treecompile.bench rounds --inductor --nodes 64 --reps 10 --skinny-linears"
rounds() {  # name, limit, env...
  local name=$1 limit=$2; shift 2
  env "$@" timeout "$limit" python3 -m $R --json "$OUT/rounds_$name.json" > "$OUT/rounds_$name.log" 2>&1
  echo "rounds $name rc=$?"; grep -E "^\| treecompile" "$OUT/rounds_$name.log" | cut -c1-100
}
rounds skinny 170 TREECOMPILE_PDL=0
if [ -n "$CE" ] && [ "$CE" != "tma=0,merge_rows=1,merge_warps=4" ]; then  # a variant beat the default
  rounds cascade 120 TREECOMPILE_PDL=0 TREECOMPILE_CASCADE="$CE"
  rounds pdl_all 140 TREECOMPILE_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1
  rounds pdl_cascade 110 TREECOMPILE_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1 TREECOMPILE_CASCADE="$CE"
else  # the default won: dependent launches of ours alone, then of every kernel
  rounds pdl_ours 120 TREECOMPILE_PDL=1
  rounds pdl_all 140 TREECOMPILE_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1
fi
