#!/usr/bin/env bash
# Twenty-sixth session, call B (carry .gguf/smol.gguf.part.0, .gguf/sha256.txt, .whl; the shipped head moved out
# of the working tree for the 64 MiB carry limit): GGUF part 0 to /tmp/models for session37.sh, then the cuBLAS
# side of the 65-256-row question. session34.sh's tiles run put batch-4 (4, 5, 24) / (4, 6, 32) rounds at
# 1.266 / 1.380 ms with the sweep's winners registered; its cuBLAS run timed out after (4, 4, 16). Same
# loop_profile (random weights), no tiles, those two shapes first, so the pair can be compared.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/models
cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
bash tests/gpu/install.sh || exit 3
ls -la /tmp/models
R=$PWD; cd /tmp
for tiles in "" "${TILES_TOO:+$R/notes/gpu-2026-12-03-s26/rows_sweep.json}"; do
  [ -z "$tiles" ] && [ -f "$OUT/loop_cublas.json" ] && continue
  tag=$([ -z "$tiles" ] && echo cublas || echo tiles)
  SKINNY_TILES=$tiles BATCHES=4 SHAPES="${SHAPES:-4,6,32;4,5,24}" DRAFT_VOCAB=12288 timeout ${T_PROF:-200} \
    python3 $R/tests/gpu/loop_profile.py "$OUT/loop_$tag.json" - fused-only > "$OUT/loop_$tag.log" 2>&1
  echo "loop_profile $tag rc=$?"
  python3 - "$OUT/loop_$tag.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if "error" in r:
        print(r["shape"], r.get("batch"), r["error"][:200]); continue
    print(r["shape"], "B", r["batch"], "round %.3f draft %.3f verify %.3f ms" % (
        r["ms_per_round_lookahead"], r["draft_gpu_ms"], r["verify_commit_gpu_ms"]))
PY
done
