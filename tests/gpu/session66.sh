#!/usr/bin/env bash
# Issue 4 (carry .whl; ~400 s on a cold machine). The forty-first session's PDL-off profile of the H100 verify(64)
# (notes/gpu-2026-12-05-s41) shows its qkv and o projections on cuBLAS (nvjet, 20.3 + 16.8 us a layer). A cuBLAS
# kernel is no programmatic dependent launch: each one breaks the PDL chain on both sides, 64 times a verify,
# while the decode runs Triton kernels only (PDL took 244 us off the decode but 123 off the verify). Here the
# sweep's Triton tiles for those two shapes (20.9 / 15.6 us in isolation against cuBLAS's 21.0 / 15.3, so the
# table keeps cuBLAS) are forced in: does the unbroken chain win in the round?
# Variants: default, forced (qkv + o on Triton), default again (drift check).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
# The s40 H100 sweep's best tiles of the verify's qkv and o shapes, with cuBLAS counted as never faster.
python3 - "$OUT/force_qkv_o.json" <<'PY'
import json, sys
rows = [r for r in json.load(open("notes/gpu-2026-12-05-s40/tma_sweep.json")) if r["label"] in ("8b qkv", "8b o")]
assert len(rows) == 2, rows
json.dump([dict(r, cublas_us=1e9) for r in rows], open(sys.argv[1], "w"), indent=1)
print("forced:", [(r["label"], {k: r["best"][k] for k in ("block_n", "block_k", "warps", "stages")}) for r in rows])
PY
for v in default forced default2; do
  case $v in
    default*) cmd=(python3 -m treecompile.bench);;
    forced) cmd=(python3 tests/gpu/variant.py --table "$OUT/force_qkv_o.json" treecompile.bench);;
  esac
  start=$(date +%s)
  timeout ${T_ROUNDS:-160} "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf --json "$OUT/rounds_$v.json" \
    > "$OUT/rounds_$v.log" 2>&1
  echo "rounds $v rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\| treecompile|shapes installed" "$OUT/rounds_$v.log" | head -4
done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "json$") && ls -la "$OUT"
