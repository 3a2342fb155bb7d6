#!/usr/bin/env bash
# Issue 5, tau >= 3: one SmolLM2 head on more varied self-distilled data than the shipped one (2271
# sequences, ~28 epochs), compared with the shipped head on held-out prompts, then SmolLM2 end to end (batch 1,
# Inductor) with whichever is better. A daemon like tests/gpu/pipeline.sh (start with setsid, follow with
# tests/gpu/watch.sh in back-to-back calls; the machine must stay warm). About 15-18 min of H200 time.
# Needs tests/gpu/smol_setup.sh first.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
P=${P:-/tmp/pipe}
mkdir -p "$P"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }

stage "train v2 + data (samples ${SAMPLES:-8}, steps ${STEPS:-5000})"
python3 -m treecompile.cli train-drafter --target smollm2 --out /tmp/headV2 --samples-per-prompt "${SAMPLES:-8}" \
  --temperature 0.8 --max-new-tokens 256 --gen-batch-size 256 --steps "${STEPS:-5000}" --batch-size 32 \
  --ttt-steps 4 --checkpoint-every 500 --draft-vocab 8192 --weight-decay 0.01 --lr 0.001 --no-progress \
  --threads 4 > "$P/trainV2.log" 2>&1
stage "train v2 rc=$?"

stage "pick head"
python3 tests/gpu/head_tau.py treecompile/heads/smollm2 /tmp/headV2 --json "$P/head_tau.json" > "$P/head_tau.log" 2>&1
BEST=$(tail -1 "$P/head_tau.log")
[ -d "$BEST" ] || BEST=treecompile/heads/smollm2
rm -rf /tmp/head && mkdir -p /tmp/head && cp "$BEST"/config.json "$BEST"/model.safetensors "$BEST"/training.json /tmp/head/
stage "best head $BEST"

stage "e2e batch 1"
python3 -m treecompile.bench e2e --model smollm2 --head /tmp/head --batch-sizes 1 --prompts 12 --max-new-tokens 256 \
  --inductor --configs tc_plain,tc_tree --trees "4,6,32;8,6,64" --json "$P/e2e_b1.json" > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"
stage "DONE"
