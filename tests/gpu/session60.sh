#!/usr/bin/env bash
# Issue 3 (carry .whl; ~550 s). First the thirty-seventh session's split probe (split count against merge warps at
# P 2k-16k, N 1 / 16; ~100 s). Then, for 16k and 64k at N = 16, the stage-1 sweep (bench attention --sweep), whose grid
# for few rows now includes three and four programs an SM (64 x 32 tiles, 2-3 stages) and 64 rows on two
# warpgroups. The default ran 1.77x its floor at 16k N = 16 while a bare read ran 1.05x: per-program latency.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
timeout ${T_SPLIT:-110} python3 tests/gpu/split_probe.py "$OUT/split_probe.json" > "$OUT/split_probe.log" 2>&1
echo "split probe rc=$?"; tail -12 "$OUT/split_probe.log"
timeout ${T_SWEEP:-400} python3 -m treecompile.bench attention --sweep --nodes 16 --prefixes 16384,65536 \
  --json "$OUT/sweep16.json" 2>&1 | grep -v "^INFO" > "$OUT/sweep16.log"
echo "sweep rc=$?"; grep -A6 "^P=" "$OUT/sweep16.log" | head -20
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v "^raw.tgz$") && ls -la "$OUT"
