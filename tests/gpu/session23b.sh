#!/usr/bin/env bash
# Next session's plan, second device call (carry .gguf/smol.gguf.part.1): SmolLM2 assembled; the head-training
# daemon started (tests/gpu/train23.sh: data, two heads, held-out tau, e2e with the best); in the foreground,
# while the daemon generates data (correctness only, no timing), the runtime and model GPU tests under this
# session's defaults (compiled commit, eight-row merges); then follow the daemon (tests/gpu/watch.sh).
# Later calls: `bash tests/gpu/watch.sh 540` until its stages.log says DONE.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "SmolLM2 not assembled"; exit 3; }
mkdir -p /tmp/pipe && setsid nohup bash tests/gpu/train23.sh > /tmp/pipe/daemon.log 2>&1 < /dev/null &
sleep 2
timeout 330 python3 -m pytest -q -p no:cacheprovider --log-level=WARNING -m gpu tests/runtime tests/models \
  > "$OUT/gpu_rt.log" 2>&1
echo "gpu runtime+models rc=$? $(tail -1 "$OUT/gpu_rt.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_rt.log" | head
bash tests/gpu/watch.sh 180
