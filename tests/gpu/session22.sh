#!/usr/bin/env bash
# Ran in the sixteenth session (notes/gpu-2026-12-02-s16.md); kept as the record. The cascade's fused merge was
# removed afterwards, so TREECOMPILE_CASCADE=fused_merge=1 below is now refused by name.
# Next session's plan, first device call (carry .gguf/smol.gguf.part.aa, .gguf/sha256.txt, .whl): install; the GPU
# tests of the ops changed in the fifteenth session (the cascade's fused merge and window_offset, the draft
# top-k's fused merge and index_offset (d2t in the store), the shared counter table under split-K); the cascade A/B at the 8B verify / decode shapes
# (the "fused" variants); 8B rounds with every default, then with the three launch savers on for every launch.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 3; }
timeout 170 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/ops tests/models/test_eagle_drafter.py \
  -k "tree_attention or draft_topk or split_k or score_candidates" > "$OUT/gpu_ops.log" 2>&1
echo "gpu ops rc=$? $(tail -1 "$OUT/gpu_ops.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_ops.log" | head
timeout 70 python3 tests/gpu/cascade_ab.py "$OUT/cascade_ab.json" "2048:64,2048:1" > "$OUT/cascade_ab.log" 2>&1
echo "cascade_ab rc=$?"; grep -E "default |fused|best" "$OUT/cascade_ab.log" | cut -c1-120
R="treecompile.bench rounds --inductor --nodes 64 --reps 10"
timeout 130 python3 -m $R --json "$OUT/rounds_default.json" > "$OUT/rounds_default.log" 2>&1
echo "rounds default rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_default.log" | cut -c1-110
TREECOMPILE_CASCADE=fused_merge=1 TREECOMPILE_TOPK_FUSED_MERGE=1 TREECOMPILE_DRAFT_FOLD=1 TREECOMPILE_COMPILED_COMMIT=1 timeout 130 \
  python3 -m $R --json "$OUT/rounds_fused.json" > "$OUT/rounds_fused.log" 2>&1
echo "rounds fused (every launch) rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_fused.log" | cut -c1-110
