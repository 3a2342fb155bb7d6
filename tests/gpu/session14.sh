#!/usr/bin/env bash
# Next GPU session's daemon, on main (after tests/gpu/smol_setup.sh; follow with tests/gpu/watch.sh within
# 30 s of every call's end: the device is released after 30 s idle and this daemon dies with it).
# 1. the whole -m gpu suite (the fold merged, the per-head dummy-slot check never run on a GPU yet);
# 2. SmolLM2 e2e batch 1, plain + (8, 6, 64): main (fold on) against --skinny-linears (the measured table);
# 3. 8B rounds main, then with Inductor's combo kernels (independent small kernels in one launch).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
stage "gpu tests"
timeout 900 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests > "$P/gpu_tests.log" 2>&1
stage "gpu tests rc=$? $(tail -1 "$P/gpu_tests.log")"
E="treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 --inductor --configs tc_plain,tc_tree --trees 8,6,64 --repeats 2"
timeout 300 python3 -m $E --json "$P/e2e_main.json" > "$P/e2e_main.log" 2>&1
stage "e2e main rc=$?"
timeout 300 python3 -m $E --skinny-linears --json "$P/e2e_skinny.json" > "$P/e2e_skinny.log" 2>&1
stage "e2e skinny rc=$?"
timeout 200 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$P/rounds.json" > "$P/rounds.log" 2>&1
stage "rounds rc=$?"
timeout 200 python3 tests/gpu/variant.py --inductor combo_kernels=True treecompile.bench rounds --inductor --nodes 64 \
  --reps 10 --json "$P/rounds_combo.json" > "$P/rounds_combo.log" 2>&1
stage "rounds combo rc=$? $(grep '^| treecompile' "$P/rounds_combo.log" | cut -c1-80 | tr '\n' ' ')"
stage "DONE"
