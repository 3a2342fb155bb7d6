#!/usr/bin/env bash
# Fifth GPU session's daemon (start with setsid after tests/gpu/smol_setup.sh has assembled the GGUF; follow
# with tests/gpu/watch.sh). Stages, in order of what they decide:
#   1. issue 5's tau: a SmolLM2 head trained on ~2.7x more self-distilled data than the shipped one
#      (8 samples a prompt instead of 3; 3500 steps = ~19 epochs instead of ~28), held-out tau against the
#      shipped head (tests/gpu/head_tau.py), then SmolLM2 e2e batch 1 with the better one;
#   2. issue 4: 8B rounds with and without fused projections (decides the default of fuse_projections);
#   3. SmolLM2-shaped loop profile, fused projections (launch-bound small GEMMs).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache
P=${P:-/tmp/pipe}
mkdir -p "$P/prof"
stage() { echo "$(date +%T) $*" >> "$P/stages.log"; }

stage "train v2 + data (samples ${SAMPLES:-8}, steps ${STEPS:-3500})"
python3 -m treecompile.cli train-drafter --target smollm2 --out /tmp/headV2 --samples-per-prompt "${SAMPLES:-8}" \
  --temperature 0.8 --max-new-tokens 256 --gen-batch-size 256 --steps "${STEPS:-3500}" --batch-size 32 \
  --ttt-steps 4 --checkpoint-every 500 --draft-vocab 8192 --weight-decay 0.01 --lr 0.001 --no-progress \
  --threads 4 > "$P/trainV2.log" 2>&1
stage "train v2 rc=$?"

python3 tests/gpu/head_tau.py treecompile/heads/smollm2 /tmp/headV2 --json "$P/head_tau.json" > "$P/head_tau.log" 2>&1
BEST=$(tail -1 "$P/head_tau.log")
[ -d "$BEST" ] || BEST=treecompile/heads/smollm2
rm -rf /tmp/head && mkdir -p /tmp/head && cp "$BEST"/config.json "$BEST"/model.safetensors "$BEST"/training.json /tmp/head/
stage "best head $BEST"

timeout 420 python3 -m treecompile.bench e2e --model smollm2 --head /tmp/head --batch-sizes 1 --prompts 12 \
  --max-new-tokens 256 --inductor --configs tc_plain,tc_tree --trees "4,6,32;8,6,64" --json "$P/e2e_b1.json" \
  > "$P/e2e_b1.log" 2>&1
stage "e2e batch 1 rc=$?"

for f in "" --fuse-projections; do
  timeout 150 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 $f --json "$P/rounds$f.json" 2>&1 \
    | grep "^| treecompile\|^c =" >> "$P/rounds.log"
done
stage "rounds done"
timeout 150 python3 tests/gpu/loop_profile.py "$P/loop_fuse.json" "$P/prof" fuse 2>&1 | grep '^{' > "$P/loop.log"
stage "DONE"
