#!/usr/bin/env bash
# Issue 4 on an H200 only (carry .whl; ~550 s there, ~10 s on anything else). The H200's 64-row GEMMs sit far
# over their read floors (its table, ops/skinny_linear.py: qkv 17.7 us against 11.8, o 12.0 against 7.9, down 34.4
# against 27.5; gate/up 60.2 against 55), where the H100's run 1.08-1.11x (fused ops) and its 1-row gemv ~1.05x:
# at 4.3 TB/s a program needs more bytes in flight than the swept tiles of the first sessions keep. The H200 never
# had the TMA sweep (the H100 had it in the fortieth session). So: `skinny_sweep.py tma 64` over the 8B layer shapes
# (each config checked first; rows carry best.tma), then the 8B rounds with that table installed (`variant.py
# --table`: down and o take their winners where they beat cuBLAS; skinny_glu and skinny_qkv_rope derive their tiles
# from the gate/up and q/k/v rows) against the defaults, on the same machine.
#   ELSE_ROUNDS=1  on another GPU, one default rounds run with the SM clock and power sampled (CLOCKS, rounds_lib.sh).
#   FIRST  rounds before the sweep (default "default": the H200's issue-4 numbers come first, and survive a call
#          cut short); VARIANTS  rounds after it (default "table default"; "prof" = the defaults profiled);
#          T_SWEEP the sweep's limit (default 200 s; 0 skips it).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic CLOCKS=${CLOCKS-1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
. tests/gpu/rounds_lib.sh
case $gpu in *H200*) ;; *)
  if [ -z "${ANY_GPU:-}" ]; then  # another GPU: one default rounds run with its clocks under load, or nothing
    [ -n "${ELSE_ROUNDS:-}" ] && run_rounds default
    echo "not an H200: no sweep"; exit 0
  fi;;
esac
run_variant() {
  case $1 in
    default) run_rounds "$1";;
    prof) PROFILE=1 run_rounds "$1";;  # the defaults, then kernel tables and Chrome traces (tests/gpu/trace_gaps.py)
    table) [ -s "$OUT/tma64.json" ] && run_rounds "$1" -- python3 tests/gpu/variant.py --table "$OUT/tma64.json" \
      treecompile.bench;;
    *) echo "unknown variant $1";;
  esac
}
for v in ${FIRST-default}; do run_variant "$v"; done
if [ "${T_SWEEP:-200}" != 0 ]; then
  timeout ${T_SWEEP:-200} python3 tests/gpu/skinny_sweep.py "$OUT/tma64.json" tma 64 "8b gate_up|8b down|8b qkv|8b o" \
    > "$OUT/tma64.log" 2>&1
  echo "tma sweep rc=$?"; tail -12 "$OUT/tma64.log" | cut -c1-200
fi
for v in ${VARIANTS-table default}; do run_variant "$v"; done
[ -d "$OUT/prof_prof" ] && tar czf "$OUT/prof.tgz" -C "$OUT" --remove-files prof_prof  # traces: one small file back
true
