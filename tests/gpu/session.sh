#!/usr/bin/env bash
# One device-machine call: install treecompile into that machine's python (no network there), then run
# the named test files (CUDA present, so `gpu` tests run and kernel tests use CUDA). Logs go to $OUT.
# Usage (device tool): bash tests/gpu/session.sh tests/ops/test_verify.py ...
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/env.txt"
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1; then
  echo "editable install failed; trying a plain install" | tee -a "$OUT/install.log"
  python3 -m pip install -q --no-deps --no-build-isolation --no-index . >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 3; }
fi
cd /tmp && python3 -c "import treecompile, torch; print('treespec ops:', sorted(n for n in dir(torch.ops.treespec) if not n.startswith('_'))[:40])" | tee -a "$OUT/env.txt"
cd - >/dev/null
python3 -m pytest -q -p no:cacheprovider -rs --durations=15 "$@" 2>&1 | tee "$OUT/tests.log"
exit "${PIPESTATUS[0]}"
