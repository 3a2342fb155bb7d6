#!/usr/bin/env bash
# Issue 4 (carry .whl): two opt-in savings timed against the defaults in one warm run, after their GPU tests.
#   treek   TREECOMPILE_TREE_KERNELS=1: the draft round's bookkeeping as treespec ops, one kernel a step
#           (ops/expand_lanes.py) and one for the tree selection (ops/select_tree.py), in place of two or three a
#           step and ~10 (two single-program sorts, two scatters, gathers and masks: ~30 us of the H100's draft
#           profile, notes/gpu-2026-12-05-s42/prof_h100_glu_pdl0/draft.txt). The H200 draft is 1.33x its floor
#           against 1.3x: ~30 us over. On an H100 (forty-fourth session) it lost: draft +8 us, bookkeeping 35.1 us
#           against 31.1 (tests/gpu/tree_ops_bench.py, which now times each op alone too).
#   treek_expand  TREECOMPILE_TREE_KERNELS=expand: the expand_lanes op only (H100, forty-fifth session, one launch:
#           2.37 us a step; select_tree alone 20.0 us, where a round's whole torch bookkeeping is 31.4).
#   gemv_plain TREECOMPILE_GEMV_KEEP_FOOTPRINT=0: the default before the forty-sixth session (gemv_fp below, now on).
#   gemv_fp TREECOMPILE_GEMV_KEEP_FOOTPRINT=1: step 0's 6 rows on the H100's 4-row gemv entries with half the K
#           step (ops/skinny_linear.py; the trace had fc 56, o 26, down 56 us against 39, 16, 45 at 4 rows).
#   nocombo TREECOMPILE_COMBO_KERNELS=0: the draft round's one- and two-program reductions (9-10 us against 3.4 for the
#           8-program ones, forty-fifth session's trace) may be Inductor's combo kernels.
#   cdt     TREECOMPILE_DRAFT_INDUCTOR=coordinate_descent_tuning=1: Inductor tunes each draft-round kernel's blocks
#           and warps at compile time (the one-program reductions at a lane step's start: the gathered parent rows'
#           and the new tokens' embeddings' RMSNorms, 9-10 us where the 8-program ones take 3.4).
#   ffr     TREECOMPILE_DRAFT_INDUCTOR=test_configs.force_filter_reduction_configs=1 (the draft round's compile only):
#           each reduction takes one heuristic config instead of the fastest in an isolated benchmark. Why (forty-sixth
#           session, reading torch's triton_heuristics): those reductions' grids (1, 2, 1, 8, 2, 8 programs of 512
#           threads for the same work a step) fit autotuning that picked XBLOCK >= the 4 rows in some steps and
#           XBLOCK = 1 in others.
#   det     TREECOMPILE_DRAFT_INDUCTOR=deterministic=1: no on-device benchmarking in the draft round's compile at all.
#   norm    TREECOMPILE_FUSE_NORM=1: passes/fuse_residual_norm.py version 2 (producer epilogue; never timed).
#   both    the two together.
#   o_triton H100 only: norm with the 64-row o on Triton tiles (tests/gpu/h100_o64_triton.json), so o -> gate/up folds.
#   default neither (run first and last: the machine's drift).
#   prof    default with --profile: kernel tables and Chrome traces per round (tests/gpu/trace_gaps.py reads them).
# GPU tests first (TEST_K over the two tree ops', the draft tree's, the norm pass's and the ops' norm paths'), then
# tests/gpu/tree_ops_bench.py: the bookkeeping alone in a CUDA graph, torch against the ops. KERNELS="name ..." then
# dumps those Inductor kernels' source-node comments (tests/gpu/inductor_kernels.py) into kernels.txt.
set -u
export PYTHONUNBUFFERED=1 TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic CLOCKS=${CLOCKS-1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
python3 -c "import torch._inductor.config as c; d = c.get_config_copy(); print('inductor has', [n for n in (
  'test_configs.force_filter_reduction_configs', 'deterministic', 'coordinate_descent_tuning', 'combo_kernels') if n in d])"
case $gpu in *H200*) all="default treek norm both default";; *) all="default treek norm o_triton default";; esac
if [ -z "${NO_TESTS:-}" ]; then
  timeout ${T_TESTS:-170} python3 -m pytest -q -p no:cacheprovider tests/ops/test_select_tree.py tests/ops/test_expand_lanes.py \
    tests/runtime/test_draft_tree.py tests/passes/test_fuse_residual_norm.py tests/ops/test_skinny_glu.py \
    tests/ops/test_skinny_qkv_rope.py -k "${TEST_K:-cuda or tree_kernels or norm or gpu or sumsq or scale}" \
    ${MORE_TESTS:-} > "$OUT/tests.log" 2>&1
  echo "GPU tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | cut -c1-220 | tail -12
fi
if [ -z "${NO_BENCH:-}" ]; then
  timeout ${T_BENCH:-120} python3 tests/gpu/tree_ops_bench.py "$OUT/tree_ops.json" > "$OUT/tree_ops.log" 2>&1
  echo "tree ops bench rc=$?"; grep -E "^\{|Error|error" "$OUT/tree_ops.log" | tail -6
fi
. tests/gpu/rounds_lib.sh
for v in ${VARIANTS:-$all}; do
  case $v in
    default) run_rounds "$v";;
    prof) PROFILE=1 run_rounds "$v";;
    treek) run_rounds "$v" TREECOMPILE_TREE_KERNELS=1;;
    treek_expand) run_rounds "$v" TREECOMPILE_TREE_KERNELS=expand;;
    gemv_fp) run_rounds "$v" TREECOMPILE_GEMV_KEEP_FOOTPRINT=1;;
    gemv_plain) run_rounds "$v" TREECOMPILE_GEMV_KEEP_FOOTPRINT=0;;
    nocombo) run_rounds "$v" TREECOMPILE_COMBO_KERNELS=0;;
    cdt) run_rounds "$v" TREECOMPILE_DRAFT_INDUCTOR=coordinate_descent_tuning=1;;
    ffr) run_rounds "$v" TREECOMPILE_DRAFT_INDUCTOR=test_configs.force_filter_reduction_configs=1;;
    det) run_rounds "$v" TREECOMPILE_DRAFT_INDUCTOR=deterministic=1;;
    norm) run_rounds "$v" TREECOMPILE_FUSE_NORM=1;;
    both) run_rounds "$v" TREECOMPILE_TREE_KERNELS=1 TREECOMPILE_FUSE_NORM=1;;
    o_triton) run_rounds "$v" TREECOMPILE_FUSE_NORM=1 -- python3 tests/gpu/variant.py --table tests/gpu/h100_o64_triton.json \
      treecompile.bench;;
    *) echo "unknown variant $v";;
  esac
done
if [ -n "${KERNELS:-}" ]; then  # what anonymous Inductor kernels of the profile fuse (their source-node comments)
  python3 tests/gpu/inductor_kernels.py --source "$TORCHINDUCTOR_CACHE_DIR" "${KERNEL_MARKER:--}" $KERNELS > "$OUT/kernels.txt" 2>&1
  echo "inductor kernels rc=$? ($(grep -c '^==' "$OUT/kernels.txt") found)"
fi
cd "$OUT" && tar czf raw.tgz --remove-files $(ls | grep -v -e "^raw.tgz$" -e "json$") && ls -la "$OUT"
