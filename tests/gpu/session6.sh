#!/usr/bin/env bash
# Next GPU session's daemon (start with setsid after tests/gpu/smol_setup.sh has assembled the GGUF; follow
# with tests/gpu/watch.sh). What the fifth session left unmeasured, by what it decides:
#   1. issue 5's table in ONE run: HF eager, HF static + compile, treecompile plain / chain / trees at batch 1
#      (the 20x target needs HF static + compile side by side, not the second session's 82.8), with the plot;
#   2. float32 on the GPU: every treecompile row's text equals the plain greedy output (lossless check with
#      the shipped head and fused projections);
#   3. batch 4 and 16 with the current loop;
#   4. the cascade split sweep for 1- and 32-row forwards at short prefixes (tests/gpu/next_sweep.sh);
#   5. kernel tables of the fused 8B decode / verify / draft rounds (`bench rounds --profile`).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }

stage "e2e batch 1, all configs"
timeout 900 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --trees "8,6,64;4,6,32" --json "$P/e2e_b1.json" --plot "$P/e2e_b1.png" > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"

timeout 420 python3 -m treecompile.bench e2e --model smollm2 --dtype float32 --batch-sizes 1 --prompts 12 \
  --max-new-tokens 128 --configs hf_eager,tc_plain,tc_tree --trees "8,6,64;4,6,32" --json "$P/e2e_fp32.json" \
  > "$P/e2e_fp32.log" 2>&1
stage "e2e float32 rc=$?"

timeout 600 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 4,16 --prompts 16 --max-new-tokens 256 \
  --inductor --configs hf_eager,tc_plain,tc_tree --trees "8,6,64;4,6,32" --json "$P/e2e_b416.json" \
  --plot "$P/e2e_b416.png" > "$P/e2e_b416.log" 2>&1
stage "e2e batch 4,16 rc=$?"

OUT=$P bash tests/gpu/next_sweep.sh > "$P/sweep.log" 2>&1
stage "sweep done"

# 5. where the fused decode step's 1.40x over its floor goes (kernel tables per variant)
timeout 240 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --profile "$P/prof" \
  --json "$P/rounds_prof.json" 2>&1 | grep "^| treecompile\|^c =" > "$P/rounds.log"
stage "DONE"
