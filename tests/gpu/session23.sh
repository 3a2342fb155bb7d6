#!/usr/bin/env bash
# Next session's plan, first device call (carry .gguf/smol.gguf.part.0, .gguf/sha256.txt, .whl): install; the GPU
# tree-attention tests under the eight-row merge rule; 8B rounds every default (the rule's effect on the verify:
# the sixteenth session read 5.232 / 5.214 ms without it).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 3; }
timeout 150 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/ops -k "tree_attention" \
  > "$OUT/gpu_ops.log" 2>&1
echo "gpu ops rc=$? $(tail -1 "$OUT/gpu_ops.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_ops.log" | head
timeout 130 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$OUT/rounds_default.json" \
  > "$OUT/rounds_default.log" 2>&1
echo "rounds default rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_default.log" | cut -c1-110
# Every launch on one-row one-warp merges: only the verify row is the A/B (the override moves the decode's
# four-warp merges to one warp too, so its row is not comparable).
TREECOMPILE_CASCADE=merge_rows=1,merge_warps=1 timeout 130 python3 -m treecompile.bench rounds --inductor --nodes 64 \
  --reps 10 --json "$OUT/rounds_merge1.json" > "$OUT/rounds_merge1.log" 2>&1
echo "rounds one-row merges rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_merge1.log" | cut -c1-110
