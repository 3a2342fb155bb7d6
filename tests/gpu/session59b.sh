#!/usr/bin/env bash
# Issue 4, second device call (carry .whl; ~500 s): generate with the fused MLP (GPU test: head lanes, a 12-row
# target verify, agreement with the unfused speculator); then 8B rounds, every default against the fused MLP with
# the sweep's best tiles for every swept shape, won or lost in the sweep (tests/gpu/variant.py --mlp-table-all:
# the round decides), in the order default, fused, fused, default.
# MLP=path picks the table (default: /tmp/mlp_sweep.json, left by session59.sh on this warm machine).
# The logs' "fuse_mlp: N gated MLP(s)" lines (INFO) show how many MLPs each compile fused.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
MLP=${MLP:-/tmp/mlp_sweep.json}
[ -f "$MLP" ] || { echo "no sweep table at $MLP"; exit 4; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_speculator_gpu.py -k fused_mlp \
  > "$OUT/gpu_tests.log" 2>&1
echo "generate with the fused MLP: rc=$?"; tail -3 "$OUT/gpu_tests.log"
for v in default1 fused1 fused2 default2; do
  case $v in
    default*) cmd=(python3 -m treecompile.bench);;
    fused*) cmd=(python3 tests/gpu/variant.py --mlp-table-all "$MLP" treecompile.bench);;
  esac
  timeout 110 "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf --json "$OUT/rounds_$v.json" \
    > "$OUT/rounds_$v.log" 2>&1
  echo "rounds $v rc=$?"; grep -E "^\| treecompile|fused-MLP shapes|fuse_mlp:" "$OUT/rounds_$v.log" | sort | uniq -c | head -8
done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v "^raw.tgz$") && ls -la "$OUT"
