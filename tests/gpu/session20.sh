#!/usr/bin/env bash
# Fourteenth session, first device call (carry .gguf/smol.gguf.part.aa, .gguf/sha256.txt, .whl): install, the
# `-m gpu` tests of tests/ops and tests/passes under the thirteenth session's defaults (TMA tiles, the one-warp
# merge rule, dependent launches, skinny GEMMs), which have not run the whole GPU suite; then cascade_ab.py at
# the 8B verify and decode shapes, with split-count variants (its JSON kept at /tmp/ab.json for the next call).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 3; }
timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/ops tests/passes \
  > "$OUT/gpu_ops.log" 2>&1
echo "gpu ops/passes rc=$? $(tail -1 "$OUT/gpu_ops.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_ops.log" | head
timeout 110 python3 tests/gpu/cascade_ab.py "$OUT/cascade_ab.json" "2048:64,2048:1" > "$OUT/cascade_ab.log" 2>&1
echo "cascade_ab rc=$?"; cp "$OUT/cascade_ab.json" /tmp/ab.json 2>/dev/null
grep -E "us/layer|best" "$OUT/cascade_ab.log" | cut -c1-160
