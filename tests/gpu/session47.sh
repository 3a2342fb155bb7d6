#!/usr/bin/env bash
# Thirty-first session, second call (carry .whl; random weights): the half of the speculator GPU tests the
# twenty-ninth session's compiled-draft default has not run (tests/gpu/session44.sh PART=1), then the 8B rounds
# once more with the kernel-time profile, packed into one file (a call brings back at most 8 files). ~500 s.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=1 T_TESTS=${T_TESTS:-420} bash tests/gpu/session44.sh
python3 - <<'PY' || true
import torch, os
print("cuda", torch.cuda.is_available())
PY
TREECOMPILE_COMPILED_DRAFT=1 timeout ${T_ROUNDS:-150} python3 -m treecompile.bench rounds --inductor --nodes 64 \
  --reps 10 --no-hf --profile /tmp/prof > "$OUT/rounds_prof.log" 2>&1
echo "8B rounds (profiled) rc=$?"; grep -E "^\| treecompile" "$OUT/rounds_prof.log" | cut -c1-100
(cd /tmp && tar czf "$OUT/prof.tgz" prof) && ls -la "$OUT"
