#!/usr/bin/env bash
# Issue 4 on an H200 only (carry .whl; ~250 s there, ~10 s on anything else): the 8B rounds with every default,
# twice. On another GPU it only names it and stops, so a call that gets an H100 costs little beyond the start.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in *H200*) ;; *) echo "not an H200: nothing run"; exit 0;; esac
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
. tests/gpu/rounds_lib.sh
for v in ${VARIANTS:-default default}; do run_rounds "$v"; done
