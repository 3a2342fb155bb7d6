#!/usr/bin/env bash
# Next session's plan, first device call (carry .gguf/smol.gguf.part.aa, .gguf/sha256.txt, .whl): install; the GPU
# tests of the ops changed since the last whole-suite run (split-K skinny GEMMs with their graph replays, the
# cascade's new split rule, the compact test that `-p no:logging` once kept from its caplog fixture); then the
# cascade A/B at the 8B verify / decode shapes (L2 hints of 1-8 tiles); the split-K (and L2-hint) sweep of the 8B
# shapes at 1 and 64 rows (decode and verify), kept at /tmp/splitk_a.json.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 3; }
timeout 200 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/ops \
  -k "skinny or tree_attention or compact" > "$OUT/gpu_ops.log" 2>&1
echo "gpu ops rc=$? $(tail -1 "$OUT/gpu_ops.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_ops.log" | head
timeout 60 python3 tests/gpu/cascade_ab.py "$OUT/cascade_ab.json" "2048:64,2048:1" > "$OUT/cascade_ab.log" 2>&1
echo "cascade_ab rc=$?"; grep -E "default |l2pf|best" "$OUT/cascade_ab.log" | cut -c1-120
timeout 300 python3 tests/gpu/skinny_sweep.py "$OUT/splitk_a.json" splitk 1,64 > "$OUT/splitk_a.log" 2>&1
echo "splitk 1,64 rc=$?"; cp "$OUT/splitk_a.json" /tmp/ 2>/dev/null; cut -c1-150 "$OUT/splitk_a.log" | grep "M="
