#!/usr/bin/env bash
# Eighteenth session's first device call (carry .gguf/smol.gguf.part.0, .gguf/sha256.txt, .whl; run it with
# treecompile/heads/smollm2/model.safetensors moved out of the working tree, or the copy passes 64 MiB).
# The seventeenth session lost its first call to cold compiles: every step here has room for them, and the test
# that decides a default runs first. (1) the compiled draft round's GPU test (decides TREECOMPILE_COMPILED_DRAFT);
# (2) 8B rounds every default; (3) the same with TREECOMPILE_COMPILED_DRAFT=1 (seventeenth session, one run each:
# draft 1.244 -> 1.209 ms). The verify and decode rows of (2) and (3) are a same-machine repeat of each other.
# --no-hf: HF's rows are known (8.98 / 11.59 ms) and do not change between the two; their captures cost time.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
bash tests/gpu/install.sh || exit 3
timeout 250 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu \
  tests/runtime/test_speculator_gpu.py -k "compiled_draft" > "$OUT/gpu_draft.log" 2>&1
echo "gpu compiled draft rc=$? $(tail -1 "$OUT/gpu_draft.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_draft.log" | head
timeout 180 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --no-hf --json "$OUT/rounds_default.json" \
  > "$OUT/rounds_default.log" 2>&1
echo "rounds default rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_default.log" | cut -c1-110
TREECOMPILE_COMPILED_DRAFT=1 timeout 150 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --no-hf \
  --json "$OUT/rounds_draft.json" > "$OUT/rounds_draft.log" 2>&1
echo "rounds compiled draft rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_draft.log" | cut -c1-110
