#!/usr/bin/env bash
# Issue 4: the 8B rounds A/B that session62.sh cut short (its 100 s rounds timed out on a cold H100 while compiling).
# Carry .whl. ~450 s. h200: the H200 table alone (variant.py --no-gpu-table); default: every default, so on an
# H100 SXM the pipelined gemv entries of skinny_linear._MEASURED_BY_GPU (from session62's sweep).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
for v in h200 default; do
  case $v in
    default) cmd=(python3 -m treecompile.bench);;
    h200) cmd=(python3 tests/gpu/variant.py --no-gpu-table treecompile.bench);;
  esac
  start=$(date +%s)
  timeout ${T_ROUNDS:-260} "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf --json "$OUT/rounds_$v.json" \
    > "$OUT/rounds_$v.log" 2>&1
  echo "rounds $v rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\| treecompile|^copy bandwidth|^c = |shapes installed|tiles dropped|wall" "$OUT/rounds_$v.log" | head -12
done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "^rounds_.*json$") && ls -la "$OUT"
