#!/usr/bin/env bash
# RAN in the fifty-seventh session on two H100s (the bulk prefetch did not pay and was removed again;
# TREECOMPILE_WEIGHT_PREFETCH no longer exists; restorable from a3f1e0f).
# Issue 4: the o projection's weight bulk-prefetched into L2 during its attention (carry .whl; any H100 or H200;
# ~450-585 s). Why: at 1 and 4 rows the 8B o (33.5 MB, the one 8B weight that fits in L2) streams at 1.2-1.7x its
# read floor (H100 draft trace: 17 us against 11), and at 64 rows at ~1.3x, while the attention just before it is
# latency-bound and leaves HBM mostly idle. The thirty-sixth session's per-line hints lost 1-2% on an H200; this
# version issues one `cp.async.bulk.prefetch.L2` a stage-1 program (passes/prefetch_weights.py).
#   1. the prefetch GPU tests (bit-identical attention outputs and caches, both modes; T_TESTS, default 60 s);
#   2. 8B rounds, VARIANTS (default "default pf pfend default"; pf = TREECOMPILE_WEIGHT_PREFETCH=1, pfend = =end,
#      pf16 = =1 with only the leading 16 MB), each only while DEADLINE (default 585 s) leaves ~110 s. On an H200
#      the first default round is also the H200's issue-4 reading.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic CLOCKS=${CLOCKS-1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
. tests/gpu/rounds_lib.sh
if [ "${T_TESTS:-60}" != 0 ]; then
  timeout ${T_TESTS:-60} python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_tree_attention_write.py \
    -k "prefetch" > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
fi
for v in ${VARIANTS:-default pf pfend default}; do
  if [ $(( $(date +%s) - t0 + 110 )) -gt "${DEADLINE:-585}" ]; then echo "stop before $v: $(( $(date +%s) - t0 )) s"; break; fi
  case $v in
    default) run_rounds "$v";;
    pf) run_rounds "$v" TREECOMPILE_WEIGHT_PREFETCH=1;;
    pfend) run_rounds "$v" TREECOMPILE_WEIGHT_PREFETCH=end;;
    pf16) run_rounds "$v" TREECOMPILE_WEIGHT_PREFETCH=1 TREECOMPILE_WEIGHT_PREFETCH_MB=16;;
    *) echo "unknown variant $v";;
  esac
done
echo "done at $(( $(date +%s) - t0 )) s"
