#!/usr/bin/env bash
# The forty-seventh session's last call (carry .whl; <= ~520 s): on an H200, first the 8B rounds with every default,
# twice (issue 4; last measured on an H200 in the forty-third session). Then, on any GPU, the CUDA tests of the ops
# whose launches read the 0 / 1 switches now checked by env_switch (PDL in every cascade / skinny / top-k launch),
# and the switches' own tests.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in
  *H200*) . tests/gpu/rounds_lib.sh; for v in default default; do run_rounds "$v"; done;;
esac
timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider tests/runtime/test_env_switches.py \
  tests/ops/test_tree_attention.py tests/ops/test_tree_attention_write.py tests/ops/test_draft_topk.py \
  tests/ops/test_skinny_linear.py -k "${TEST_K:-cuda or gpu or switch}" > "$OUT/tests.log" 2>&1
echo "GPU tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | cut -c1-220 | tail -12
