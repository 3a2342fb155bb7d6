#!/usr/bin/env bash
# The measurements the third session of 2026-11-30 left open, in one device call (~7 min on a warm H200):
# the rounds after the argmax change (issue 4: verify(64) was 1.152x decode(1), target 1.15x), the chunked
# GDN launch options (tf32x3), and the attention table after the merge change. Partial output survives a
# timeout under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || exit 3
timeout 200 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$OUT/rounds.json" 2>&1 \
  | grep "^\[rounds\] tree\|^|\|^- \|^c =" | tee "$OUT/rounds.log"
timeout 120 python3 tests/gpu/gdn_sweep.py "$OUT/gdn_sweep.json" 2>&1 | grep -v DEBUG | tee "$OUT/gdn_sweep.log"
timeout 240 python3 -m treecompile.bench attention --json "$OUT/attention.json" 2>&1 | grep -v "DEBUG\|INFO" \
  > "$OUT/attention.log"
tail -30 "$OUT/attention.log"
