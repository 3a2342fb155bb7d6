#!/usr/bin/env bash
# Twelfth-session plan, third device call (lowest priority): issue 3's N = 64 points, where flex_attention
# failed before (its decoding kernel finds no config; the bench now retries its main kernel), with the
# cascade plain and as dependent launches (TREECOMPILE_PDL=1) in two processes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
A="treecompile.bench attention --nodes 64 --prefixes 4096,16384,65536"
for pdl in 0 1; do
  TREECOMPILE_PDL=$pdl timeout 250 python3 -m $A --json "$OUT/attention_pdl$pdl.json" > "$OUT/attention_pdl$pdl.log" 2>&1
  echo "attention TREECOMPILE_PDL=$pdl rc=$?"; grep "^|" "$OUT/attention_pdl$pdl.log" | head -8
done
