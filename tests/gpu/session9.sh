#!/usr/bin/env bash
# Seventh GPU session's daemon (after tests/gpu/smol_setup.sh; follow with tests/gpu/watch.sh; replaces the unrun session8.sh). Measures the
# captured prefill chunk (request_probe.py found an eager SmolLM2 prefill chunk costs ~40 ms of host launches)
# and what the sixth session left unmeasured (the one-tile split rule for few rows):
#   1. the whole -m gpu suite (the new captured-prefill tests, the cascade with the split rule) while the float32
#      e2e checks every treecompile row against HF greedy on SmolLM2;
#   2. e2e batch 1, every row timed 3x (--repeats 3), HF static + compile side by side;
#   3. 8B rounds; 4. e2e batch 4 and 16.
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

timeout 900 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --trees "8,6,64;4,6,32" --repeats 3 --json "$P/e2e_b1.json" --plot "$P/e2e_b1.png" > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"

timeout 240 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$P/rounds.json" 2>&1 \
  | grep "^| treecompile\|^c =" > "$P/rounds.log"
stage "rounds done"

timeout 600 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 4,16 --prompts 16 --max-new-tokens 256 \
  --inductor --configs hf_eager,tc_plain,tc_tree --trees "8,6,64;4,6,32" --json "$P/e2e_b416.json" \
  --plot "$P/e2e_b416.png" > "$P/e2e_b416.log" 2>&1
stage "e2e batch 4,16 rc=$?"
stage "DONE"
