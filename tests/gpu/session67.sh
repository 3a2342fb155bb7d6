#!/usr/bin/env bash
# Issue 4 (carry .whl; ~120 s + a cold start). The 8B rounds' logs show Dynamo compiling ``linear_rows`` as a
# frame of its own until its recompile limit: a graph break inside it (the drafter calls it from Python in its
# compiled round), ``min(..., key=...)`` in measured_tiles, a loop since this session. 1. graph breaks of a tiny
# speculator's rounds, old vs new; 2. the GPU tests that guard recompiles and skinny routing.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
timeout ${T_PROBE:-150} python3 tests/gpu/graph_breaks.py "$OUT/graph_breaks.json" 2>&1 | grep -v "^INFO\|^W1205\|Warning\|warn_once\|^$\|^  " \
  | tee "$OUT/graph_breaks.log" | cut -c1-300
timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_speculator_gpu.py \
  -k "never_recompile or skinny_linears_on_cuda or compiled_draft_round" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
