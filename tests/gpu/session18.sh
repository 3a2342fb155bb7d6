#!/usr/bin/env bash
# Thirteenth session, first device call (carry .gguf/smol.gguf.part.aa, .gguf/sha256.txt, .whl): stash the
# GGUF part, install treecompile, then
# 1. tests/gpu/cascade_ab.py: the cascade's new variants (TMA tiles, multi-row merge, dependent launches) at
#    8B round shapes; the fastest verify variant goes to /tmp/cascade_env for the rounds call;
# 2. the GPU tests never run yet: the cascade variants, the dependent-launch cascade and skinny kernels, the
#    speculator over skinny's gemv_pdl and with every kernel a dependent launch.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 3; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 200 python3 tests/gpu/cascade_ab.py "$OUT/cascade_ab.json" > "$OUT/cascade_ab.log" 2>&1
echo "cascade_ab rc=$?"; grep -E "best|FAILED" "$OUT/cascade_ab.log" | cut -c1-400
python3 - <<'PY'
import json, os
try:
    res = json.load(open(os.environ["OUT"] + "/cascade_ab.json"))
    verify = [r for r in res if r["N"] == 64 and r["P"] <= 4096]
    env = verify[0]["env"] if verify else ""
except Exception as exc:
    env = ""
    print("no cascade choice:", exc)
open("/tmp/cascade_env", "w").write(env)
print("cascade env for the rounds call:", repr(env))
PY
timeout 150 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING tests/ops/test_tree_attention.py \
  tests/ops/test_tree_attention_write.py tests/ops/test_skinny_linear.py -k "gpu or variants" > "$OUT/ops_tests.log" 2>&1
echo "ops tests rc=$? $(tail -1 "$OUT/ops_tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/ops_tests.log" | head
timeout 170 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/runtime/test_speculator_gpu.py \
  -k "skinny_linears or dependent" > "$OUT/spec_tests.log" 2>&1
echo "speculator tests rc=$? $(tail -1 "$OUT/spec_tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/spec_tests.log" | head
