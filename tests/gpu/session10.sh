#!/usr/bin/env bash
# Eighth GPU session's daemon (after tests/gpu/smol_setup.sh; follow with tests/gpu/watch.sh; replaces the seventh session's session9.sh). Measures this
# session's round changes (rank_order one sort, the drafter's elementwise rope, 256-entry top-k slices, 128-key
# verify chunks for small models, vocab_argmax) end to end:
#   1. the whole -m gpu suite while the float32 e2e checks every treecompile row against HF greedy on SmolLM2;
#   2. e2e batch 1, every row timed twice (--repeats 2), HF static + compile side by side, three trees;
#   3. 8B rounds.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }

stage "gpu tests + e2e float32"
timeout 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$P/gpu_tests.log" 2>&1 &
tests=$!
timeout 420 python3 -m treecompile.bench e2e --model smollm2 --dtype float32 --batch-sizes 1 --prompts 12 \
  --max-new-tokens 128 --configs hf_eager,tc_plain,tc_tree --trees "8,6,64;4,6,32" --json "$P/e2e_fp32.json" \
  > "$P/e2e_fp32.log" 2>&1
stage "e2e float32 rc=$?"
wait $tests
stage "gpu tests rc=$? $(tail -1 "$P/gpu_tests.log")"

timeout 600 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --trees "8,6,64;8,7,64;4,6,32" --repeats 2 --json "$P/e2e_b1.json" --plot "$P/e2e_b1.png" \
  > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"

timeout 240 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$P/rounds.json" 2>&1 \
  | grep "^| treecompile\|^c =" > "$P/rounds.log"
stage "rounds done"
stage "DONE"
