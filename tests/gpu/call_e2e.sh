#!/usr/bin/env bash
# Fourth session: the GPU tests this session's third call failed on (fixed since), then SmolLM2 end to end
# with Inductor after the captured commit / compiled DraftTree / fused top-k (needs the GGUF parts carried by
# the two calls before: tests/gpu/smol_setup.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bash tests/gpu/smol_setup.sh 2>&1 | tail -2
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_draft_tree.py tests/models/test_eagle_drafter.py \
  -m gpu 2>&1 | tail -3
timeout 330 python3 -m treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --configs tc_plain,tc_chain,tc_tree --trees "4,6,32;8,6,64;4,5,16" --json "$OUT/e2e_b1.json" \
  --plot "$OUT/e2e_b1.png" 2>&1 | grep -v "DEBUG\|Warn\|warn" | tail -25
