#!/usr/bin/env bash
# Ninth GPU session's daemon, run on branch next/merged (after tests/gpu/smol_setup.sh; follow with
# tests/gpu/watch.sh; replaces session10.sh):
#   0. round_parts.py ab3 alone: main / rope pass / lane glue / both, graph times, tokens compared;
#   1. the whole -m gpu suite on the merged code while the float32 e2e checks five trees against HF greedy;
#   2. round_gaps.py: CUDA events around each graph replay inside a real request;
#   3. e2e batch 1 bf16, every row timed twice, with the 4-step trees the CPU tau sweep picked (HF eager left
#      out: it costs ~3 min and was 37.7 tokens/s last session; plain and HF static + compile stay side by side);
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
P=${P:-/tmp/pipe}
mkdir -p "$P/ab3"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
TREES="8,6,64;8,4,64;16,4,64;12,4,64"

stage "ab3"
TORCHINDUCTOR_CACHE_DIR=/tmp/ic timeout 300 python3 tests/gpu/round_parts.py "$P/ab3" ab3 > "$P/ab3.log" 2>&1
stage "ab3 rc=$? $(grep -c '"variant"' "$P/ab3.log") rows; $(grep 'identical' "$P/ab3.log")"

stage "gpu tests + e2e float32"
timeout 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$P/gpu_tests.log" 2>&1 &
tests=$!
timeout 480 python3 -m treecompile.bench e2e --model smollm2 --dtype float32 --batch-sizes 1 --prompts 12 \
  --max-new-tokens 128 --configs hf_eager,tc_plain,tc_tree --trees "8,6,64;8,4,64;16,4,64" --json "$P/e2e_fp32.json" \
  > "$P/e2e_fp32.log" 2>&1
stage "e2e float32 rc=$?"
wait $tests
stage "gpu tests rc=$? $(tail -1 "$P/gpu_tests.log")"

timeout 240 python3 tests/gpu/round_gaps.py "$P/round_gaps.json" > "$P/round_gaps.log" 2>&1
stage "round_gaps rc=$?"

timeout 600 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --configs hf_compile,tc_plain,tc_chain,tc_tree --trees "$TREES" --repeats 2 \
  --json "$P/e2e_b1.json" --plot "$P/e2e_b1.png" > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"

stage "DONE"
