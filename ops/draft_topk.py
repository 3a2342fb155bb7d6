"""Top-k of the draft's log-probabilities in two small kernels.

Why it exists: each draft round of tree building takes the top-k of ``log_softmax(draft_logits)``.
With plain torch that is a ``torch.topk`` over the ~32k draft vocabulary, about 43 us per call on the
H200 (a multi-block radix select, ~5 kernels), plus separate log_softmax kernels. ``log_softmax`` is a
shift of each row by its log-sum-exp, so the top-k of the log-probabilities is the top-k of the
logits: one pass over the row computes each slice's local top-k and its partial log-sum-exp together,
and a second tiny kernel merges the slices.

Shapes
------
logits  [R, V]   float16 / bfloat16 / float32 / float64; last-dim stride 1, any row stride; V >= k
logp    [R, k]   float32 (float64 for float64 logits): the k largest ``log_softmax(logits.float(), -1)``,
                 best first
index   [R, k]   int64 vocabulary indices of ``logp``

``torch.ops.treespec.draft_topk(logits, k, index_offset=None) -> (logp, index)`` with ``1 <= k <= 16``;
``index_offset`` (int64 ``[V]``, EAGLE-3's ``d2t``) maps each returned index i to ``i + index_offset[i]`` in the
kernel's store. Order: higher logit
first, ties to the lower index. NaN logits count as -inf (never preferred over a finite value). A row
that is entirely -inf/NaN gives NaN logp (as ``torch.log_softmax`` does) and indices ``0..k-1``; a row
holding +inf also gives NaN logp (as torch does), its +inf entries ranked first.
Only metadata is checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

import logging

import torch

from ._common import HAS_TRITON, check_dim, check_dtype, counter_table, env_switch, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = ["MAX_K", "draft_topk", "draft_topk_reference"]

MAX_K = 16  # k rounds of block-wide reductions per program: cheap for a draft's k, not for a large k
_PAD_INDEX = 2**31 - 1  # index of out-of-bounds lanes: loses every tie against a real (lower) index

_LOGITS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::draft_topk", mutates_args=())
def draft_topk(
    logits: torch.Tensor, k: int, index_offset: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``log_softmax(logits)``: ``[R, V] -> (logp [R, k], index [R, k] int64)``, best first; with
    ``index_offset`` (int64 ``[V]``, e.g. EAGLE-3's ``d2t``) each index i comes back as ``i + index_offset[i]``."""
    _check_draft_topk_inputs(logits, k, index_offset)
    if use_triton(logits) and (index_offset is None or index_offset.is_cuda):
        logp, index = _empty_outputs(logits, k)
        _launch_draft_topk(logits, k, logp, index, index_offset=index_offset)
        return logp, index
    return draft_topk_reference(logits, k, index_offset)


@draft_topk.register_fake
def _(logits: torch.Tensor, k: int, index_offset: torch.Tensor | None = None):
    _check_draft_topk_inputs(logits, k, index_offset)
    return _empty_outputs(logits, k)


def _out_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _empty_outputs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return (
        logits.new_empty((rows, k), dtype=_out_dtype(logits)),
        logits.new_empty((rows, k), dtype=torch.int64),
    )


# --------------------------------------------------------------------------------------------------
# Validation (metadata only)
# --------------------------------------------------------------------------------------------------


def _check_draft_topk_inputs(logits: torch.Tensor, k: int, index_offset: torch.Tensor | None = None) -> None:
    check_dim("logits", logits, 2, "[R, V]")
    check_dtype("logits", logits, *_LOGITS_DTYPES)
    vocab = logits.shape[1]
    if index_offset is not None:
        check_dim("index_offset", index_offset, 1, "[V]")
        check_dtype("index_offset", index_offset, torch.int64)
        if index_offset.shape[0] != vocab:
            raise ValueError(f"index_offset: expected one offset per vocabulary entry (V = {vocab}), "
                             f"got shape {tuple(index_offset.shape)}")  # fmt: skip
        if index_offset.device != logits.device:
            raise ValueError(f"index_offset: expected the logits' device {logits.device}, got {index_offset.device}")
    if vocab > 1 and logits.stride(1) != 1:  # the kernel reads each slice as one contiguous run
        raise ValueError(
            f"logits: the last dim must have stride 1, got strides {tuple(logits.stride())}"
        )
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k: expected 1 <= k <= {MAX_K}, got {k}")
    if k > vocab:
        raise ValueError(f"k: k = {k} exceeds the vocabulary size V = logits.shape[1] = {vocab}")


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernels
# --------------------------------------------------------------------------------------------------


def _launch_draft_topk(
    logits: torch.Tensor,
    k: int,
    logp: torch.Tensor,
    index: torch.Tensor,
    block: int | None = None,
    num_warps: int | None = None,
    fused_merge: bool | None = None,
    index_offset: torch.Tensor | None = None,
) -> None:
    """Fill preallocated ``logp [R, k]`` (float32, or float64 for float64 logits) and ``index [R, k]``.

    ``block``: vocabulary slice per stage-1 program (a power of two >= k); ``num_warps`` its warps (both
    default to :func:`slice_config`). ``fused_merge`` (default: ``TREECOMPILE_TOPK_FUSED_MERGE=1``, else off
    until timed on the GPU): the row's last slice program to finish merges the row, so there is one launch,
    not two. ``index_offset`` (int64 ``[V]``, any stride): added to each index at the merge's store. The
    workspaces' sizes depend only on shapes, so the launcher is capturable in a CUDA graph.
    """
    rows, vocab = logits.shape
    if rows == 0:
        return
    if block is None:
        block, default_warps = slice_config(rows, vocab, k)
        num_warps = default_warps if num_warps is None else num_warps
    elif num_warps is None:
        num_warps = 4 if block >= 512 else 1
    if block < k or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= k = {k}, got {block}")
    num_blocks = triton.cdiv(vocab, block)
    # float64 logits keep float64 through both stages: a float32 pass could reorder near-ties.
    work_dtype = _out_dtype(logits)
    cand_value = torch.empty((rows, num_blocks, k), dtype=work_dtype, device=logits.device)
    cand_index = torch.empty((rows, num_blocks, k), dtype=torch.int32, device=logits.device)
    slice_max = torch.empty((rows, num_blocks), dtype=work_dtype, device=logits.device)
    slice_sum = torch.empty((rows, num_blocks), dtype=work_dtype, device=logits.device)
    work_tl = tl.float64 if work_dtype == torch.float64 else tl.float32
    block_c = triton.next_power_of_2(num_blocks * k)
    block_nb = triton.next_power_of_2(num_blocks)
    if fused_merge is None:
        fused_merge = env_switch(FUSED_MERGE_ENV, False)
    fused = bool(fused_merge) and rows <= MERGE_ROWS
    counters = counter_table("draft_topk fused merge", logits.device, MERGE_ROWS) if fused else slice_max
    offsets = index if index_offset is None else index_offset  # unused stand-in without offsets
    offset_stride = 0 if index_offset is None else index_offset.stride(0)
    # What the merge writes, in both kernels' order: outputs, their strides, the index offsets.
    outputs = (logp, index, logp.stride(0), logp.stride(1), index.stride(0), index.stride(1), offsets, offset_stride)
    _draft_topk_slice_kernel[(rows, num_blocks)](
        logits,
        cand_value,
        cand_index,
        slice_max,
        slice_sum,
        vocab,
        num_blocks,
        logits.stride(0),
        counters,
        *outputs,
        K=k,
        BLOCK=block,
        WORK_DTYPE=work_tl,
        FUSED_MERGE=fused,
        HAS_OFFSET=index_offset is not None,
        BLOCK_C=block_c,
        BLOCK_NB=block_nb,
        num_warps=num_warps,
    )
    if fused:
        return
    _draft_topk_merge_kernel[(rows,)](
        cand_value,
        cand_index,
        slice_max,
        slice_sum,
        num_blocks,
        *outputs,
        K=k,
        HAS_OFFSET=index_offset is not None,
        BLOCK_C=block_c,
        BLOCK_NB=block_nb,
        num_warps=4 if block_c >= 512 else 1,
    )


FUSED_MERGE_ENV = "TREECOMPILE_TOPK_FUSED_MERGE"
MERGE_ROWS = 1 << 16  # rows a fused-merge launch may count (the counter table's size)


def slice_config(rows: int, vocab: int, k: int) -> tuple[int, int]:
    """(vocabulary slice per stage-1 program, its warps) from static sizes.

    H200 sweep (notes/gpu-2026-12-01/call1/topk.json, two kernels in a CUDA graph): an 8k draft vocabulary (the
    shipped SmolLM2 head) is fastest in 256-entry slices on one warp, whose k rounds of reductions are warp
    shuffles without block barriers (k=8: 7.5-7.9 -> 6.5 us at 1 and 8 rows; k=4, 4 rows: 5.7 -> 4.2 us); a
    32k one in 1024-entry slices on 4 warps (k=4: 5.5 -> 4.7-5.0 us).
    """
    if vocab <= 16384:
        return max(256, triton.next_power_of_2(k)), 1
    return max(1024, triton.next_power_of_2(k)), 4


if HAS_TRITON:

    @triton.jit
    def _draft_topk_slice_kernel(
        logits_ptr,
        cand_value_ptr,
        cand_index_ptr,
        slice_max_ptr,
        slice_sum_ptr,
        vocab,
        num_blocks,
        stride_lr,
        counters,
        logp_ptr,
        index_ptr,
        stride_pr,
        stride_pk,
        stride_ir,
        stride_ik,
        offset_ptr,
        stride_o,
        K: tl.constexpr,
        BLOCK: tl.constexpr,
        WORK_DTYPE: tl.constexpr,
        FUSED_MERGE: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_NB: tl.constexpr,
    ):
        # Stage 1, one program per (row, vocabulary slice): the slice's max, sum of exp(x - max), and
        # its top-k. The two-stage split (per-slice candidates, then one merge per row) follows the
        # idea of FlagGems' Triton topk (src/flag_gems/ops/topk.py); the fused log-sum-exp and the
        # tie rules are ours.
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offs < vocab
        x = tl.load(logits_ptr + row * stride_lr + offs, mask=in_vocab, other=float("-inf"))
        x = x.to(WORK_DTYPE)
        x = tl.where(x == x, x, float("-inf"))  # noqa: PLR0124  (x != x only for NaN): NaN counts as -inf
        idx = tl.where(in_vocab, offs, 2147483647)  # padding loses every tie to a real index

        m = tl.max(x, axis=0)
        # An all -inf slice would give exp(-inf - -inf) = NaN; shifting by 0 instead gives s = 0.
        m_shift = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp(x - m_shift), axis=0)
        ms_off = row * num_blocks + blk
        tl.store(slice_max_ptr + ms_off, m)
        tl.store(slice_sum_ptr + ms_off, s)

        # k rounds: best untaken value, lowest index among its equals, mark it taken. Taking by index
        # (not by overwriting the value with -inf) keeps -inf ties distinct and in index order.
        taken = offs < 0
        cand_off = ms_off * K
        for j in range(K):
            best = tl.max(tl.where(taken, float("-inf"), x), axis=0)
            sel = tl.min(tl.where((x == best) & ~taken, idx, 2147483647), axis=0)
            taken = taken | (idx == sel)
            tl.store(cand_value_ptr + cand_off + j, best)
            tl.store(cand_index_ptr + cand_off + j, sel)
        if FUSED_MERGE:
            # The row's last slice program to arrive merges it (split-K's semaphore, as in skinny_linear's
            # _split_k_store): the barrier orders every thread's stores before the counter's release, the
            # winner reads through L2 with .cg, then zeroes the counter for the next launch.
            tl.debug_barrier()
            arrived = tl.atomic_add(counters + row, 1, sem="acq_rel", scope="gpu")
            if arrived == num_blocks - 1:
                _merge_row(
                    cand_value_ptr, cand_index_ptr, slice_max_ptr, slice_sum_ptr, logp_ptr, index_ptr, row,
                    num_blocks, stride_pr, stride_pk, stride_ir, stride_ik, offset_ptr, stride_o, K, HAS_OFFSET,
                    BLOCK_C, BLOCK_NB, ".cg",
                )  # fmt: skip
                tl.atomic_xchg(counters + row, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _draft_topk_merge_kernel(
        cand_value_ptr,
        cand_index_ptr,
        slice_max_ptr,
        slice_sum_ptr,
        num_blocks,
        logp_ptr,
        index_ptr,
        stride_pr,
        stride_pk,
        stride_ir,
        stride_ik,
        offset_ptr,
        stride_o,
        K: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_NB: tl.constexpr,
    ):
        # Stage 2, one program per row (see _merge_row).
        _merge_row(
            cand_value_ptr, cand_index_ptr, slice_max_ptr, slice_sum_ptr, logp_ptr, index_ptr,
            tl.program_id(0).to(tl.int64), num_blocks, stride_pr, stride_pk, stride_ir, stride_ik, offset_ptr,
            stride_o, K, HAS_OFFSET, BLOCK_C, BLOCK_NB, "",
        )  # fmt: skip

    @triton.jit
    def _merge_row(
        cand_value_ptr, cand_index_ptr, slice_max_ptr, slice_sum_ptr, logp_ptr, index_ptr, row, num_blocks,
        stride_pr, stride_pk, stride_ir, stride_ik, offset_ptr, stride_o,
        K: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_NB: tl.constexpr,
        CACHE: tl.constexpr,
    ):  # fmt: skip
        # lse = M + log(sum_i s_i * exp(m_i - M)) over the slices, then k rounds over the NB * k candidates
        # (value desc, index asc). Every slice offers min(len, k) real candidates and V >= k, so padding
        # (index 2**31 - 1) is never reached. CACHE: ".cg" where other programs wrote the workspace (fused).
        b = tl.arange(0, BLOCK_NB)
        in_b = b < num_blocks
        m = tl.load(slice_max_ptr + row * num_blocks + b, mask=in_b, other=float("-inf"), cache_modifier=CACHE)
        s = tl.load(slice_sum_ptr + row * num_blocks + b, mask=in_b, other=0.0, cache_modifier=CACHE)
        big_m = tl.max(m, axis=0)
        m_shift = tl.where(big_m == float("-inf"), 0.0, big_m)  # all -inf row: log(0) -> lse = -inf
        lse = big_m + tl.log(tl.sum(s * tl.exp(m - m_shift), axis=0))

        num_cands = num_blocks * K
        c = tl.arange(0, BLOCK_C)
        in_c = c < num_cands
        value = tl.load(cand_value_ptr + row * num_cands + c, mask=in_c, other=float("-inf"), cache_modifier=CACHE)
        cidx = tl.load(cand_index_ptr + row * num_cands + c, mask=in_c, other=2147483647, cache_modifier=CACHE)
        taken = ~in_c
        for j in range(K):
            best = tl.max(tl.where(taken, float("-inf"), value), axis=0)
            tied = (value == best) & ~taken
            sel = tl.min(tl.where(tied, cidx, 2147483647), axis=0)
            # Exclude by position: padding candidates share one index, real ones are unique.
            pos = tl.min(tl.where(tied & (cidx == sel), c, BLOCK_C), axis=0)
            taken = taken | (c == pos)
            # An all -inf row: -inf - -inf = NaN, as torch.log_softmax gives.
            tl.store(logp_ptr + row * stride_pr + j * stride_pk, best - lse)
            out_index = sel.to(tl.int64)
            if HAS_OFFSET:  # EAGLE-3's d2t: draft id -> target id, in the store instead of a kernel of its own
                out_index += tl.load(offset_ptr + out_index * stride_o)
            tl.store(index_ptr + row * stride_ir + j * stride_ik, out_index)


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle)
# --------------------------------------------------------------------------------------------------


def draft_topk_reference(
    logits: torch.Tensor, k: int, index_offset: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch top-k of ``log_softmax``, worked in float64; same contract as the op."""
    work = logits.to(torch.float64)
    work = torch.where(torch.isnan(work), float("-inf"), work)
    # A stable descending sort keeps equal values in index order: ties go to the lower index, and an
    # all -inf row yields 0..k-1.
    index = torch.sort(work, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
    logp = torch.log_softmax(work, dim=-1).gather(1, index)  # all -inf row: NaN
    if index_offset is not None:
        index = index + index_offset.to(index.device)[index]
    return logp.to(_out_dtype(logits)), index
