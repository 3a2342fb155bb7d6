#!/usr/bin/env bash
# Issue 4 (and issue 3's split lead), first device call of the next session (carry .whl; random weights). ~450 s.
# 1. The fused MLP's GPU tests (bf16 8B shape at 1 / 4 / 16 rows, default and narrow tiles, CUDA-graph replay).
# 2. tests/gpu/mlp_sweep.py: the fused MLP against the unfused chain (cuBLAS, and the shipped skinny tiles) on
#    cold weights, 8B (1, 4 rows) and SmolLM2 (1, 4, 8 rows) MLP shapes; the JSON is what session59b.sh installs.
# 3. tests/gpu/split_probe.py (issue 3: split count vs merge warps at P 2k-16k; built in the 37th session).
# Then tests/gpu/session59b.sh: the 8B rounds with and without the sweep's fused entries.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_fused_mlp.py \
  tests/runtime/test_speculator_gpu.py -k "fused_mlp" > "$OUT/gpu_tests.log" 2>&1
echo "fused mlp gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
timeout ${T_SWEEP:-360} python3 tests/gpu/mlp_sweep.py "$OUT/mlp_sweep.json" 2>&1 | grep -v "^INFO" | tee "$OUT/mlp_sweep.log"
cp "$OUT/mlp_sweep.json" /tmp/mlp_sweep.json 2>/dev/null  # for session59b.sh on the same warm machine
timeout ${T_SPLIT:-120} python3 tests/gpu/split_probe.py "$OUT/split_probe.json" > "$OUT/split_probe.log" 2>&1
echo "split probe rc=$?"; tail -12 "$OUT/split_probe.log"
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "^mlp_sweep.json$") && ls -la "$OUT"
