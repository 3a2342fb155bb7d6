#!/usr/bin/env bash
# Twentieth session's first device call (carry .whl; random weights only, no GGUF needed).
# (1) l2_probe: is the in-request draft slowdown an L2 eviction, and does a persisting window over the packed
# head win it back? (2) the three GPU tests the nineteenth session did not reach, alone; (3) the compiled draft
# round's kernel table (TREECOMPILE_COMPILED_DRAFT=1) beside the per-hook one.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/install.sh || exit 3
cd /tmp  # the repository root would shadow the installed package
R=$OLDPWD
timeout ${T_PROBE:-200} python3 $R/tests/gpu/l2_probe.py "$OUT/l2_probe.json" 8,6,64 > "$OUT/l2_probe.log" 2>&1
echo "l2_probe rc=$?"; tail -3 "$OUT/l2_probe.log" | cut -c1-1500
cd $R
timeout ${T_TESTS:-240} python3 -m pytest -v -p no:cacheprovider --log-level=WARNING -m gpu \
  "tests/runtime/test_speculator_gpu.py::test_compiled_draft_round_drafts_the_per_hook_tree" \
  tests/runtime/test_tree_spec.py::test_cuda_without_syncs \
  tests/models/test_lossless_hybrid.py::test_gpu_hybrid_round_makes_no_host_sync > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"; grep -E "PASSED|FAILED|ERROR" "$OUT/gpu_tests.log" | head
if [ "${T_PROF:-0}" -gt 0 ]; then
  mkdir -p "$OUT/prof"; cd /tmp
  TREECOMPILE_COMPILED_DRAFT=1 SHAPES="8,6,64" DRAFT_VOCAB=8192 timeout $T_PROF python3 $R/tests/gpu/loop_profile.py \
    "$OUT/loop_profile_compiled.json" "$OUT/prof" fused-only > "$OUT/loop_profile_compiled.log" 2>&1
  echo "loop_profile compiled rc=$?"; tail -1 "$OUT/loop_profile_compiled.log" | cut -c1-800
fi
