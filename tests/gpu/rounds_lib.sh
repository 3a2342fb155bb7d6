# Sourced by the device scripts: one 8B round measurement of a named variant.
#   run_rounds NAME [VAR=VALUE ...] -- [COMMAND ...]
# runs `COMMAND rounds --inductor --nodes 64 --reps 10 --no-hf` (COMMAND defaults to `python3 -m treecompile.bench`)
# with the variables set, under a T_ROUNDS time limit (default 170 s); the log and JSON go to $OUT as
# rounds_NAME_<start>.{log,json}, and the table's treecompile rows are echoed. PROFILE=1 adds --profile
# $OUT/prof_NAME (torch.profiler kernel tables of each round). CLOCKS=1 samples the SM clock and the power draw
# every 100 ms during the run (nvidia-smi, rounds_NAME_<start>.clocks.csv) and echoes their medians and minima:
# the forty-eighth session traced H100s whose tensor-core GEMMs run 3-7% slower at the same copy bandwidth.
run_rounds() {
  local name=$1 vars=() cmd=() start
  shift
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do vars+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  cmd=("$@")
  [ ${#cmd[@]} -eq 0 ] && cmd=(python3 -m treecompile.bench)
  start=$(date +%s)
  local sampler=
  if [ -n "${CLOCKS:-}" ]; then
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 \
      > "$OUT/rounds_${name}_$start.clocks.csv" 2>/dev/null &
    sampler=$!
  fi
  env PYTHONUNBUFFERED=1 ${vars[@]+"${vars[@]}"} timeout "${T_ROUNDS:-170}" "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 \
    --no-hf --json "$OUT/rounds_${name}_$start.json" ${PROFILE:+--profile "$OUT/prof_${name}"} > "$OUT/rounds_${name}_$start.log" 2>&1
  echo "rounds $name rc=$? in $(( $(date +%s) - start )) s"
  if [ -n "$sampler" ]; then
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
    python3 - "$OUT/rounds_${name}_$start.clocks.csv" <<'EOF'
import statistics, sys
rows = [[float(v) for v in line.split(",")] for line in open(sys.argv[1]) if line.count(",") == 1]
busy = [r for r in rows if r[1] > 150]  # the samples under load (watts), not the compile's idle stretches
for label, sel in (("all", rows), ("over 150 W", busy)):
    if sel:
        sm, watts = zip(*sel)
        print(f"clocks {label}: {len(sel)} samples, SM median {statistics.median(sm):.0f} MHz (min {min(sm):.0f}), "
              f"power median {statistics.median(watts):.0f} W (max {max(watts):.0f})")
EOF
  fi
  grep -E "^\| treecompile|shapes installed|fuse_residual_norm" "$OUT/rounds_${name}_$start.log" | head -5
}
