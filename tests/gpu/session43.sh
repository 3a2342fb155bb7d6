#!/usr/bin/env bash
# Next session, right after tests/gpu/session27.sh (GGUF part 0; the head AND notes/ moved out of the tree, see
# make_carry.sh); this call carries .gguf/smol.gguf.part.1 and .whl, the head back in the tree. The compiled
# draft round (TREECOMPILE_COMPILED_DRAFT=1, opt-in) against the per-hook draft, both captured on one speculator
# per tree, passes alternating (its earlier A/Bs, 1.9-2.8% a round, ran in separate processes): batch 1, all 56
# held-out prompts, plain (the ratio's baseline), (4, 4, 16), (10, 6, 64). If the compiled round wins in the same
# process, it can become the default. ~450 s (timeout_s 600).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
R=$PWD; cd /tmp && timeout ${T_AB:-540} python3 $R/tests/gpu/round_ab.py "$OUT/compiled_draft_ab.json" \
  --ab compiled-draft --prompts ${PROMPTS:-56} --trees "${TREES:-4,4,16;10,6,64}" --repeats 2 \
  > "$OUT/compiled_draft_ab.log" 2>&1
echo "ab rc=$?"; grep -v "^\[e2e\]\|Converting\|Loading weights\|Writing model" "$OUT/compiled_draft_ab.log" | tail -12
