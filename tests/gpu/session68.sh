#!/usr/bin/env bash
# Ran in the forty-second session (notes/gpu-2026-12-05-s42.md). Stream-K lost there and was removed after, with
# skinny_sweep.py's streamk mode: step 1 no longer runs (T_SWEEP=0 skips it).
# Issue 4, next device call (carry .whl; ~700 s on a cold machine: split it with VARIANTS / T_SWEEP=0, or let the
# last step be cut: it is the least needed). The forty-first session's PDL-off profile of the H100 verify(64): its
# 64-row GEMMs run 5-7 us above their weight-read floors each, where the decode's gemv kernels run ~1.4 us above (notes/gpu-2026-12-05-s41).
# 1. skinny_sweep.py streamk 64: the 8B layer shapes as stream-K runs (SkinnyConfig.stream_k, built then) against
#    whole slices a program, cuBLAS and the shipped tiles;
# 2. 8B rounds: default, then the sweep installed (tests/gpu/variant.py --table);
# 3. 8B rounds with TREECOMPILE_SKINNY_GLU=1 (the verify's gate/up + silu-mul as one treespec::skinny_glu GEMM);
# 4. 8B rounds with the old routing (variant.py --old-routing: measured_tiles's min(key=...) broke the drafter's
#    compiled round at every linear_rows call): the draft round's A/B against 2's default;
# VARIANTS="default glu" (say) runs only those rounds.
# PROBE=1 first runs tests/gpu/graph_breaks.py (graph breaks of a tiny speculator, old vs new routing, ~60 s).
# ATTN=1 last runs the verify attention's stage-1 sweep at P=2k, N=64 with 256-key minimum chunks too (the s41
# sweep capped the 128-row tiles at 5 splits by their 512-key default).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
if [ -n "${PROBE:-}" ]; then
  timeout 100 python3 tests/gpu/graph_breaks.py "$OUT/graph_breaks.json" 2>&1 | grep -E "^gpu|graph breaks|^   |same tokens" \
    | tee "$OUT/graph_breaks.log" | cut -c1-240
fi
if [ "${T_SWEEP:-150}" != 0 ]; then
  timeout ${T_SWEEP:-150} python3 tests/gpu/skinny_sweep.py "$OUT/streamk_sweep.json" streamk 64 2>&1 | grep -v "^INFO" \
    | tee "$OUT/streamk_sweep.log" | cut -c1-300
fi
for v in ${VARIANTS:-default table glu old_routing}; do
  env=()
  case $v in
    default) cmd=(python3 -m treecompile.bench);;
    table) cmd=(python3 tests/gpu/variant.py --table "$OUT/streamk_sweep.json" treecompile.bench);;
    glu) cmd=(python3 -m treecompile.bench); env=(TREECOMPILE_SKINNY_GLU=1);;
    old_routing) cmd=(python3 tests/gpu/variant.py --old-routing treecompile.bench);;
  esac
  start=$(date +%s)
  env "${env[@]}" timeout ${T_ROUNDS:-165} "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf --json "$OUT/rounds_$v.json" \
    > "$OUT/rounds_$v.log" 2>&1
  echo "rounds $v rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\| treecompile|shapes installed|variant:" "$OUT/rounds_$v.log" | head -5
done
if [ -n "${ATTN:-}" ]; then
  timeout ${T_ATTN:-200} python3 -m treecompile.bench attention --sweep --nodes 64 --prefixes 2048 \
    --min-chunks default,256 --json "$OUT/attn_sweep64.json" 2>&1 | grep -v "^INFO" > "$OUT/attn_sweep64.log"
  echo "attention sweep rc=$?"; grep -A8 "^P=" "$OUT/attn_sweep64.log" | head -10
fi
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "json$") && ls -la "$OUT"
