#!/usr/bin/env bash
# Twenty-third session's daemon (start with setsid from tests/gpu/session30.sh after tests/gpu/smol_setup.sh has
# assembled the GGUF; follow with tests/gpu/watch.sh). train26.sh's two trainers at once run ~0.25 s a step each
# against ~0.135 alone (nineteenth session), so with the data (~375 s) they do not fit one session's 1800 s:
# this trains only head A, both of train26.sh's levers at once:
#   * --ttt-steps 5: the tree's sixth step (P(depth 6 | depth 5) = 0.574) is the first the shipped head never
#     trained for;
#   * 16384 ids (99.14% of the generated tokens against 98.37% for 12288), shipped in ~19.8 MB by --lm-head-int8.
# Then, so that nothing shares the GPU while timed, SmolLM2 e2e batch 1 on the first 24 held-out prompts with the
# compiled draft round (1.93x with the shipped head, twenty-second session): plain and (10, 6, 64) with A, then the
# shipped head on (10, 6, 64) in its own process, then A's per-hook (8, 6, 64) (the current default) if time is left.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
E2E="--model smollm2 --batch-sizes 1 --prompts ${PROMPTS:-24} --max-new-tokens 256 --inductor --repeats 2"

stage "train A (16384 ids, int8 lm_head, ttt ${TTT:-5}) + data"
python3 -m treecompile.cli train-drafter --out /tmp/headA --target smollm2 --samples-per-prompt ${SAMPLES:-32} \
  --temperature 0.8 --max-new-tokens 256 --gen-batch-size ${GEN_BATCH:-3072} --checkpoint-every 500 \
  --batch-size 32 --steps ${STEPS:-4000} --weight-decay 0.01 --lr 0.001 --ttt-steps ${TTT:-5} --features stored \
  --no-progress --threads 4 --draft-vocab 16384 --lm-head-int8 > "$P/trainA.log" 2>&1 &
A=$!
while ! grep -q "treecompile.train: data:" "$P/trainA.log" 2>/dev/null && kill -0 $A 2>/dev/null; do sleep 5; done
stage "data done: $(ls /tmp/headA/data 2>/dev/null | wc -l) files, $(du -sh /tmp/headA/data 2>/dev/null | cut -f1)"
wait $A; stage "train A rc=$?"; cp /tmp/headA/training.json "$P/trainingA.json" 2>/dev/null
rm -rf /tmp/headA/data  # 18 GB; the head is what comes back

TREECOMPILE_COMPILED_DRAFT=1 timeout 280 python3 -m treecompile.bench e2e $E2E --head /tmp/headA \
  --configs tc_plain,tc_tree --trees "10,6,64" --json "$P/e2e_A.json" > "$P/e2e_A.log" 2>&1
stage "e2e A compiled rc=$?"
TREECOMPILE_COMPILED_DRAFT=1 timeout 200 python3 -m treecompile.bench e2e $E2E --configs tc_tree --trees "10,6,64" \
  --json "$P/e2e_shipped.json" > "$P/e2e_shipped.log" 2>&1
stage "e2e shipped compiled rc=$?"
timeout 200 python3 -m treecompile.bench e2e $E2E --head /tmp/headA --configs tc_tree --trees "8,6,64" \
  --json "$P/e2e_B.json" > "$P/e2e_B.log" 2>&1
stage "e2e A per-hook (8,6,64) rc=$?"
stage "DONE"
