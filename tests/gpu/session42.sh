#!/usr/bin/env bash
# Twenty-eighth session, right after tests/gpu/session27.sh (GGUF part 0, head moved out); this call carries
# .gguf/smol.gguf.part.1 and .whl, the head back in the tree. One captured graph a round against two: the GPU
# capture tests (both forms replay the eager round bit for bit), the shrink test through warm_up, then
# tests/gpu/round_ab.py --ab round-graphs: batch 1, all 56 held-out prompts, plain, (4, 4, 16) and (10, 6, 64), each
# speculator holding both forms, passes alternating. ~450 s.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
timeout ${T_TEST:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_speculator_gpu.py \
  tests/models/test_batch_shrink.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
cd /tmp && timeout ${T_AB:-400} python3 $OLDPWD/tests/gpu/round_ab.py "$OUT/round_graphs_ab.json" \
  --ab round-graphs --prompts ${PROMPTS:-56} --trees "${TREES:-4,4,16;10,6,64}" --repeats 2 > "$OUT/round_graphs_ab.log" 2>&1
echo "ab rc=$?"; grep -v "^\[e2e\]" "$OUT/round_graphs_ab.log" | tail -12
