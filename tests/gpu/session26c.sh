#!/usr/bin/env bash
# Twentieth session, third call (carry .whl): what the compiled draft round's 10 us `triton_poi_fused_full_42`
# and its second ~9 us bit-mask kernel are (they are not in the per-hook round), from a fresh Inductor cache.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic_c
bash tests/gpu/install.sh || exit 3
R=$PWD; cd /tmp; rm -rf /tmp/ic_c; mkdir -p "$OUT/prof"
TREECOMPILE_COMPILED_DRAFT=1 SHAPES="8,6,64" DRAFT_VOCAB=8192 timeout ${T_PROF:-160} python3 $R/tests/gpu/loop_profile.py \
  "$OUT/loop_profile_compiled2.json" "$OUT/prof" fused-only > "$OUT/loop_profile_compiled2.log" 2>&1
echo "loop_profile rc=$?"; tail -1 "$OUT/loop_profile_compiled2.log" | cut -c1-600
python3 $R/tests/gpu/find_kernel.py /tmp/ic_c fused_full_42 > "$OUT/full_42.txt" 2>&1
python3 - "$OUT/prof/draft_8_6_64_inductor_fused.txt" > "$OUT/big_names.txt" <<'PY'
import sys
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) > 3 and parts[0].startswith("triton") and parts[-1] == "5":
        us = float(parts[-2].replace("us", "")) if parts[-2].endswith("us") else 0
        if us > 5: print(parts[0])
PY
cat "$OUT/big_names.txt"
for n in $(cat "$OUT/big_names.txt" | sed 's/\.\.\.$//'); do python3 $R/tests/gpu/find_kernel.py /tmp/ic_c "$n" > "$OUT/k_$n.txt" 2>&1; done
wc -c "$OUT"/*.txt
