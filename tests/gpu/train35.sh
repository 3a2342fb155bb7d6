#!/usr/bin/env bash
# Next session's daemon (tests/gpu/session56.sh starts it; follow with `HEADS=/tmp/headY bash tests/gpu/watch.sh
# 540`). Each warm start so far added ~4.5% CPU held-out tau at (4, 4, 16): 2.755 -> 2.875 (thirty-third session,
# 757 prompts x 32 samples) -> 3.010 (thirty-fourth, 1687 prompts x 16; GPU e2e 1.96-1.99x plain). Issue 5 needs
# 2.0x: one more from the shipped head (X), seed 3, 10 samples of the 2559 prompts (the thirty-fifth session's third
# batch: 872 new prompts, new topics and task types; ~25.6k sequences, about the 27.0k of head X, so data ~280 s),
# 2500 steps (~230 s), then e2e of Y with plain and of X apart. Y also runs (6, 4, 24) and (8, 4, 32): with head X,
# CPU tau (6, 4, 24) 3.179 against (4, 4, 16) 3.010 (+5.6%), for a round between (4, 4, 16)'s 1.015 ms and
# (8, 4, 32)'s 1.087.
N=Y SEED=${SEED:-3} SAMPLES=${SAMPLES:-10} STEPS=${STEPS:-2500} TREES="${TREES:-4,4,16;6,4,24;8,4,32}" \
  HEAD_TAU=${HEAD_TAU:-0} SHIPPED_TREES="${SHIPPED_TREES:-4,4,16;6,4,24}" \
  exec bash "$(dirname "$0")/warm_start.sh"
