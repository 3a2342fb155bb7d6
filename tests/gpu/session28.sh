#!/usr/bin/env bash
# Next session, second device call (after tests/gpu/session27.sh with part 0; carry .gguf/smol.gguf.part.1, .whl):
# with the twenty-first session's head (12288 ids: tau 3.60, 1.86x plain on (8, 6, 64)), which tree shape and
# which draft round pay. Issue 5's 2.0x needs, at tau 3.60, a round of ~1.28 ms against 1.375. One e2e process,
# 24 prompts (the 12-prompt tau's standard error is ~0.07): plain and four trees; then the best two under the
# compiled draft round (TREECOMPILE_COMPILED_DRAFT=1: -2.7% a round in the twentieth session, opt-in).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
R=$PWD; cd /tmp
timeout ${T_SHAPES:-330} python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 24 --max-new-tokens 256 \
  --inductor --repeats 2 --configs tc_plain,tc_tree --trees "${TREES:-8,6,64;8,7,64;8,6,48;10,6,64}" \
  --json "$OUT/e2e_shapes.json" > "$OUT/e2e_shapes.log" 2>&1
echo "shapes rc=$?"; grep -E "^\|" "$OUT/e2e_shapes.log"
TREECOMPILE_COMPILED_DRAFT=1 timeout ${T_COMPILED:-200} python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 \
  --prompts 24 --max-new-tokens 256 --inductor --repeats 2 --configs tc_tree --trees "${TREES_C:-8,6,64;8,7,64}" \
  --json "$OUT/e2e_compiled.json" > "$OUT/e2e_compiled.log" 2>&1
echo "compiled rc=$?"; grep -E "^\|" "$OUT/e2e_compiled.log"
# Issue 5's batch 4 and 16 rows have not been measured with this head (eighteenth session's head: 1.38x / 0.81x).
if [ "${B416:-0}" = 1 ]; then
  timeout ${T_B416:-240} python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 4,16 --prompts 16 --max-new-tokens 256 \
    --inductor --repeats 1 --configs tc_plain,tc_tree --trees "${TREES_B:-8,6,64;4,6,32}" \
    --json "$OUT/e2e_b416.json" > "$OUT/e2e_b416.log" 2>&1
  echo "b4/b16 rc=$?"; grep -E "^\|" "$OUT/e2e_b416.log"
fi
