#!/usr/bin/env bash
# Thirty-first session (carry .whl; random weights). The compiled draft round has been the CUDA default since the
# twenty-ninth session; issue 4's 8B ratios have not been measured with it as the default. First the batch-shrink
# and hybrid GPU tests under every default, then the 8B rounds twice (compiled draft round, the default; then
# per hook), the first with a kernel-time profile per variant: where a decode's time goes beside its weight reads.
# ~450 s.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout ${T_TESTS:-240} bash tests/gpu/session.sh -m gpu tests/models/test_batch_shrink.py tests/models/test_lossless_hybrid.py \
  > "$OUT/gpu_models.log" 2>&1
echo "model gpu tests rc=$?"; grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/gpu_models.log" | tail -8
TREECOMPILE_COMPILED_DRAFT=1 timeout ${T_ROUNDS:-200} python3 -m treecompile.bench rounds --inductor --nodes 64 \
  --reps 10 --no-hf --profile "$OUT/prof" --json "$OUT/rounds_draft1.json" > "$OUT/rounds_draft1.log" 2>&1
echo "8B rounds COMPILED_DRAFT=1 (profiled) rc=$?"; grep -E "^\| (treecompile|draft|c )|floor|^- " "$OUT/rounds_draft1.log" | cut -c1-120
TREECOMPILE_COMPILED_DRAFT=0 timeout ${T_ROUNDS:-150} python3 -m treecompile.bench rounds --inductor --nodes 64 \
  --reps 10 --no-hf --json "$OUT/rounds_draft0.json" > "$OUT/rounds_draft0.log" 2>&1
echo "8B rounds COMPILED_DRAFT=0 rc=$?"; grep -E "^\| (treecompile|draft|c )|^- " "$OUT/rounds_draft0.log" | cut -c1-120
