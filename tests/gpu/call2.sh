#!/usr/bin/env bash
# Fourth session, second call: the captured commit and the compiled DraftTree on the GPU (tests), then the
# SmolLM2-shaped loop profile and the 8B rounds with them.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || exit 3
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/runtime/test_speculator_gpu.py tests/runtime/test_draft_tree.py \
  tests/ops/test_tree_attention.py -m gpu 2>&1 | tail -5
timeout 200 python3 tests/gpu/loop_profile.py "$OUT/loop_profile.json" 2>&1 | grep -v "DEBUG\|INFO\|Warn\|warn\|^$\|Online\|split the\|important use\|softmax" | tail -12
timeout 200 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$OUT/rounds.json" 2>&1 \
  | grep "^|\|^- \|^c =" | tee "$OUT/rounds.log"
