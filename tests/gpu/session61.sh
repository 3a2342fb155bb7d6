#!/usr/bin/env bash
# Its short form ran in the thirty-ninth session on an H100 (session62.sh + session63.sh): the pipelined gemv ships in the H100 SXM table. session64.sh sweeps it on an H200.
# Issue 4, the gemv kernel's compiler-pipelined loop (carry .whl; ~550 s). An sm_90 compile (Triton 3.9 on the CPU
# machine) shows the shipped gemv kernel's register double buffer compiles to no async copy, one tile in flight;
# the PIPELINE loop compiles to async copies with NUM_STAGES - 1 tiles in flight. The 8B o and qkv projections
# at 1 row stream at 2.9-3.2 TB/s (floor: ~4.3), ~7 us a layer above their floors together.
# 1. The skinny GPU tests of the new kernel path (graph replay after a kernel that writes x).
# 2. skinny_sweep.py pipe: pipelined gemv (dependent launch) against cuBLAS and the shipped choice, 1 and 4 rows,
#    8B layer + head shapes first, then SmolLM2's.
# 3. 8B rounds: the sweep's winners installed (tests/gpu/variant.py --table) against every default, one each.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_skinny_linear.py -k pipelined \
  > "$OUT/gpu_tests.log" 2>&1
echo "pipelined gemv gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
timeout ${T_SWEEP:-280} python3 tests/gpu/skinny_sweep.py "$OUT/pipe_sweep.json" pipe 2>&1 | grep -v "^INFO" \
  | tee "$OUT/pipe_sweep.log" | cut -c1-160
for v in table default; do
  case $v in
    default) cmd=(python3 -m treecompile.bench);;
    table) cmd=(python3 tests/gpu/variant.py --table "$OUT/pipe_sweep.json" treecompile.bench);;
  esac
  timeout 110 "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf --json "$OUT/rounds_$v.json" \
    > "$OUT/rounds_$v.log" 2>&1
  echo "rounds $v rc=$?"; grep -E "^\| treecompile|swept shapes" "$OUT/rounds_$v.log" | head -5
done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "^pipe_sweep.json$") && ls -la "$OUT"
