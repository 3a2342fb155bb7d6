#!/usr/bin/env bash
# Next GPU session's daemon (after tests/gpu/smol_setup.sh; follow with tests/gpu/watch.sh). Measures what the
# sixth session changed without measuring it, and the spread it could not explain:
#   1. the GPU tests of the touched paths (cascade split rule: tree attention ops; rounds);
#   2. e2e batch 1 with every tree row timed 3x (--repeats 3; the sixth session's (8,6,64) row read 10% below
#      the fifth's in a single pass), HF static + compile side by side, the one-tile split rule in place;
#   3. 8B rounds (the split rule at N=1 / N=64 over a 2k cache) and the attention table (issue 3's floors).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }

stage "gpu tests (attention, speculator)"
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_tree_attention.py \
  tests/runtime/test_speculator_gpu.py > "$P/gpu_spec_tests.log" 2>&1
stage "gpu tests rc=$? $(tail -1 "$P/gpu_spec_tests.log")"

timeout 900 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --trees "8,6,64;4,6,32" --repeats 3 --json "$P/e2e_b1.json" --plot "$P/e2e_b1.png" > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"

timeout 240 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$P/rounds.json" 2>&1 \
  | grep "^| treecompile\|^c =" > "$P/rounds.log"
stage "rounds done"

timeout 420 python3 -m treecompile.bench attention --json "$P/attention.json" > "$P/attention.log" 2>&1
stage "attention rc=$?"
stage "DONE"
