#!/usr/bin/env bash
# Next session's first call (carry .whl; random weights, timing only). ~300 s.
# 1. Data generation after the thirty-third session's change (stored features from forwards over the finished
#    rows instead of generate's per-step hidden states): tests/gpu/gen_probe.py at 3072 rows x 64 steps times the
#    shipped path against the old one in one process (the first probe read 14.9 s old against 4.9 s without features).
# 2. Where a batch-1 round's tree-only time goes. Issue 5's ratio (tree / plain) moves only with tau or with the
#    time a tree round spends beyond a plain one: the draft graph (~0.18 ms of 0.97) and the verify's extra ~0.09
#    ms over a plain step. loop_profile with kernel tables of (1, 1, 1) and (4, 4, 16) (the last SmolLM2-shape
#    tables are from the fourteenth session, before the compiled draft round, combo kernels and 16-node trees).
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1
R=$PWD; cd /tmp
STEPS=64 timeout ${T_GEN:-150} python3 $R/tests/gpu/gen_probe.py "$OUT/gen_probe.json" 3072 > "$OUT/gen_probe.log" 2>&1
echo "gen_probe rc=$?"; grep '^{' "$OUT/gen_probe.log"
mkdir -p /tmp/prof
BATCHES=1 SHAPES="1,1,1;4,4,16" DRAFT_VOCAB=12288 timeout ${T_PROF:-240} \
  python3 $R/tests/gpu/loop_profile.py /tmp/prof/loop.json /tmp/prof fused-only > "$OUT/loop.log" 2>&1
echo "loop_profile rc=$?"; python3 $R/tests/gpu/loop_summary.py /tmp/prof/loop.json
python3 $R/tests/gpu/kernel_diff.py /tmp/prof/verify_1_1_1_b1_inductor_fused.json \
  /tmp/prof/verify_4_4_16_b1_inductor_fused.json --top 40 | tee "$OUT/verify_diff.txt"
python3 $R/tests/gpu/kernel_diff.py /tmp/prof/draft_4_4_16_b1_inductor_fused.json --top 40 > "$OUT/draft_kernels.txt"; tail -2 "$OUT/draft_kernels.txt"
tar czf "$OUT/prof.tgz" -C /tmp prof
