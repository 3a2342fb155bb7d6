#!/usr/bin/env bash
# Sixth GPU session's daemon (start with setsid after tests/gpu/smol_setup.sh has assembled the GGUF; follow
# with tests/gpu/watch.sh). In order of what it decides:
#   1. the lookahead loop is lossless on the GPU (its tests + the captured-round tests), then its A/B at
#      SmolLM2 shapes (tests/gpu/loop_profile.py: rounds synced vs one ahead, interleaved, with kernel tables);
#   2. issue 5's table in ONE run: HF eager, HF static + compile, treecompile plain / chain / trees, batch 1,
#      with the plot (the 20x target needs HF static + compile side by side);
#   3. float32 on the GPU (every treecompile row's text equals plain greedy) while the whole -m gpu suite runs
#      (both correctness only: they may share the GPU);
#   4. kernel tables of the fused 8B rounds; the cascade split sweep for few rows; batch 4 and 16.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
P=${P:-/tmp/pipe}
mkdir -p "$P/prof"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }

stage "lookahead tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_speculator_gpu.py > "$P/gpu_spec_tests.log" 2>&1
stage "lookahead tests rc=$? $(tail -1 "$P/gpu_spec_tests.log")"

timeout 420 python3 tests/gpu/loop_profile.py "$P/loop.json" "$P/prof" fused-only > "$P/loop.log" 2>&1
stage "loop profile rc=$?"

timeout 900 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --trees "8,6,64;4,6,32" --json "$P/e2e_b1.json" --plot "$P/e2e_b1.png" > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"

timeout 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$P/gpu_tests.log" 2>&1 &
tests=$!
timeout 420 python3 -m treecompile.bench e2e --model smollm2 --dtype float32 --batch-sizes 1 --prompts 12 \
  --max-new-tokens 128 --configs hf_eager,tc_plain,tc_tree --trees "8,6,64;4,6,32" --json "$P/e2e_fp32.json" \
  > "$P/e2e_fp32.log" 2>&1
stage "e2e float32 rc=$?"
wait $tests
stage "gpu tests rc=$? $(tail -1 "$P/gpu_tests.log")"

timeout 240 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --profile "$P/prof" \
  --json "$P/rounds_prof.json" 2>&1 | grep "^| treecompile\|^c =" > "$P/rounds.log"
stage "rounds done"

OUT=$P bash tests/gpu/next_sweep.sh > "$P/sweep.log" 2>&1
stage "sweep done"

timeout 600 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 4,16 --prompts 16 --max-new-tokens 256 \
  --inductor --configs hf_eager,tc_plain,tc_tree --trees "8,6,64;4,6,32" --json "$P/e2e_b416.json" \
  --plot "$P/e2e_b416.png" > "$P/e2e_b416.log" 2>&1
stage "e2e batch 4,16 rc=$?"
stage "DONE"
