#!/usr/bin/env bash
# Eleventh session's daemon, on main (after tests/gpu/smol_setup.sh; follow with tests/gpu/watch.sh within
# 30 s of every call's end: the device is released after 30 s idle and this daemon dies with it).
# 1. skinny_linear's GPU tests (the new gemv kernel, plain and as a dependent launch, in graphs);
# 2. the gemv sweep: <= 8-row shapes, cuBLAS / MMA tiles / gemv tiles / gemv + PDL, cold weights;
# 3. 8B rounds: main (skinny off), then --skinny-linears with the sweep's table (issue 4's decode ratio);
# 4. the whole -m gpu suite (not run on the merged main yet);
# 5. SmolLM2 e2e batch 1: HF static + compile, tc plain, (8, 6, 64) on main; then the same tc rows with
#    --skinny-linears and the sweep's table.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
stage "skinny op tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/ops/test_skinny_linear.py > "$P/skinny_tests.log" 2>&1
stage "skinny op tests rc=$? $(tail -1 "$P/skinny_tests.log")"
timeout 330 python3 tests/gpu/skinny_sweep.py "$P/gemv_sweep.json" gemv > "$P/gemv_sweep.log" 2>&1
stage "gemv sweep rc=$?"
R="treecompile.bench rounds --inductor --nodes 64 --reps 10"
timeout 150 python3 -m $R --json "$P/rounds_main.json" > "$P/rounds_main.log" 2>&1
stage "rounds main rc=$? $(grep '^| treecompile' "$P/rounds_main.log" | cut -c1-70 | tr '\n' ' ')"
timeout 150 python3 tests/gpu/variant.py --table "$P/gemv_sweep.json" $R --skinny-linears --json "$P/rounds_gemv.json" > "$P/rounds_gemv.log" 2>&1
stage "rounds gemv rc=$? $(grep '^| treecompile' "$P/rounds_gemv.log" | cut -c1-70 | tr '\n' ' ')"
timeout 480 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests --ignore=tests/ops/test_skinny_linear.py > "$P/gpu_tests.log" 2>&1
stage "gpu tests rc=$? $(tail -1 "$P/gpu_tests.log")"
E="treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 --inductor --trees 8,6,64 --repeats 2"
timeout 420 python3 -m $E --configs hf_compile,tc_plain,tc_tree --json "$P/e2e_main.json" --plot "$P/e2e_main.png" > "$P/e2e_main.log" 2>&1
stage "e2e main rc=$?"
timeout 200 python3 tests/gpu/variant.py --table "$P/gemv_sweep.json" $E --configs tc_plain,tc_tree --skinny-linears \
  --json "$P/e2e_gemv.json" > "$P/e2e_gemv.log" 2>&1
stage "e2e gemv rc=$?"
stage "DONE"
