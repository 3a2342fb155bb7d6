#!/usr/bin/env bash
# Issue 4, next device call (carry .whl; ~420 s on a cold H100). An H200 runs session64.sh instead: it has neither
# the pipelined-gemv sweep nor the 64-row tile sweep that each took time off the H100's rounds.
# H100: verify(64) is 1.19x the decode (6.671 vs 5.621 ms; target 1.15x, ~210 us short). Where the rest goes:
# 1. 8B rounds with PDL off and a kernel-time profile (with PDL on, a kernel's time includes its wait for the one
#    before, so the table misleads); the same rounds with PDL on for the timing;
# 2. the verify attention's stage-1 sweep at P=2k, N=64 (its tiles and split rule were swept on the H200).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in *H200*) exec bash tests/gpu/session64.sh;; esac
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
for v in pdl0 default; do
  start=$(date +%s)
  case $v in
    pdl0) env=(TREECOMPILE_PDL=0); prof=(--profile "$OUT/prof");;
    default) env=(); prof=();;
  esac
  env "${env[@]}" timeout ${T_ROUNDS:-150} python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --no-hf \
    --json "$OUT/rounds_$v.json" "${prof[@]}" > "$OUT/rounds_$v.log" 2>&1
  echo "rounds $v rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\| treecompile|^copy bandwidth" "$OUT/rounds_$v.log" | head -4
done
for f in "$OUT"/prof/*.txt; do [ -e "$f" ] && { echo "== $f"; head -24 "$f" | cut -c1-200; }; done
timeout ${T_SWEEP:-200} python3 -m treecompile.bench attention --sweep --nodes 64 --prefixes 2048 \
  --json "$OUT/attn_sweep64.json" 2>&1 | grep -v "^INFO" > "$OUT/attn_sweep64.log"
echo "attention sweep rc=$?"; grep -A8 "^P=" "$OUT/attn_sweep64.log" | head -12
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "json$") && ls -la "$OUT"
