#!/usr/bin/env bash
# Next session's plan, second device call (carry .gguf/smol.gguf.part.ab): the split-K sweep at 4 rows (the 8B
# draft head's lanes); 8B rounds with every default (the cascade's wave rule: 7 verify / 32 decode splits at
# ctx 2k, never run as the default in rounds), then with both sweeps' winners installed (variant.py --table), then
# with L2 hints before the dependency waits (cascade and skinny GEMMs, four tiles a program).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
cp .gguf/smol.gguf.part.* /tmp/models/ 2>/dev/null
timeout 180 python3 tests/gpu/skinny_sweep.py "$OUT/splitk_b.json" splitk 4 > "$OUT/splitk_b.log" 2>&1
echo "splitk 4 rc=$?"; cut -c1-150 "$OUT/splitk_b.log" | grep "M="
python3 -c "import json; json.dump(sum((json.load(open(p)) for p in ['/tmp/splitk_a.json', '$OUT/splitk_b.json']), []), open('/tmp/splitk.json', 'w'))"
R="treecompile.bench rounds --inductor --nodes 64 --reps 10"
timeout 150 python3 -m $R --json "$OUT/rounds_default.json" > "$OUT/rounds_default.log" 2>&1
echo "rounds default rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_default.log" | cut -c1-110
timeout 110 python3 tests/gpu/variant.py --table /tmp/splitk.json $R --json "$OUT/rounds_splitk.json" \
  > "$OUT/rounds_splitk.log" 2>&1
echo "rounds splitk rc=$?"; grep -E "^variant|^\| (treecompile|draft|c )" "$OUT/rounds_splitk.log" | cut -c1-110
TREECOMPILE_CASCADE=l2_prefetch=4 TREECOMPILE_SKINNY_L2_PREFETCH=4 timeout 110 python3 -m $R \
  --json "$OUT/rounds_l2.json" > "$OUT/rounds_l2.log" 2>&1
echo "rounds l2 rc=$?"; grep -E "^\| (treecompile|draft|c )" "$OUT/rounds_l2.log" | cut -c1-110
