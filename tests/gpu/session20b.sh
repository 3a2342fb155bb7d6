#!/usr/bin/env bash
# Fourteenth session, second device call (carry .gguf/smol.gguf.part.ab): the `-m gpu` tests of tests/runtime
# and tests/models under the defaults; 8B rounds as shipped (every default); then rounds with the verify's
# split count set to the fastest split variant of the first call's cascade_ab (launches of > 128 rows a KV
# head only: the decode and the draft lanes keep theirs). Issue 4: verify <= 1.15x decode.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
cp .gguf/smol.gguf.part.* /tmp/models/ 2>/dev/null
timeout 280 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests/runtime tests/models \
  > "$OUT/gpu_runtime.log" 2>&1
echo "gpu runtime/models rc=$? $(tail -1 "$OUT/gpu_runtime.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_runtime.log" | head
R="treecompile.bench rounds --inductor --nodes 64 --reps 10"
timeout 150 python3 -m $R --json "$OUT/rounds_default.json" > "$OUT/rounds_default.log" 2>&1
echo "rounds default rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_default.log" | cut -c1-110
NS=$(python3 - <<'PY'
import json
r = [p for p in json.load(open("/tmp/ab.json")) if p["N"] == 64][0]["variants"]
splits = {n: v["us"] for n, v in r.items() if n.startswith("splits")}
best = min(splits, key=splits.get) if splits else ""
print(best[6:] if best and splits[best] < r["default"]["us"] else "")
PY
)
echo "verify split variant: '${NS}'"
if [ -n "$NS" ]; then
  timeout 110 python3 tests/gpu/variant.py --cascade-heavy "num_splits=$NS" $R --json "$OUT/rounds_split.json" \
    > "$OUT/rounds_split.log" 2>&1
  echo "rounds split $NS rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_split.log" | cut -c1-110
fi
