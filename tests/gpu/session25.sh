#!/usr/bin/env bash
# Nineteenth session's first device call (carry .gguf/smol.gguf.part.0, .gguf/sha256.txt, .whl; run it with
# treecompile/heads/smollm2/model.safetensors moved out of the working tree, or the copy passes 64 MiB).
# Part 0 of the GGUF lands in /tmp/models for the next call; meanwhile the runtime GPU tests, verbose (the
# eighteenth session's -q run was cut after 22 of 29 with no names in its log). The model GPU tests run in
# the next call, beside the head-training daemon.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
bash tests/gpu/install.sh || exit 3
timeout ${T_TESTS:-420} python3 -m pytest -v -p no:cacheprovider --log-level=WARNING -m gpu tests/runtime \
  > "$OUT/gpu_runtime.log" 2>&1
echo "gpu runtime rc=$? $(tail -1 "$OUT/gpu_runtime.log")"
grep -cE " PASSED" "$OUT/gpu_runtime.log"; grep -E " (FAILED|ERROR)" "$OUT/gpu_runtime.log" | head
