#!/usr/bin/env bash
# Next session (carry .whl; random weights, so round times only). Two questions, loop_profile at batch 1:
# 1. Wider trees at the same depth. The thirty-first session's CPU sweep (tests/gpu/head_tau.py, float32, the
#    shipped head, 24 held-out prompts x 256 tokens) read tau 3.045 for (8, 4, 24) and 3.018 for (6, 4, 24) against
#    2.863 for (4, 4, 16) (+6.4% / +5.4%); on all 56 prompts (8, 4, 24) 2.934 and (8, 4, 32) 3.018 against 2.755
#    (+6.5% / +9.5%): worth it if their rounds cost less than that much more than (4, 4, 16)'s
#    (0.967 ms with combo kernels). Lane steps of 8 rows against 4 should cost about the same (launch-bound);
#    the verify runs 24 or 32 rows against 16. Then, if one pays, an e2e run on the real model (GGUF, two calls).
# 2. Inductor's fusion knobs past combo kernels (on by default since the thirty-first session): a combo kernel holds
#    at most `combo_kernel_max_num_nodes` (8) kernels; `aggressive_fusion` fuses nodes that share no memory too.
# The default runs first (four shapes) and last (drift check). ~500 s; T_PROF bounds each run.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1
R=$PWD; cd /tmp; mkdir -p /tmp/loops  # a call brings back at most 8 files: one log, the JSONs in one tar
run() {  # tag, shapes, variant flags...
  local tag=$1 shapes=$2; shift 2
  BATCHES=1 SHAPES="$shapes" DRAFT_VOCAB=12288 timeout ${T_PROF:-200} \
    python3 $R/tests/gpu/variant.py "$@" $R/tests/gpu/loop_profile.py /tmp/loops/$tag.json - fused-only >> "$OUT/loops.log" 2>&1
  echo "loop_profile $tag rc=$?"; python3 $R/tests/gpu/loop_summary.py /tmp/loops/$tag.json
}
run shapes "1,1,1;4,4,16;8,4,24;8,4,32"
run nodes32 "1,1,1;4,4,16" --inductor combo_kernel_max_num_nodes=32
run aggressive "1,1,1;4,4,16" --inductor aggressive_fusion=True
run default2 "1,1,1;4,4,16"
tar czf "$OUT/loops.tgz" -C /tmp loops
