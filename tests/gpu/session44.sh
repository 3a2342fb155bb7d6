#!/usr/bin/env bash
# Thirtieth session (carry .whl; random weights, no GGUF). The twenty-ninth session made the compiled draft round
# the CUDA default and gave every compiled round function a code object per batch size; neither change has run
# the GPU tests since. PART=1 and PART=2 (~300-400 s each): the speculator GPU tests in two halves. PART=3 (~400 s):
# batch shrinking and the hybrid GPU tests, then 8B rounds (issue 4's draft ratio) with the compiled draft (default)
# and per hook (=0).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# The speculator file took ~390 s with the per-hook draft; the compiled round adds a compile per speculator.
LATER="compiled_draft_round or dependent_launches or fused_merges or skinny_linears or never_recompile or prefill"
if [ "${PART:-1}" = 1 ] || [ "${PART:-1}" = 2 ]; then
  if [ "${PART:-1}" = 1 ]; then K="not ($LATER)"; else K="$LATER"; fi
  timeout ${T_TESTS:-560} bash tests/gpu/session.sh -m gpu tests/runtime/test_speculator_gpu.py -k "$K" \
    > "$OUT/gpu_spec$PART.log" 2>&1
  echo "speculator gpu tests (part $PART) rc=$?"; grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/gpu_spec$PART.log" | tail -8
  exit 0
fi
timeout ${T_TESTS:-240} bash tests/gpu/session.sh -m gpu tests/models/test_batch_shrink.py tests/models/test_lossless_hybrid.py \
  > "$OUT/gpu_models.log" 2>&1
echo "model gpu tests rc=$?"; grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/gpu_models.log" | tail -8
for draft in 1 0; do
  TREECOMPILE_COMPILED_DRAFT=$draft timeout ${T_ROUNDS:-150} python3 -m treecompile.bench rounds --inductor --nodes 64 \
    --reps 10 --no-hf --json "$OUT/rounds_draft$draft.json" > "$OUT/rounds_draft$draft.log" 2>&1
  echo "8B rounds COMPILED_DRAFT=$draft rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_draft$draft.log" | cut -c1-110
done
