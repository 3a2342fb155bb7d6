#!/usr/bin/env bash
# Issue 3's short-prefix gap, cross-layer overlap (carry .whl; ~200 s): the attention benchmark at 4k and 16k with
# each prefix split's first tiles hinted into L2 before its dependency wait (TREECOMPILE_CASCADE=l2_prefetch=T).
# The bench's layers are independent, like a real forward's prefixes (written rounds earlier), so under PDL the next
# layer's stage 1 can pull its prefix while the previous layer's merge runs. At 4k a split is ~2 tiles (N = 16) or
# ~4 (N = 64), so 2 / 4 hinted tiles cover most of it. The fifteenth session measured these hints only at the 8B
# rounds' 2k shapes (slower there).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
echo "gpu: $(python3 -c "import torch; print(torch.cuda.get_device_name())")"
for t in ${TILES:-0 2 4 0}; do
  start=$(date +%s)
  TREECOMPILE_CASCADE="l2_prefetch=$t" timeout ${T_ATT:-150} python3 -m treecompile.bench attention --nodes 16,64 \
    --prefixes ${PREFIXES:-4096,16384} --json "$OUT/att_l2_${t}_$start.json" > "$OUT/att_l2_${t}_$start.log" 2>&1
  echo "l2_prefetch=$t rc=$? in $(( $(date +%s) - start )) s"
  sed -n '/^per layer/,/^$/p' "$OUT/att_l2_${t}_$start.log" | grep -E "^\| [0-9]" | cut -d'|' -f2-5,8,10-12
done
