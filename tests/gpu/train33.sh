#!/usr/bin/env bash
# Thirty-third session's daemon (started by tests/gpu/session52.sh after the GGUF is assembled; follow with
# `HEADS=/tmp/headW bash tests/gpu/watch.sh 540`). Issue 5's largest lever left is tau. Heads trained on more
# data have read higher tau (seventeenth and twenty-first sessions), and one run of data plus training does
# not fit a session next to anything else, so this trains *on* from the shipped head (--init-from, its 12288-id
# vocabulary and weights) over new data: the same prompts, another seed's 32 sampled continuations each.
# Data ~342 s, STEPS x ~0.2 s of training at a lower peak lr. Then e2e batch 1 on all 56 held-out prompts, (4, 4,
# 16): plain and the new head in one process, the shipped head in another. ~1100 s at STEPS=2500.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
E2E="--model smollm2 --batch-sizes 1 --prompts ${PROMPTS:-56} --max-new-tokens 256 --inductor --repeats 2"

stage "train W (warm start from the shipped head, seed ${SEED:-1}, ${STEPS:-2500} steps, lr ${LR:-0.0003}) + data"
python3 -m treecompile.cli train-drafter --out /tmp/headW --target smollm2 --init-from treecompile/heads/smollm2 \
  --seed ${SEED:-1} --samples-per-prompt ${SAMPLES:-32} --temperature 0.8 --max-new-tokens 256 \
  --gen-batch-size ${GEN_BATCH:-3072} --checkpoint-every 250 --batch-size 32 --steps ${STEPS:-2500} \
  --weight-decay 0.01 --lr ${LR:-0.0003} --ttt-steps 4 --features stored --no-progress --threads 4 \
  --draft-vocab 12288 > "$P/trainW.log" 2>&1 &
W=$!
while ! grep -q "treecompile.train: data:" "$P/trainW.log" 2>/dev/null && kill -0 $W 2>/dev/null; do sleep 5; done
stage "data done: $(ls /tmp/headW/data 2>/dev/null | wc -l) files, $(du -sh /tmp/headW/data 2>/dev/null | cut -f1)"
wait $W; stage "train W rc=$?"; cp /tmp/headW/training.json "$P/trainingW.json" 2>/dev/null
rm -rf /tmp/headW/data  # ~18 GB; the head is what comes back

timeout 300 python3 -m treecompile.bench e2e $E2E --head /tmp/headW --configs tc_plain,tc_tree --trees "4,4,16" \
  --json "$P/e2e_W.json" > "$P/e2e_W.log" 2>&1
stage "e2e W rc=$?"
timeout 200 python3 -m treecompile.bench e2e $E2E --configs tc_tree --trees "4,4,16" \
  --json "$P/e2e_shipped.json" > "$P/e2e_shipped.log" 2>&1
stage "e2e shipped rc=$?"
stage "DONE"
