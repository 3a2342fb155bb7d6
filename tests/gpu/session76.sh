#!/usr/bin/env bash
# Issue 4, the verify's two biggest fused GEMMs (carry .whl; ~480 s cold): skinny_glu (86 us a layer on an H100
# against a 77 us read floor, 42% of a verify) and skinny_qkv_rope (22.6 against 16.5) run tiles derived from
# the plain GEMM's sweep, never swept for the fused ops themselves. Sweep both (tests/gpu/glu_bench.py,
# rope_bench.py; each config checked against float64 before it is timed), then time the 8B rounds with the
# winners (TREECOMPILE_SKINNY_GLU_TILES / _ROPE_TILES) against the defaults on the same machine.
#   BENCHES   which sweeps (default "glu rope"). SWEEP=0 skips them; GLU_TILES / ROPE_TILES then name the tiles ("n,k,warps,stages").
#   ONLY_H200=1  stop at once on any other GPU (the H200's glu / rope tiles were never swept; its rounds were last
#             timed in the forty-third session): `ONLY_H200=1 VARIANTS="default tuned default tuned"`, ~500 s.
#   otri      (H100) the 64-row o on Triton tiles (tests/gpu/h100_o64_triton.json): the verify's one cuBLAS GEMM.
#   o256      (H100) the same on the H200's 256-wide K steps (tests/gpu/h100_o64_bk256.json): the H100's default
#             since the forty-ninth session (the forty-eighth's otri ran 128-wide ones, which tied cuBLAS).
#   ocublas   the 64-row o on cuBLAS again (tests/gpu/h100_o64_cublas.json): the H100's default before o256 shipped.
#   VARIANTS  rounds to run (default "default tuned"); "tuned" sets whichever winners beat the default config by
#             >= 2% (each alone: glu, rope).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic CLOCKS=${CLOCKS-1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in *H200*) ;; *) [ -n "${ONLY_H200:-}" ] && { echo "not an H200: nothing run"; exit 0; };; esac
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv 2>&1 | tail -1
if [ "${SWEEP:-1}" = 1 ]; then
  for b in ${BENCHES:-glu rope}; do
    timeout ${T_SWEEP:-220} python3 tests/gpu/${b}_bench.py "$OUT/$b.json" sweep > "$OUT/$b.log" 2>&1
    echo "$b sweep rc=$?"; grep -v -E "failed:|wrong:" "$OUT/$b.log" | tail -14
  done
  # a winner counts when it beats the default config's own sweep time by >= 2%
  eval "$(python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
for name, var in (("glu", "GLU_TILES"), ("rope", "ROPE_TILES")):
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path) or not json.load(open(path)).get("sweep"):
        continue
    r = json.load(open(path))
    d = r["config"][1:]
    keys = ("block_n", "block_k", "warps", "stages")
    default = [s["us"] for s in r["sweep"] if [s[k] for k in keys] == d]
    best = r["sweep"][0]
    if default and best["us"] < 0.98 * default[0]:
        tiles = ",".join(str(best[k]) for k in keys)
        print(f"{var}={tiles}; echo '{name}: {tiles} {best['us']:.2f} us against the default {d} {default[0]:.2f}'")
    else:
        print(f"echo '{name}: no config beats the default {d} by 2% ({default[0] if default else None})'")
EOF
)"
fi
echo "GLU_TILES=${GLU_TILES:-} ROPE_TILES=${ROPE_TILES:-}" | tee "$OUT/winners.txt"
. tests/gpu/rounds_lib.sh
tuned=()
[ -n "${GLU_TILES:-}" ] && tuned+=(TREECOMPILE_SKINNY_GLU_TILES=$GLU_TILES)
[ -n "${ROPE_TILES:-}" ] && tuned+=(TREECOMPILE_SKINNY_ROPE_TILES=$ROPE_TILES)
for v in ${VARIANTS:-default tuned}; do
  case $v in
    default) run_rounds "$v";;
    tuned) [ ${#tuned[@]} -gt 0 ] && run_rounds "$v" "${tuned[@]}" || echo "tuned: no winner, not run";;
    glu) [ -n "${GLU_TILES:-}" ] && run_rounds "$v" TREECOMPILE_SKINNY_GLU_TILES=$GLU_TILES;;
    rope) [ -n "${ROPE_TILES:-}" ] && run_rounds "$v" TREECOMPILE_SKINNY_ROPE_TILES=$ROPE_TILES;;
    otri) run_rounds "$v" -- python3 tests/gpu/variant.py --table tests/gpu/h100_o64_triton.json treecompile.bench;;
    o256) run_rounds "$v" -- python3 tests/gpu/variant.py --table tests/gpu/h100_o64_bk256.json treecompile.bench;;
    ocublas) run_rounds "$v" -- python3 tests/gpu/variant.py --table tests/gpu/h100_o64_cublas.json treecompile.bench;;
    *) echo "unknown variant $v";;
  esac
done
