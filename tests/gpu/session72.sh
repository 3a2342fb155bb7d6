#!/usr/bin/env bash
# Issue 3 on whatever Hopper comes, and issue 4 where it is an H200 (carry .whl; ~250 s on an H100, ~450 s on an H200).
#   - The attention benchmark at the issue's >= 4k points, with its "read us" column: one streaming read of the same
#     K+V bytes per layer (thirty-seventh session, H200: 1.48x the bandwidth floor at 4k, so the 1.5x bound
#     there leaves ~0.1 us for the attention itself). This asks the same of an H100, whose floors are ~1.4x longer.
#   - On an H200 only, first: the 8B rounds with every default, twice (last measured in the forty-third session).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in
  *H200*) . tests/gpu/rounds_lib.sh; for v in default default; do run_rounds "$v"; done;;
esac
timeout ${T_ATT:-300} python3 -m treecompile.bench attention --nodes ${NODES:-16,64} --prefixes ${PREFIXES:-4096,16384,65536} \
  --json "$OUT/attention.json" 2>&1 | grep -v "^INFO" | tee "$OUT/attention.log" | tail -40
