#!/usr/bin/env bash
# Twelfth-session plan, first device call after tests/gpu/smol_setup.sh (foreground, <= 560 s; logs and
# JSON in $OUT):
# 1. the GPU tests never run yet: skinny_linear's (gemv_pdl in the speculator, the constant_weight split,
#    MMA kernel under TREECOMPILE_PDL), the cascade as dependent launches after a kernel writing q, and the
#    whole speculator with every kernel a dependent launch (tokens must not change);
# 2. 8B rounds, one process each: skinny with the shipped gemv table; + TREECOMPILE_PDL=1 (our kernels);
#    + TORCHINDUCTOR_ENABLE_PDL=1 (Inductor's too). Issue 4's decode target needs 4.39 ms.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
python3 -c "import torch._inductor.config as c; print('inductor enable_pdl:', hasattr(c, 'triton.enable_pdl'))"
timeout 220 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/ops/test_skinny_linear.py \
  tests/ops/test_tree_attention.py > "$OUT/ops_tests.log" 2>&1
echo "ops tests rc=$? $(tail -1 "$OUT/ops_tests.log")"
timeout 200 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/runtime/test_speculator_gpu.py \
  -k "skinny_linears or dependent" > "$OUT/spec_tests.log" 2>&1
echo "speculator tests rc=$? $(tail -1 "$OUT/spec_tests.log")"
R="treecompile.bench rounds --inductor --nodes 64 --reps 10 --skinny-linears"
rounds() {  # name, env...
  local name=$1; shift
  env "$@" timeout 130 python3 -m $R --json "$OUT/rounds_$name.json" > "$OUT/rounds_$name.log" 2>&1
  echo "rounds $name rc=$? $(grep '^| treecompile' "$OUT/rounds_$name.log" | cut -c1-60 | tr '\n' ' ')"
}
rounds skinny TREECOMPILE_PDL=0
rounds pdl_ours TREECOMPILE_PDL=1
rounds pdl_all TREECOMPILE_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1
