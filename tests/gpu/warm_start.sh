#!/usr/bin/env bash
# Device-machine daemon: a warm start from the shipped head (`train-drafter --init-from`) over a new seed's sampled
# continuations of the package's training prompts, then e2e batch 1 on all 56 held-out prompts: plain and the new
# head in one process, the shipped head in another; optionally both heads through head_tau.py in float32 (paired
# texts). Started by a session script (tests/gpu/train34.sh, train35.sh set its parameters); follow it with
# `HEADS=/tmp/headN bash tests/gpu/watch.sh 540`.
# Env: N (the head's letter), SEED, STEPS (required); SAMPLES (16), LR (3e-4), GEN_BATCH (3400), TREES ("4,4,16"),
# SHIPPED_TREES ("4,4,16"), HEAD_TAU (0), PROMPTS (56), VOCAB (12288; larger grows the head's draft vocabulary),
# LM_HEAD_INT8 (unset; any value exports the lm_head rows as int8, which 16384 ids need to stay under 25 MB).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
P=${P:-/tmp/pipe}
N=${N:?the new head letter: /tmp/headN}; SEED=${SEED:?}; STEPS=${STEPS:?}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
E2E="--model smollm2 --batch-sizes 1 --prompts ${PROMPTS:-56} --max-new-tokens 256 --inductor --repeats 2"

stage "train $N (warm start from the shipped head, seed $SEED, ${SAMPLES:-16} samples, $STEPS steps, lr ${LR:-0.0003}, vocab ${VOCAB:-12288}${LM_HEAD_INT8:+ int8}) + data"
python3 -m treecompile.cli train-drafter --out /tmp/head$N --target smollm2 --init-from treecompile/heads/smollm2 \
  --seed $SEED --samples-per-prompt ${SAMPLES:-16} --temperature 0.8 --max-new-tokens 256 \
  --gen-batch-size ${GEN_BATCH:-3400} --checkpoint-every 250 --batch-size 32 --steps $STEPS \
  --weight-decay 0.01 --lr ${LR:-0.0003} --ttt-steps 4 --features stored --no-progress --threads 4 \
  --draft-vocab ${VOCAB:-12288} ${LM_HEAD_INT8:+--lm-head-int8} > "$P/train$N.log" 2>&1 &
W=$!
while ! grep -q "treecompile.train: data:" "$P/train$N.log" 2>/dev/null && kill -0 $W 2>/dev/null; do sleep 5; done
stage "data done: $(ls /tmp/head$N/data 2>/dev/null | wc -l) files, $(du -sh /tmp/head$N/data 2>/dev/null | cut -f1)"
wait $W; stage "train $N rc=$?"; cp /tmp/head$N/training.json "$P/training$N.json" 2>/dev/null
rm -rf /tmp/head$N/data

timeout 360 python3 -m treecompile.bench e2e $E2E --head /tmp/head$N --configs tc_plain,tc_tree --trees "${TREES:-4,4,16}" \
  --json "$P/e2e_$N.json" > "$P/e2e_$N.log" 2>&1
stage "e2e $N rc=$?"
# The shipped head in its own process; with SHIPPED_TREES of more than one tree, beside plain (a second reading).
SHIPPED_CONFIGS=tc_tree; case "${SHIPPED_TREES:-4,4,16}" in *";"*) SHIPPED_CONFIGS=tc_plain,tc_tree;; esac
timeout 300 python3 -m treecompile.bench e2e $E2E --configs $SHIPPED_CONFIGS --trees "${SHIPPED_TREES:-4,4,16}" \
  --json "$P/e2e_shipped.json" > "$P/e2e_shipped.log" 2>&1
stage "e2e shipped rc=$?"
# Both heads in float32 on the GPU: lossless texts, so the two heads' tau compare prompt by prompt (in bf16 each
# run decodes its own texts; the thirty-third session's GPU gain was a third of the CPU's).
if [ "${HEAD_TAU:-0}" = 1 ]; then
  timeout 300 python3 tests/gpu/head_tau.py /tmp/head$N treecompile/heads/smollm2 --dtype float32 --prompts ${PROMPTS:-56} \
  --max-new-tokens 256 --tree 4,4,16 --json "$P/head_tau_f32.json" > "$P/head_tau.log" 2>&1
  stage "head_tau float32 rc=$?"
fi
stage "DONE"
