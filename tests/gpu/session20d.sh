#!/usr/bin/env bash
# Fourteenth session, last device call (fresh machine; carry .whl): 8B rounds with the new split rule as the
# default (7 verify splits, 32 decode splits at ctx 2k); the compact GPU test that the first call's
# `-p no:logging` kept from its caplog fixture; then a stage-1 tile sweep at the verify and decode shapes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 3; }
R="treecompile.bench rounds --inductor --nodes 64 --reps 10"
timeout 170 python3 -m $R --json "$OUT/rounds_rule.json" > "$OUT/rounds_rule.log" 2>&1
echo "rounds rule rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_rule.log" | cut -c1-110
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_compact.py > "$OUT/compact.log" 2>&1
echo "compact rc=$? $(tail -1 "$OUT/compact.log")"
timeout 100 python3 tests/gpu/tile_sweep.py "$OUT/tile_sweep.json" "2048:64,2048:1" > "$OUT/tile_sweep.log" 2>&1
echo "tile sweep rc=$?"; grep -E "shipped|best" "$OUT/tile_sweep.log" | cut -c1-140
