#!/usr/bin/env bash
# Eleventh session's last device call, in the foreground (the daemon of session15.sh died with a machine
# released while the caller was away): SmolLM2 e2e batch 1, tc plain + (8, 6, 64), main against
# --skinny-linears with the gemv sweep's table; then the -m gpu tests session15.sh did not reach
# (tests/gpu/rest_s11.txt). Logs and JSON in $OUT. Run after tests/gpu/smol_setup.sh in the same call.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
E="treecompile.bench e2e --model smollm2 --batch-sizes 1 --prompts 12 --max-new-tokens 256 --inductor --trees 8,6,64 --repeats 2 --configs tc_plain,tc_tree"
timeout 150 python3 -m $E --json "$OUT/e2e_main.json" > "$OUT/e2e_main.log" 2>&1
echo "e2e main rc=$?"; grep "^|" "$OUT/e2e_main.log" | tail -4
timeout 150 python3 tests/gpu/variant.py --table notes/gpu-2026-12-01-s11/gemv_sweep.json $E --skinny-linears \
  --json "$OUT/e2e_gemv.json" > "$OUT/e2e_gemv.log" 2>&1
echo "e2e gemv rc=$?"; grep "^|" "$OUT/e2e_gemv.log" | tail -4
timeout 200 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu $(cat tests/gpu/rest_s11.txt) > "$OUT/gpu_rest.log" 2>&1
echo "gpu rest rc=$?"; tail -30 "$OUT/gpu_rest.log"
