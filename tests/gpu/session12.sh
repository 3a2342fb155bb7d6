#!/usr/bin/env bash
# Tenth GPU session's daemon, branch next/merged2 = main + skinny-linear + attn-write (after
# tests/gpu/smol_setup.sh; follow with tests/gpu/watch.sh). Two unmeasured changes:
#   fold   - each layer's kv_write inside its attention call (pass fuse_cache_write, on by default on CUDA);
#   skinny - few-row GEMMs on treespec::skinny_linear (TreeSpeculator(skinny_linears=True), off by default).
# 1. their GPU tests; 2. the skinny tile sweep against cuBLAS on cold weights; 3. round graphs main / fold /
# skinny / both (round_parts ab5, skinny on the sweep's tiles); 4. 8B rounds main vs both; 5. SmolLM2 e2e
# batch 1 main vs both (plain + (8, 6, 64), each row timed twice); 6. the whole -m gpu suite.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
P=${P:-/tmp/pipe}
mkdir -p "$P/ab5"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
V="python3 tests/gpu/variant.py --table $P/skinny_sweep.json"

stage "new gpu tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_skinny_linear.py \
  tests/ops/test_tree_attention_write.py tests/runtime/test_speculator_gpu.py > "$P/new_tests.log" 2>&1
stage "new gpu tests rc=$? $(tail -1 "$P/new_tests.log")"

timeout 360 python3 tests/gpu/skinny_sweep.py "$P/skinny_sweep.json" > "$P/skinny_sweep.log" 2>&1
stage "sweep rc=$? $(grep -c cuBLAS "$P/skinny_sweep.log") shapes"

timeout 360 $V tests/gpu/round_parts.py "$P/ab5" ab5 > "$P/ab5.log" 2>&1
stage "ab5 rc=$? $(grep 'tokens equal' "$P/ab5.log" | tr '\n' ' ')"

timeout 200 $V --no-fold treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$P/rounds_main.json" 2>&1 \
  | grep "^| treecompile\|^c =" > "$P/rounds_main.log"
timeout 200 $V treecompile.bench rounds --inductor --nodes 64 --reps 10 --skinny-linears --json "$P/rounds_both.json" 2>&1 \
  | grep "^| treecompile\|^c =" > "$P/rounds_both.log"
stage "8B rounds done"

E="treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 --inductor --configs tc_plain,tc_tree --trees 8,6,64 --repeats 2"
timeout 300 $V --no-fold $E --json "$P/e2e_main.json" > "$P/e2e_main.log" 2>&1
stage "e2e main rc=$?"
timeout 300 $V $E --skinny-linears --json "$P/e2e_both.json" > "$P/e2e_both.log" 2>&1
stage "e2e both rc=$?"

timeout 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$P/gpu_tests.log" 2>&1
stage "gpu tests rc=$? $(tail -1 "$P/gpu_tests.log")"
stage "DONE"
