#!/usr/bin/env bash
# Twentieth session, second call (carry .whl): l2_probe with the L2 touch variants; loop_profile per-hook
# draft (the same machine as call 1's compiled-draft run).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/install.sh || exit 3
R=$PWD; cd /tmp
timeout ${T_PROBE:-200} python3 $R/tests/gpu/l2_probe.py "$OUT/l2_probe2.json" 8,6,64 > "$OUT/l2_probe2.log" 2>&1
echo "l2_probe rc=$?"; tail -1 "$OUT/l2_probe2.log" | cut -c1-2500
if [ "${T_PROF:-0}" -gt 0 ]; then
  SHAPES="8,6,64" DRAFT_VOCAB=8192 timeout $T_PROF python3 $R/tests/gpu/loop_profile.py \
    "$OUT/loop_profile_hooks.json" - fused-only > "$OUT/loop_profile_hooks.log" 2>&1
  echo "loop_profile per-hook rc=$?"; tail -1 "$OUT/loop_profile_hooks.log" | cut -c1-800
fi
