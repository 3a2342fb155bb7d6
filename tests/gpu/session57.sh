#!/usr/bin/env bash
# Next session, first device call (carry .whl; random weights, no GGUF). ~400 s. Issue 4's decode and draft:
# the L2 weight prefetch during attention (passes/prefetch_weights.py, TREECOMPILE_WEIGHT_PREFETCH=1, off by
# default). The 8B decode's attention runs ~7 us a layer with HBM mostly idle, then the o projection streams
# 33.5 MB from HBM at ~2.9 TB/s (11.4 us); with the hint its stage-1 programs pull that weight into L2 first.
# 1. The GPU tests of the fused attention write, the new prefetch test among them (the hints really run here).
# 2. 8B rounds, every default against the prefetch, alternating, two runs each (one machine; starts vary by ~1%).
# 3. SmolLM2 shapes, random weights, batch 1: loop_profile's plain and (8, 4, 32) rounds with and without.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_tree_attention_write.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
for i in 1 2; do
  for pf in 0 1; do
    TREECOMPILE_WEIGHT_PREFETCH=$pf timeout 120 python3 -m treecompile.bench rounds --inductor --nodes 64 --reps 10 \
      --no-hf --json "$OUT/rounds_pf${pf}_$i.json" > "$OUT/rounds_pf${pf}_$i.log" 2>&1
    echo "rounds prefetch=$pf run $i rc=$?"; grep -E "^\| treecompile|prefetch_weights" "$OUT/rounds_pf${pf}_$i.log" | head -5
  done
done
for pf in 0 1; do
  TREECOMPILE_WEIGHT_PREFETCH=$pf BATCHES=1 SHAPES="1,1,1;8,4,32" DRAFT_VOCAB=12288 timeout 150 \
    python3 tests/gpu/loop_profile.py "$OUT/loop_pf$pf.json" /tmp/prof_pf$pf fused-only > "$OUT/loop_pf$pf.log" 2>&1
  echo "loop_profile prefetch=$pf rc=$?"; python3 tests/gpu/loop_summary.py "$OUT/loop_pf$pf.json"
done
