#!/usr/bin/env bash
# Twentieth session, fourth call (carry .gguf/smol.gguf.part.0, .gguf/sha256.txt, .whl; the shipped head moved
# out of the working tree for the call): GGUF part 0 to /tmp/models; the draft-tree GPU tests with the
# pairwise-count ranking; loop_profile (8, 6, 64) compiled draft (kernel table) and per-hook.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
bash tests/gpu/install.sh || exit 3
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_draft_tree.py > "$OUT/gpu_draft_tree.log" 2>&1
echo "draft tree gpu rc=$? $(tail -1 "$OUT/gpu_draft_tree.log")"
R=$PWD; cd /tmp; mkdir -p "$OUT/prof"
TREECOMPILE_COMPILED_DRAFT=1 SHAPES="8,6,64" DRAFT_VOCAB=8192 timeout 150 python3 $R/tests/gpu/loop_profile.py \
  "$OUT/lp_compiled.json" "$OUT/prof" fused-only > "$OUT/lp_compiled.log" 2>&1
echo "compiled rc=$?"; tail -1 "$OUT/lp_compiled.log" | cut -c1-700
[ "${HOOKS:-0}" = 1 ] && { SHAPES="8,6,64" DRAFT_VOCAB=8192 timeout 120 python3 $R/tests/gpu/loop_profile.py "$OUT/lp_hooks.json" - fused-only \
  > "$OUT/lp_hooks.log" 2>&1; echo "per-hook rc=$?"; tail -1 "$OUT/lp_hooks.log" | cut -c1-700; }
