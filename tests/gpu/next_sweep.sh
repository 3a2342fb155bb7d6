#!/usr/bin/env bash
# Second call of the next GPU session (~3 min): cascade split sizes for small row counts (decode, SmolLM2-like
# short prefixes), where min_chunk = 256 keys leaves one live split walking its tiles one after another
# (SmolLM2 verify: cascade_partial 7.6 us a layer at a ~200-key prefix).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || exit 3
timeout 280 python3 -m treecompile.bench attention --sweep --nodes 1,32 --prefixes 256,2048 \
  --min-chunks default,64 --json "$OUT/sweep_small_rows.json" > "$OUT/sweep_small_rows.log" 2>&1
grep -A6 "^P=" "$OUT/sweep_small_rows.log" | tail -40
