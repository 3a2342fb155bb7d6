#!/usr/bin/env bash
# Issue 4, forty-third session (carry .whl): passes/fuse_residual_norm.py folds a verify's RMSNorms into the
# prologues of skinny_glu / skinny_qkv_rope and the residual adds before them into the producing skinny_linear's
# epilogue (TREECOMPILE_FUSE_NORM=1; off by default since its one run: H100, verify(64) 6.335 -> 9.633 ms).
# First the GPU tests of the pass (the bf16 logits of a small Llama against the unfused graph: its head dim was
# 32 in that run, which the attention kernels refuse, now 64) and of the ops' norm prologues, then 8B rounds:
#   norm      TREECOMPILE_FUSE_NORM=1;
#   nonorm    the default (fusion off);
#   o_triton  H100 only: the 64-row o on the Triton tiles of its sweep (tests/gpu/h100_o64_triton.json, cuBLAS
#             counted as never faster), so the add after it folds too (on cuBLAS only the norm moves).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in *H200*) all="norm nonorm norm";; *) all="norm nonorm o_triton";; esac
if [ -z "${NO_TESTS:-}" ]; then
  timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider tests/passes/test_fuse_residual_norm.py \
    tests/ops/test_skinny_glu.py tests/ops/test_skinny_qkv_rope.py -k "${TEST_K:-norm or gpu}" ${MORE_TESTS:-} \
    > "$OUT/tests.log" 2>&1; echo "GPU tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | cut -c1-220 | tail -12
fi
for v in ${VARIANTS:-$all}; do
  env=(PYTHONUNBUFFERED=1); cmd=(python3 -m treecompile.bench)
  case $v in
    norm) env+=(TREECOMPILE_FUSE_NORM=1);;
    nonorm) ;;
    o_triton) cmd=(python3 tests/gpu/variant.py --table tests/gpu/h100_o64_triton.json treecompile.bench);;
    *) echo "unknown variant $v"; continue;;
  esac
  start=$(date +%s)
  env "${env[@]}" timeout ${T_ROUNDS:-170} "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf \
    --json "$OUT/rounds_${v}_$start.json" > "$OUT/rounds_${v}_$start.log" 2>&1
  echo "rounds $v rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\| treecompile|shapes installed|fuse_residual_norm" "$OUT/rounds_${v}_$start.log" | head -5
done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "json$") && ls -la "$OUT"
