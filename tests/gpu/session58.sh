#!/usr/bin/env bash
# Issue 3, the short-prefix fixed cost (carry .whl; ~300 s): the attention benchmark with its new "read us"
# column (one streaming read of the same K+V bytes per layer, the same per-layer method). If even a read with
# no attention at all costs > 1.5x the bandwidth floor at 4k, that floor is out of reach for any kernel here.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_bench_attention.py > "$OUT/read_tests.log" 2>&1
echo "read_kv tests rc=$?"; tail -2 "$OUT/read_tests.log"
timeout ${T_ATT:-420} python3 -m treecompile.bench attention --nodes 16,64 --prefixes 1024,4096,16384,65536 \
  --json "$OUT/attention.json" 2>&1 | grep -v "^INFO" | tee "$OUT/attention.log"
