#!/usr/bin/env bash
# Next session's daemon (started by tests/gpu/session54.sh after the GGUF is assembled; follow with
# `HEADS=/tmp/headX bash tests/gpu/watch.sh 540`). The thirty-third session's warm start (head W: 2000 steps at lr
# 3e-4 on another seed's 32 samples of the same 757 prompts) raised the CPU held-out tau of (4, 4, 16) from 2.755
# to 2.875 (+4.4%, paired SE 0.019) and shipped. This one trains on from W over the new prompt set (1687 prompts,
# 930 of them new) with 16 samples a prompt (~27k sequences, ~20 GB of features), and times the data stage after
# the change to stored features (forwards over finished rows). Then e2e batch 1 on all 56 held-out prompts, (4, 4,
# 16): plain and the new head in one process, the shipped head in another. GEN_BATCH 3400: two samples of the
# 1687 prompts a generate call (3072 would fit one). The new head also runs (8, 4, 32): a better head may pay
# for the wider tree that was a wash with the head before (thirty-second session).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
E2E="--model smollm2 --batch-sizes 1 --prompts ${PROMPTS:-56} --max-new-tokens 256 --inductor --repeats 2"

stage "train X (warm start from the shipped head, seed ${SEED:-2}, ${SAMPLES:-16} samples, ${STEPS:-2000} steps, lr ${LR:-0.0003}) + data"
python3 -m treecompile.cli train-drafter --out /tmp/headX --target smollm2 --init-from treecompile/heads/smollm2 \
  --seed ${SEED:-2} --samples-per-prompt ${SAMPLES:-16} --temperature 0.8 --max-new-tokens 256 \
  --gen-batch-size ${GEN_BATCH:-3400} --checkpoint-every 250 --batch-size 32 --steps ${STEPS:-2000} \
  --weight-decay 0.01 --lr ${LR:-0.0003} --ttt-steps 4 --features stored --no-progress --threads 4 \
  --draft-vocab 12288 > "$P/trainX.log" 2>&1 &
W=$!
while ! grep -q "treecompile.train: data:" "$P/trainX.log" 2>/dev/null && kill -0 $W 2>/dev/null; do sleep 5; done
stage "data done: $(ls /tmp/headX/data 2>/dev/null | wc -l) files, $(du -sh /tmp/headX/data 2>/dev/null | cut -f1)"
wait $W; stage "train X rc=$?"; cp /tmp/headX/training.json "$P/trainingX.json" 2>/dev/null
rm -rf /tmp/headX/data

timeout 360 python3 -m treecompile.bench e2e $E2E --head /tmp/headX --configs tc_plain,tc_tree --trees "${TREES:-4,4,16;8,4,32}" \
  --json "$P/e2e_X.json" > "$P/e2e_X.log" 2>&1
stage "e2e X rc=$?"
timeout 200 python3 -m treecompile.bench e2e $E2E --configs tc_tree --trees "4,4,16" \
  --json "$P/e2e_shipped.json" > "$P/e2e_shipped.log" 2>&1
stage "e2e shipped rc=$?"
# Both heads in float32 on the GPU: lossless texts, so the two heads' tau compare prompt by prompt (in bf16 each
# run decodes its own texts; the thirty-third session's GPU gain was a third of the CPU's).
if [ "${HEAD_TAU:-1}" = 1 ]; then
  timeout 300 python3 tests/gpu/head_tau.py /tmp/headX treecompile/heads/smollm2 --dtype float32 --prompts ${PROMPTS:-56} \
  --max-new-tokens 256 --tree 4,4,16 --json "$P/head_tau_f32.json" > "$P/head_tau.log" 2>&1
  stage "head_tau float32 rc=$?"
fi
stage "DONE"
