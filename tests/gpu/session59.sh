#!/usr/bin/env bash
# Issue 4, first device call of the next session (carry .whl; random weights). ~500 s.
# 1. The fused MLP op's GPU tests (bf16 8B shape at 1 / 4 / 16 rows, default and narrow tiles, CUDA-graph replay,
#    the norm prologue).
# 2. tests/gpu/mlp_sweep.py: the fused MLP against the unfused chain (cuBLAS, and the shipped skinny tiles) on
#    cold weights, 8B (1, 4, 16 rows) and SmolLM2 (1, 4, 8, 16 rows) MLP shapes; the JSON is what session59b.sh
#    installs.
# Then tests/gpu/session59b.sh (generate with the op, 8B rounds with and without the sweep's fused entries) and
# tests/gpu/session60.sh (issue 3).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_fused_mlp.py > "$OUT/gpu_tests.log" 2>&1
echo "fused mlp gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
timeout ${T_SWEEP:-420} python3 tests/gpu/mlp_sweep.py "$OUT/mlp_sweep.json" 2>&1 | grep -v "^INFO" | tee "$OUT/mlp_sweep.log"
cp "$OUT/mlp_sweep.json" /tmp/mlp_sweep.json 2>/dev/null  # for session59b.sh on the same warm machine
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "^mlp_sweep.json$") && ls -la "$OUT"
