#!/usr/bin/env bash
# Issue 4, next device call (carry .whl; ~600 s on a cold H200: VARIANTS=... to split). The forty-second session moved the H200's 8B
# 1-row rows onto the pipelined gemv and the 64-row o onto Triton (ops/skinny_linear.py, above _MEASURED), and
# measured treespec::skinny_glu once on an H200 (verify(64) 5.215-5.232 -> 5.147 ms).
# 8B rounds, by variant:
#   default   the shipped tables;
#   rope      TREECOMPILE_SKINNY_ROPE=1 (on by default since the forty-third session; the verify's q/k/v GEMM with the rotary embedding as its epilogue,
#             treespec::skinny_qkv_rope: its GPU tests run first; one H100 run so far, not a same-machine A/B);
#   noglu     TREECOMPILE_SKINNY_GLU=0 (skinny_glu, on by default since, off: its A/B);
#   old       H200 only: the forty-first session's rows (tests/gpu/h200_s41_rows.json), the A/B of the new table;
#   o_cublas  H200 only: the new table but the 64-row o back on cuBLAS (tests/gpu/h200_s41_o64.json);
#   m4_gemv   every 8B 4-row GEMM (the draft lanes) forced onto the pipelined gemv, cuBLAS counted as never faster
#             (tests/gpu/h200_m4_gemv.json / h100_m4_gemv.json): the H200's draft round is 1.36x its floor (1.3x),
#             the H100's draft round spends 25% + 12% of its kernel time in two cuBLAS GEMMs (84.2, 38.3 us a call),
#             cuBLAS keeps those shapes by 1-8% in isolation, and in the verify a cuBLAS o lost to Triton in the
#             round though it tied alone (dependent launches);
#   fmlp      H200 only: TREECOMPILE_FUSED_MLP=1 (the <= 16-row MLP as one weight stream: the draft lanes' MLPs;
#             it lost on the H100 in the thirty-ninth session, never timed in an H200 round).
# BENCH=1 first runs tests/gpu/rope_bench.py with its tile sweep (~2 min): the fused op's own tiles; its winner
#   then runs as the variant rope_swept (TREECOMPILE_SKINNY_ROPE_TILES) after rope.
# PROFILE=1 adds a PDL-off kernel-time profile of the default (glu) rounds (where the verify's time goes with it).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in *H200*) all="default rope noglu old o_cublas m4_gemv fmlp";; *) all="default rope noglu m4_gemv";; esac
[ -n "${PROFILE:-}" ] && all="$all glu_prof"
rope_tiles=""
if [ -n "${BENCH:-}" ]; then
  timeout 200 python3 tests/gpu/rope_bench.py "$OUT/rope_bench.json" sweep 2>&1 | grep -v "^INFO" | tail -14
  rope_tiles=$(python3 -c "import json; b = json.load(open('$OUT/rope_bench.json'))['sweep'][0]; \
print(','.join(str(b[k]) for k in ('block_n', 'block_k', 'warps', 'stages')))" 2>/dev/null)
  [ -n "$rope_tiles" ] && { echo "rope sweep winner: $rope_tiles"; all="${all/rope /rope rope_swept }"; }
fi
case " ${VARIANTS:-$all} " in *" rope "*)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_skinny_qkv_rope.py tests/passes/test_fuse_qkv_rope.py \
    > "$OUT/rope_tests.log" 2>&1; echo "rope GPU tests rc=$?"; tail -3 "$OUT/rope_tests.log";;
esac
for v in ${VARIANTS:-$all}; do
  env=(PYTHONUNBUFFERED=1); cmd=(python3 -m treecompile.bench); extra=()
  case $v in
    default) ;;
    noglu) env+=(TREECOMPILE_SKINNY_GLU=0);;
    rope) env+=(TREECOMPILE_SKINNY_ROPE=1);;
    rope_swept) env+=(TREECOMPILE_SKINNY_ROPE=1 "TREECOMPILE_SKINNY_ROPE_TILES=$rope_tiles");;
    glu) env+=(TREECOMPILE_SKINNY_GLU=1);;
    glu_prof) env+=(TREECOMPILE_SKINNY_GLU=1 TREECOMPILE_PDL=0); extra=(--profile "$OUT/prof");;
    old) cmd=(python3 tests/gpu/variant.py --table tests/gpu/h200_s41_rows.json treecompile.bench);;
    o_cublas) cmd=(python3 tests/gpu/variant.py --table tests/gpu/h200_s41_o64.json treecompile.bench);;
    fmlp) env+=(TREECOMPILE_FUSED_MLP=1);;
    m4_gemv) table=tests/gpu/h100_m4_gemv.json; case $gpu in *H200*) table=tests/gpu/h200_m4_gemv.json;; esac
      cmd=(python3 tests/gpu/variant.py --table $table treecompile.bench);;
    *) echo "unknown variant $v"; continue;;
  esac
  start=$(date +%s)
  env "${env[@]}" timeout ${T_ROUNDS:-165} "${cmd[@]}" rounds --inductor --nodes 64 --reps 10 --no-hf \
    --json "$OUT/rounds_$v.json" "${extra[@]}" > "$OUT/rounds_$v.log" 2>&1
  echo "rounds $v rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\| treecompile|shapes installed|variant:" "$OUT/rounds_$v.log" | head -5
done
for f in "$OUT"/prof/*.txt; do [ -e "$f" ] && { echo "== $f"; head -24 "$f" | cut -c1-200; }; done
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "json$") && ls -la "$OUT"
