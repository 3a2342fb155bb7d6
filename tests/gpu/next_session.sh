#!/usr/bin/env bash
# First call of the next GPU session (~8 min on a fresh H200): the GPU tests of this session's code that
# never ran there (fused projections, captured commit on hybrids), then fused vs unfused projections at
# SmolLM2 shapes (loop profile) and on the 8B rounds. Second call: tests/gpu/next_sweep.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/prof"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || exit 3
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_speculator_gpu.py tests/ops/test_page_slots.py \
  tests/models/test_lossless_hybrid.py tests/models/test_eagle_drafter.py -m gpu 2>&1 | tail -4
timeout 150 python3 tests/gpu/loop_profile.py "$OUT/loop_fuse.json" "$OUT/prof" fuse 2>&1 | grep '^{' | tail -4
for f in "" --fuse-projections; do
  timeout 110 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 $f --json "$OUT/rounds$f.json" 2>&1 \
    | grep "^| treecompile\|^c =" | tee -a "$OUT/rounds.log"
done
