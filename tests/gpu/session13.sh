#!/usr/bin/env bash
# Tenth session's last device call (foreground; ~400 s of budget left): the fold's fix and the measured
# skinny table on the GPU. 1. the fused-write op tests, the graphs-vs-eager-vs-plain test (which caught the
# strided-slots bug) and the skinny speculator test, all with the fold on; 2. 8B rounds with fold + skinny,
# then without either (main), as far as the time goes. Logs and JSON in $OUT.
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ic
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/ops/test_tree_attention_write.py \
  "tests/runtime/test_speculator_gpu.py::test_graphs_equal_eager_rounds_and_report_agreement" \
  tests/runtime/test_speculator_gpu.py::test_skinny_linears_on_cuda_run_the_op_and_agree > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$OUT/tests.log")"
grep "token agreement" "$OUT/tests.log"
R="treecompile.bench rounds --inductor --nodes 64 --reps 10"
timeout 110 python3 -m $R --skinny-linears --json "$OUT/rounds_both.json" > "$OUT/rounds_both.log" 2>&1
echo "rounds both rc=$?"; grep "^| treecompile\|^c =" "$OUT/rounds_both.log"
timeout 110 python3 tests/gpu/variant.py --no-fold $R --json "$OUT/rounds_main.json" > "$OUT/rounds_main.log" 2>&1
echo "rounds main rc=$?"; grep "^| treecompile\|^c =" "$OUT/rounds_main.log"
