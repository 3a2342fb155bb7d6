#!/usr/bin/env bash
# After tests/gpu/session27.sh (GGUF part 0, head moved out); this call carries .gguf/smol.gguf.part.1 and .whl.
# Batch shrinking (TreeSpeculator(shrink_batch=True): a batch's running requests move onto smaller batch sizes
# already captured as others stop) on the GPU: e2e at batch 1, 4, 16 in that order (so the smaller sizes are
# captured before the batch-16 rows run), the first 48 held-out prompts, plain and tree (4, 4, 16), with and
# without shrinking, each in its own process (~230 s each: MODES=shrink, then MODES=no-shrink, if one call cannot
# hold both), after the GPU test of the shrink under captured rounds.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
timeout ${T_TEST:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_batch_shrink.py > "$OUT/shrink_test.log" 2>&1
echo "gpu test rc=$? $(tail -1 "$OUT/shrink_test.log")"
E2E="--model smollm2 --batch-sizes 1,4,16 --prompts 48 --max-new-tokens 256 --inductor --repeats 1"
for mode in ${MODES:-shrink no-shrink}; do
  timeout ${T_E2E:-230} python3 -m treecompile.bench e2e $E2E --configs tc_plain,tc_tree --trees "${TREES:-4,4,16}" \
    --${mode}-batch --json "$OUT/e2e_$mode.json" > "$OUT/e2e_$mode.log" 2>&1
  echo "e2e $mode rc=$?"; tail -12 "$OUT/e2e_$mode.log"
done
