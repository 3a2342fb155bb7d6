#!/usr/bin/env bash
# Fourth session, third call: GPU tests of the captured commit, the compiled DraftTree, the fused draft top-k
# and the cascade's 16-bit partials; the SmolLM2-shaped loop profile (kernel tables) and the 8B rounds.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/prof"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || exit 3
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_speculator_gpu.py tests/runtime/test_draft_tree.py \
  tests/ops/test_tree_attention.py tests/models/test_eagle_drafter.py tests/ops/test_draft_topk.py -m gpu 2>&1 | tail -6
timeout 150 python3 tests/gpu/loop_profile.py "$OUT/loop_profile.json" "$OUT/prof" 2>&1 | grep '^{' | tail -6
timeout 150 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$OUT/rounds.json" 2>&1 \
  | grep "^|\|^- \|^c =" | tee "$OUT/rounds.log"
