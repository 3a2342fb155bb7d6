#!/usr/bin/env bash
# Twenty-fourth session, second device call (after tests/gpu/session27.sh with GGUF part 0; carry
# .gguf/smol.gguf.part.1, .whl; the shipped head back in the tree). The machine with the training daemon was
# released while this side was cut off, and the budget left (~1180 s) cannot hold data + training again, so this
# call measures what decides the GPU default instead, in the call itself (no daemon to lose): SmolLM2 e2e batch 1
# on all 56 held-out prompts (24 before), the shipped head, 256 tokens, --inductor --repeats 2:
#   1. TREECOMPILE_COMPILED_DRAFT=1: plain, (10, 6, 64), (8, 6, 64) in one process;
#   2. per-hook draft: plain, (10, 6, 64), (8, 6, 64) in another.
# Results straight into $OUT (each JSON is rewritten after every configuration, so a timeout keeps what ran).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
E2E="--model smollm2 --batch-sizes 1 --prompts ${PROMPTS:-56} --max-new-tokens 256 --inductor --repeats 2"
TREES=${TREES:-"10,6,64;8,6,64"}
TREECOMPILE_COMPILED_DRAFT=1 timeout ${T_COMPILED:-290} python3 -m treecompile.bench e2e $E2E --configs tc_plain,tc_tree \
  --trees "$TREES" --json "$OUT/e2e_compiled56.json" > "$OUT/e2e_compiled56.log" 2>&1
echo "compiled rc=$?"; tail -12 "$OUT/e2e_compiled56.log"
timeout ${T_HOOKS:-220} python3 -m treecompile.bench e2e $E2E --configs tc_plain,tc_tree \
  --trees "$TREES" --json "$OUT/e2e_hooks56.json" > "$OUT/e2e_hooks56.log" 2>&1
echo "per-hook rc=$?"; tail -12 "$OUT/e2e_hooks56.log"
ls -la "$OUT"
