#!/usr/bin/env bash
# Next session's plan, second device call (carry .gguf/smol.gguf.part.ab): 8B rounds with the fused merge only on
# the launches of <= 128 rows a KV head (decode, draft lanes; the verify keeps its merge launch) plus the top-k
# merge and the draft fold; the default again (drift check); then the runtime GPU tests that run the savers end
# to end (token equality with them off / on) and the round captures.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
cp .gguf/smol.gguf.part.* /tmp/models/ 2>/dev/null
R="treecompile.bench rounds --inductor --nodes 64 --reps 10"
TREECOMPILE_TOPK_FUSED_MERGE=1 TREECOMPILE_DRAFT_FOLD=1 TREECOMPILE_COMPILED_COMMIT=1 timeout 130 python3 -m \
  $R --json "$OUT/rounds_light.json" > "$OUT/rounds_light.log" 2>&1
echo "rounds light rc=$?"; grep -E "^variant|^\| (treecompile|draft|c )" "$OUT/rounds_light.log" | cut -c1-110
timeout 130 python3 -m $R --json "$OUT/rounds_default2.json" > "$OUT/rounds_default2.log" 2>&1
echo "rounds default again rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_default2.log" | cut -c1-110
timeout 270 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/runtime/test_speculator_gpu.py \
  -k "fused_merges or lookahead or graphs_equal or no_host_sync or agree" -rA > "$OUT/gpu_rt.log" 2>&1
echo "gpu runtime rc=$? $(tail -1 "$OUT/gpu_rt.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_rt.log" | head
