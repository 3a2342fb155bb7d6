#!/usr/bin/env bash
# Next session, a second device call (after tests/gpu/session27.sh with GGUF part 0; carry
# .gguf/smol.gguf.part.1, .whl; the shipped head back in the tree): assemble the GGUF, start tests/gpu/train34.sh
# (head X: warm start from the shipped head over the new prompt set, then e2e) in its own session so that it outlives this call, then follow it.
# TRAIN=tests/gpu/train35.sh (tests/gpu/session56.sh) starts the next one instead. Later calls, each within the machine's 30 s idle release: `HEADS=/tmp/headX bash tests/gpu/watch.sh 540`.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
if [ ! -f /tmp/pipe/stages.log ]; then
  setsid bash ${TRAIN:-tests/gpu/train34.sh} > /tmp/daemon.log 2>&1 < /dev/null &
  sleep 5
fi
bash tests/gpu/watch.sh ${WATCH:-500}
