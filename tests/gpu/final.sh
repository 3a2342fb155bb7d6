#!/usr/bin/env bash
# The session's last device call: committed HEAD only (helpers' uncommitted edits stay behind), the
# speculator GPU tests, then the rounds benchmark. Partial output survives a timeout under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
if git rev-parse HEAD >/dev/null 2>&1; then
  rm -rf /tmp/clean && mkdir -p /tmp/clean && git archive HEAD | tar -x -C /tmp/clean && cd /tmp/clean
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || exit 3
timeout 150 python3 -m pytest -q -p no:cacheprovider -s tests/runtime/test_speculator_gpu.py 2>&1 | grep -v DEBUG | tee "$OUT/speculator_gpu.log" | tail -15
timeout 230 python3 -m treecompile.bench rounds --nodes 64 --reps 10 --json "$OUT/rounds.json" 2>&1 | grep -v DEBUG | tee "$OUT/rounds.log"
