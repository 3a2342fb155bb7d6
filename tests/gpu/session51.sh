#!/usr/bin/env bash
# Thirty-third session, first call (carry .whl; random weights). The thirty-second session made the lookahead
# launch only the next round's draft ahead of the stop-flag read, and ran out of device time after one of the
# four GPU lookahead tests; so first those four (they compare the split and whole-round lookahead with synced
# rounds) and the batch-shrink tests (a shrink after a split launch), then request_probe.py: the per-step split
# of a request's fixed cost after the cheaper check_projections and the one-call buffer reset. ~500 s.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout ${T_TESTS:-200} bash tests/gpu/session.sh -m gpu tests/runtime/test_speculator_gpu.py -k lookahead \
  > "$OUT/gpu_lookahead.log" 2>&1  # -k would deselect the shrink tests too: two runs
echo "lookahead gpu tests rc=$?"; grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/gpu_lookahead.log" | tail -8
timeout ${T_SHRINK:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_batch_shrink.py \
  > "$OUT/gpu_shrink.log" 2>&1
echo "shrink gpu tests rc=$?"; grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/gpu_shrink.log" | tail -8
R=$PWD; cd /tmp
timeout ${T_PROBE:-200} python3 $R/tests/gpu/request_probe.py "$OUT/probe.json" > "$OUT/probe.log" 2>&1
echo "request_probe rc=$?"
python3 - "$OUT/probe.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["shape"], "fixed", {k: round(v, 2) for k, v in r["fixed_ms"].items()})
    print(r["shape"], "split", {k: round(v, 3) for k, v in r["split_ms"].items()})
PY
