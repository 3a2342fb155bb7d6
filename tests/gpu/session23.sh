#!/usr/bin/env bash
# Next session's plan, first device call (carry .gguf/smol.gguf.part.0, .gguf/sha256.txt, .whl): install; the GPU
# tree-attention tests under the eight-row merge rule and the compiled draft round's GPU test; 8B rounds every
# default, then the merge rule's and the compiled draft round's A/B (the sixteenth session read verify 5.232 /
# 5.214 ms without the rule).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 3; }
timeout 200 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/ops \
  tests/runtime/test_speculator_gpu.py -k "tree_attention or compiled_draft" > "$OUT/gpu_ops.log" 2>&1
echo "gpu ops rc=$? $(tail -1 "$OUT/gpu_ops.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_ops.log" | head
timeout 130 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$OUT/rounds_default.json" \
  > "$OUT/rounds_default.log" 2>&1
echo "rounds default rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_default.log" | cut -c1-110
# Two A/Bs in one run, each read on its own row: the verify's launches (> 128 rows a KV head) on one-row
# one-warp merges (the verify row against the default's eight-row merges; variant.py leaves every other launch
# as it is) and the whole draft round compiled as one graph (the draft row).
TREECOMPILE_COMPILED_DRAFT=1 timeout 150 python3 tests/gpu/variant.py --cascade-heavy merge_rows=1,merge_warps=1 \
  treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$OUT/rounds_ab.json" > "$OUT/rounds_ab.log" 2>&1
echo "rounds one-row verify merges + compiled draft rc=$?"
grep -E "^variant|^\| (treecompile|draft|c )" "$OUT/rounds_ab.log" | cut -c1-110
