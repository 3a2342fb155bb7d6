#!/usr/bin/env bash
# Twenty-first session, second device call (carry .gguf/smol.gguf.part.1, .whl; the shipped head back in the
# tree): assemble the GGUF, start the draft-vocabulary training daemon (tests/gpu/train25.sh: A 12288 ids,
# B 16384 ids, C 16384 ids with the target's frozen lm_head rows, one data set) in its own session so that it
# outlives this call, then follow it. SKIP_E2E=1: the device budget (1800 s) does not hold data + three
# trainers + an e2e run; the deciding tau is the CPU float32 56-prompt run of the heads brought back.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
bash tests/gpu/smol_setup.sh || exit 3
[ -f /tmp/models/ready ] || { echo "GGUF not assembled"; exit 3; }
if [ ! -f /tmp/pipe/stages.log ]; then
  VOCAB_A=12288 VOCAB_B=16384 BATCH_B=32 STEPS_B=4000 WITH_C=1 SKIP_E2E=1 \
    setsid bash tests/gpu/train25.sh > /tmp/daemon.log 2>&1 < /dev/null &
  sleep 5
fi
bash tests/gpu/watch.sh ${WATCH:-500}
