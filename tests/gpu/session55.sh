#!/usr/bin/env bash
# A call for a session with device time to spare (carry .whl; random weights, timing only). ~330 s.
# 1. gen_probe again, now two passes in opposite orders (the thirty-fourth session's one pass read the new
#    stored-features path 16.6 s first against 9.2 s for the old path third, while the real data stage got 29%
#    faster a generated token: the probe's first variant pays a warm-up).
# 2. The source of the batch-1 (4, 4, 16) round's kernels: loop_profile with a fresh inductor cache, then the
#    output-code modules of the draft and verify graphs come back (prof_code.tgz). The draft's
#    triton_red_fused_1 (one launch, 18.6 us of a ~240 us draft graph) and the verify's triton_poi_fused_1 (30
#    launches, 3.0 us each at 16 rows against 1.8 at one) are the largest kernels nobody has read yet. Their names list no
#    ops: Inductor names a combo kernel (several independent kernels in one launch; on by default since the
#    thirty-first session) "fused" alone (torch/_inductor/codegen/simd.py defines it over the one combo node), so
#    each is probably several kernels at once.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1
R=$PWD; cd /tmp
STEPS=64 timeout ${T_GEN:-150} python3 $R/tests/gpu/gen_probe.py "$OUT/gen_probe.json" 3072 > "$OUT/gen_probe.log" 2>&1
echo "gen_probe rc=$?"; grep '^{' "$OUT/gen_probe.log"
rm -rf /tmp/ic_prof /tmp/prof && mkdir -p /tmp/prof
TORCHINDUCTOR_CACHE_DIR=/tmp/ic_prof TORCHINDUCTOR_FX_GRAPH_CACHE=0 BATCHES=1 SHAPES="4,4,16" DRAFT_VOCAB=12288 \
  timeout ${T_PROF:-200} python3 $R/tests/gpu/loop_profile.py /tmp/prof/loop.json /tmp/prof fused-only > "$OUT/loop.log" 2>&1
echo "loop_profile rc=$?"; python3 $R/tests/gpu/loop_summary.py /tmp/prof/loop.json
# 3. The same round with the draft tree's ranks by pairwise comparison instead of sorts (thirty-fifth session,
#    DraftTree(pairwise_rank=True); CPU tests show the same trees): if triton_red_fused_1 is the select's sort,
#    the draft graph drops by most of its 18.6 us.
rm -rf /tmp/prof_pw && mkdir -p /tmp/prof_pw
TREECOMPILE_PAIRWISE_RANK=1 BATCHES=1 SHAPES="4,4,16" DRAFT_VOCAB=12288 \
  timeout ${T_PROF:-200} python3 $R/tests/gpu/loop_profile.py /tmp/prof_pw/loop.json /tmp/prof_pw fused-only > "$OUT/loop_pw.log" 2>&1
echo "loop_profile pairwise rc=$?"; python3 $R/tests/gpu/loop_summary.py /tmp/prof_pw/loop.json
# Output-code modules name their kernels `triton_..._N = async_compile.triton('triton_..._N', ...)`.
mkdir -p /tmp/prof_code
grep -rl --include='*.py' "async_compile.triton(" /tmp/ic_prof | while read -r f; do
  n=$(grep -c "async_compile.triton(" "$f"); cp "$f" "/tmp/prof_code/${n}_$(basename "$f")"; done
ls /tmp/prof_code | head -40
grep -l "draft_topk" /tmp/prof_code/*.py | head; grep -l "tree_attention" /tmp/prof_code/*.py | head
tar czf "$OUT/prof_code.tgz" -C /tmp prof_code prof prof_pw
