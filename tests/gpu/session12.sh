#!/usr/bin/env bash
# Tenth GPU session's daemon, branch next/skinny-linear (after tests/gpu/smol_setup.sh; follow with
# tests/gpu/watch.sh). Does treespec::skinny_linear (Triton tiles for <= 64-row GEMMs) beat cuBLAS?
#   1. its GPU tests (op against float64, graph replay; a speculator with skinny_linears=True);
#   2. the tile sweep on cold weights, every round shape (SmolLM2 target + head, 8B target + head);
#   3. round graphs off / on with the sweep's tiles (round_parts ab4), tokens compared;
#   4. 8B rounds off / on; 5. SmolLM2 e2e batch 1 plain + (8, 6, 64) off / on, each row timed twice;
#   6. the whole -m gpu suite.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
P=${P:-/tmp/pipe}
mkdir -p "$P/ab4"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
T="python3 tests/gpu/skinny_table.py $P/skinny_sweep.json"

stage "skinny gpu tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_skinny_linear.py \
  tests/runtime/test_speculator_gpu.py -k "skinny or gpu_matches" > "$P/skinny_tests.log" 2>&1
stage "skinny gpu tests rc=$? $(tail -1 "$P/skinny_tests.log")"

timeout 420 python3 tests/gpu/skinny_sweep.py "$P/skinny_sweep.json" > "$P/skinny_sweep.log" 2>&1
stage "sweep rc=$? $(grep -c cuBLAS "$P/skinny_sweep.log") shapes"

timeout 360 $T tests/gpu/round_parts.py "$P/ab4" ab4 > "$P/ab4.log" 2>&1
stage "ab4 rc=$? $(grep 'tokens equal' "$P/ab4.log" | tr '\n' ' ')"

for flag in --no-skinny-linears --skinny-linears; do
  timeout 200 $T treecompile.bench rounds --inductor --nodes 64 --reps 10 $flag --json "$P/rounds$flag.json" 2>&1 \
    | grep "^| treecompile\|^c =" > "$P/rounds$flag.log"
  stage "8B rounds $flag done"
done

for flag in --no-skinny-linears --skinny-linears; do
  timeout 300 $T treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
    --inductor --configs tc_plain,tc_tree --trees "8,6,64" --repeats 2 $flag --json "$P/e2e$flag.json" \
    > "$P/e2e$flag.log" 2>&1
  stage "e2e $flag rc=$?"
done

timeout 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$P/gpu_tests.log" 2>&1
stage "gpu tests rc=$? $(tail -1 "$P/gpu_tests.log")"
stage "DONE"
