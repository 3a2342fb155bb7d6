#!/usr/bin/env bash
# Issue 4 (carry .whl): passes/fuse_residual_norm.py (TREECOMPILE_FUSE_NORM=1) moves a verify's residual add and
# RMSNorm into the producing GEMM's epilogue (treespec::skinny_linear_norm_out: s, norm_weight * s, partial sums of
# s^2) and the consumer (skinny_glu / skinny_qkv_rope) scales its sums by the row's rsqrt after a plain K loop.
# Its first version (the norm in the consumer's prologue, wgmma fed from registers) made an H100's 8B verify(64)
# 6.335 -> 9.633 ms (forty-third session). First the GPU tests of the pass (bf16 logits of a small Llama against
# the unfused graph) and of the ops' norm paths (TEST_K), then 8B rounds by variant:
#   norm      TREECOMPILE_FUSE_NORM=1;
#   nonorm    the default (off);
#   o_triton  H100 only, with the fusion: the 64-row o on the Triton tiles of its sweep (tests/gpu/h100_o64_triton.json,
#             cuBLAS counted as never faster), so the o -> gate/up norm folds too (on cuBLAS it stays a kernel).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in *H200*) all="norm nonorm norm";; *) all="norm nonorm o_triton";; esac
if [ -z "${NO_TESTS:-}" ]; then
  timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider tests/passes/test_fuse_residual_norm.py \
    tests/ops/test_skinny_glu.py tests/ops/test_skinny_qkv_rope.py -k "${TEST_K:-norm or gpu or sumsq or scale}" ${MORE_TESTS:-} \
    > "$OUT/tests.log" 2>&1; echo "GPU tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | cut -c1-220 | tail -12
fi
for v in ${VARIANTS:-$all}; do
  env=(PYTHONUNBUFFERED=1); cmd=(python3 -m treecompile.bench)
  case $v in
    norm) env+=(TREECOMPILE_FUSE_NORM=1);;
    nonorm) ;;
    o_triton) env+=(TREECOMPILE_FUSE_NORM=1); cmd=(python3 tests/gpu/variant.py --table tests/gpu/h100_o64_triton.json treecompile.bench);;
    *) echo "unknown variant $v"; continue;;
  esac
  start=$(date +%s)
  env "${env[@]}" timeout ${T_ROUNDS:-170} "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf \
    --json "$OUT/rounds_${v}_$start.json" > "$OUT/rounds_${v}_$start.log" 2>&1
  echo "rounds $v rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\| treecompile|shapes installed|fuse_residual_norm" "$OUT/rounds_${v}_$start.log" | head -5
done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "json$") && ls -la "$OUT"
