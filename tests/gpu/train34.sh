#!/usr/bin/env bash
# Thirty-fourth session's daemon (tests/gpu/session54.sh starts it): head X, the second warm start, seed 2 over the
# 1687 prompts (930 new), 16 samples each, 2000 steps; e2e with (8, 4, 32) too, then both heads in float32 on the
# GPU. That session ran it with TREES=4,4,16 HEAD_TAU=0 after a lost machine; head X shipped (BENCHMARKS.md).
N=X SEED=${SEED:-2} STEPS=${STEPS:-2000} TREES="${TREES:-4,4,16;8,4,32}" HEAD_TAU=${HEAD_TAU:-1} \
  exec bash "$(dirname "$0")/warm_start.sh"
