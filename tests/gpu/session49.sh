#!/usr/bin/env bash
# Thirty-first session (carry .whl; random weights): Inductor's combo kernels, now on by default for
# treecompile's compiles on CUDA. The new token-equality test (combo kernels off against on, float32), and the GPU
# tests that hold every default against HF greedy or against eager rounds, the hybrid ones too. ~400 s.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K="combo or fused_projections_on_cuda or graphs_equal_eager or a_round_makes_no_host_sync or lookahead"
timeout ${T_TESTS:-420} bash tests/gpu/session.sh -m gpu tests/runtime/test_speculator_gpu.py tests/models/test_lossless_hybrid.py \
  -k "$K or gpu_captured or gpu_hybrid" > "$OUT/gpu_combo.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/gpu_combo.log" | tail -8
