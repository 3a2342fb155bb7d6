#!/usr/bin/env bash
# Fourth session, first call: where SmolLM2-shaped generate rounds spend their wall time, then the 8B rounds
# after the argmax change (issue 4).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || exit 3
timeout 300 python3 tests/gpu/loop_profile.py "$OUT/loop_profile.json" 2>&1 | grep -v "DEBUG\|INFO" | tail -40
timeout 240 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 --json "$OUT/rounds.json" 2>&1 \
  | grep "^\[rounds\] tree\|^|\|^- \|^c =" | tee "$OUT/rounds.log"
