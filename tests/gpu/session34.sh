#!/usr/bin/env bash
# Next device call (carry .whl; random weights, no GGUF; ~560 s: run it with timeout_s 600). The twenty-fifth session's batch e2e put a batch-4 round
# at 1.14 ms for (4, 4, 16) (64 verify rows: Triton skinny tiles) against 1.48 for (4, 5, 24) and 1.85 for
# (4, 6, 32) (96 / 128 rows: past the tiles' old 64-row limit, so cuBLAS). skinny_linear now takes up to 256 rows
# in row blocks, used only where measured: (1) sweep SmolLM2's shapes at 96 / 128 / 256 rows against cuBLAS;
# (2) loop_profile at batch 4 and 16 for (4, 4, 16), (4, 5, 24), (4, 6, 32), (2, 3, 6) without, then with, the
# sweep's winners registered (SKINNY_TILES), with kernel tables, so the round time says whether the band pays and
# the tables say where a round past 64 rows goes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh || exit 3
R=$PWD; cd /tmp
timeout ${T_SWEEP:-150} python3 $R/tests/gpu/skinny_sweep.py "$OUT/rows_sweep.json" rows > "$OUT/rows_sweep.log" 2>&1
echo "sweep rc=$?"; cut -c1-160 "$OUT/rows_sweep.log" | tail -15
for tiles in "" "$OUT/rows_sweep.json"; do
  tag=$([ -z "$tiles" ] && echo cublas || echo tiles)
  mkdir -p /tmp/prof_$tag
  SKINNY_TILES=$tiles BATCHES=4,16 SHAPES="4,4,16;4,5,24;4,6,32;2,3,6" DRAFT_VOCAB=12288 timeout ${T_PROF:-190} \
    python3 $R/tests/gpu/loop_profile.py "$OUT/loop_$tag.json" /tmp/prof_$tag fused-only > "$OUT/loop_$tag.log" 2>&1
  echo "loop_profile $tag rc=$?"
  tar czf "$OUT/prof_$tag.tgz" -C /tmp prof_$tag  # kernel tables: one file (a call returns only so many)
  python3 - "$OUT/loop_$tag.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if "error" in r:
        print(r["shape"], r.get("batch"), r["error"][:200]); continue
    print(r["shape"], "B", r["batch"], "round %.3f draft %.3f verify %.3f ms" % (
        r["ms_per_round_lookahead"], r["draft_gpu_ms"], r["verify_commit_gpu_ms"]))
PY
done
