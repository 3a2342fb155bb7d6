# Sourced by the device scripts: one 8B round measurement of a named variant.
#   run_rounds NAME [VAR=VALUE ...] -- [COMMAND ...]
# runs `COMMAND rounds --inductor --nodes 64 --reps 10 --no-hf` (COMMAND defaults to `python3 -m treecompile.bench`)
# with the variables set, under a T_ROUNDS time limit (default 170 s); the log and JSON go to $OUT as
# rounds_NAME_<start>.{log,json}, and the table's treecompile rows are echoed. PROFILE=1 adds --profile
# $OUT/prof_NAME (torch.profiler kernel tables of each round).
run_rounds() {
  local name=$1 vars=() cmd=() start
  shift
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do vars+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  cmd=("$@")
  [ ${#cmd[@]} -eq 0 ] && cmd=(python3 -m treecompile.bench)
  start=$(date +%s)
  env PYTHONUNBUFFERED=1 ${vars[@]+"${vars[@]}"} timeout "${T_ROUNDS:-170}" "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 \
    --no-hf --json "$OUT/rounds_${name}_$start.json" ${PROFILE:+--profile "$OUT/prof_${name}"} > "$OUT/rounds_${name}_$start.log" 2>&1
  echo "rounds $name rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\| treecompile|shapes installed|fuse_residual_norm" "$OUT/rounds_${name}_$start.log" | head -5
}
