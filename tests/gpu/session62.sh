#!/usr/bin/env bash
# RAN in the thirty-ninth session on an H100 (sweeps OK, its rounds timed out at 100 s: session63.sh redid them).
# Issue 4 in ONE device call, for a session that may get no second (carry .whl; ~420 s). The short forms of
# session59 / 59b / 61: the fused MLP's quick sweep and the pipelined gemv's sweep on the 8B shapes only, then
# 8B rounds with both installed (every swept shape's best fused tiles forced on, the gemv winners from the
# table) against every default.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_fused_mlp.py -k "8b_shape" \
  > "$OUT/gpu_tests.log" 2>&1
echo "fused mlp gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
timeout 100 python3 tests/gpu/mlp_sweep.py "$OUT/mlp_sweep.json" quick 8b 2>&1 | grep -v "^INFO" \
  | tee "$OUT/mlp_sweep.log" | cut -c1-220
timeout 100 python3 tests/gpu/skinny_sweep.py "$OUT/pipe_sweep.json" pipe 1,4 8b 2>&1 | grep -v "^INFO" \
  | tee "$OUT/pipe_sweep.log" | cut -c1-160
for v in both default; do
  case $v in
    default) cmd=(python3 -m treecompile.bench);;
    both) cmd=(python3 tests/gpu/variant.py --mlp-table-all "$OUT/mlp_sweep.json" --table "$OUT/pipe_sweep.json"
               treecompile.bench);;
  esac
  timeout 100 "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf --json "$OUT/rounds_$v.json" \
    > "$OUT/rounds_$v.log" 2>&1
  echo "rounds $v rc=$?"; grep -E "^\| treecompile|shapes installed|fuse_mlp:" "$OUT/rounds_$v.log" | sort | uniq -c | head -8
done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "_sweep.json$") && ls -la "$OUT"
