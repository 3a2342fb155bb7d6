#!/usr/bin/env bash
# Next session's plan, second device call (carry .gguf/smol.gguf.part.ab): the `-m gpu` tests of tests/runtime
# and tests/models under the new defaults, then 8B rounds as shipped (no flags: every default) and with
# TREECOMPILE_PDL=0 for the A/B. Issue 4: decode <= 4.41 ms, verify <= 1.15x decode, draft <= 1.3x floor.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
cp .gguf/smol.gguf.part.* /tmp/models/ 2>/dev/null
timeout 300 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/runtime tests/models \
  > "$OUT/gpu_runtime.log" 2>&1
echo "gpu runtime/models rc=$? $(tail -1 "$OUT/gpu_runtime.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_runtime.log" | head
R="treecompile.bench rounds --inductor --nodes 64 --reps 10"
timeout 150 python3 -m $R --json "$OUT/rounds_default.json" > "$OUT/rounds_default.log" 2>&1
echo "rounds default rc=$?"; grep -E "^\| treecompile" "$OUT/rounds_default.log" | cut -c1-100
TREECOMPILE_PDL=0 timeout 110 python3 -m $R --json "$OUT/rounds_nopdl.json" > "$OUT/rounds_nopdl.log" 2>&1
echo "rounds nopdl rc=$?"; grep -E "^\| treecompile" "$OUT/rounds_nopdl.log" | cut -c1-100
