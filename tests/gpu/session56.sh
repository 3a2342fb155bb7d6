#!/usr/bin/env bash
# Next session, the second device call (after tests/gpu/session27.sh with GGUF part 0; carry .gguf/smol.gguf.part.1,
# .whl; the shipped head back in the tree): tests/gpu/session54.sh starting tests/gpu/train35.sh (head Y). Later
# calls, each within the machine's 30 s idle release: `HEADS=/tmp/headY bash tests/gpu/watch.sh 540`.
TRAIN=tests/gpu/train35.sh exec bash "$(dirname "$0")/session54.sh"
