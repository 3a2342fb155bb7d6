#!/usr/bin/env bash
# Nineteenth session's second device call (carry .gguf/smol.gguf.part.1; the shipped head back in the working
# tree): SmolLM2 assembled; the head-training daemon started (tests/gpu/train25.sh: 32 samples a prompt,
# heads A and B, held-out tau, e2e with the best); in the foreground, while the daemon makes
# data (correctness only), the runtime and model GPU tests, verbose; then follow the daemon. Later calls: `bash tests/gpu/watch.sh
# 540` until its stages.log says DONE (each call within 30 s of the last, or the machine and daemon are gone).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "SmolLM2 not assembled"; exit 3; }
mkdir -p /tmp/pipe && setsid nohup bash tests/gpu/train25.sh > /tmp/pipe/daemon.log 2>&1 < /dev/null &
sleep 2
timeout ${T_TESTS:-430} python3 -m pytest -v -p no:cacheprovider --log-level=WARNING -m gpu tests/runtime tests/models \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu runtime+models rc=$? $(tail -1 "$OUT/gpu_tests.log")"
grep -cE " PASSED" "$OUT/gpu_tests.log"; grep -E " (FAILED|ERROR)" "$OUT/gpu_tests.log" | head
bash tests/gpu/watch.sh ${WATCH:-60}
