#!/usr/bin/env bash
# Twenty-sixth session, call C, right after session36.sh (carry .gguf/smol.gguf.part.1, .whl; the head back in
# the tree). (1) the GPU test of batch shrinking under captured rounds; (2) e2e at batch 4 then 16 without
# shrinking, batch 4 first (the twenty-second session ran 4 before 16 and read (4, 6, 32) at 1.70x; the
# twenty-fifth ran 16 first and read 1.19x: does the order matter?); (3) e2e at 1, 4, 16 with shrinking, tree
# (4, 4, 16) (smaller sizes first, so the batch-16 run has them captured to shrink onto).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
timeout ${T_TEST:-100} python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_batch_shrink.py > "$OUT/shrink_test.log" 2>&1
echo "gpu test rc=$? $(tail -1 "$OUT/shrink_test.log")"
E2E="--model smollm2 --prompts 48 --max-new-tokens 256 --inductor --repeats 1"
timeout ${T_E2E1:-230} python3 -m treecompile.bench e2e $E2E --batch-sizes 4,16 --configs tc_plain,tc_tree \
  --trees "4,6,32;4,4,16" --no-shrink-batch --json "$OUT/e2e_no_shrink.json" > "$OUT/e2e_no_shrink.log" 2>&1
echo "e2e no-shrink rc=$?"; tail -8 "$OUT/e2e_no_shrink.log"
timeout ${T_E2E2:-220} python3 -m treecompile.bench e2e $E2E --batch-sizes 1,4,16 --configs tc_plain,tc_tree \
  --trees 4,4,16 --shrink-batch --json "$OUT/e2e_shrink.json" > "$OUT/e2e_shrink.log" 2>&1
echo "e2e shrink rc=$?"; tail -8 "$OUT/e2e_shrink.log"
