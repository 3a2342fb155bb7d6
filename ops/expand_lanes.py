"""One draft step's record and its next lanes in one kernel: the K best of R lanes' K children each.

Why it exists: after each draft step, :class:`treecompile.DraftTree` adds every lane's children to the round's
record (cumulative score = the lane's score + min(child log-prob, 0), parent = the lane's candidate id) and
carries the K best forward as the next step's lanes (token, score, lane-window ancestor mask, candidate id,
parent lane). In torch that is a sort and a few gathers: two or three small kernels a step under Inductor. Here
one program per request takes the K best by K rounds of a block-wide max and writes everything. Measured with
``select_tree`` (H100, forty-fourth session): slower than Inductor's kernels (35.1 against 31.1 us a round at the
8B bench's (4, 5, 64)), so it is opt-in (``TREECOMPILE_TREE_KERNELS=1``).

Shapes (B requests, R lanes, K children a lane)
-----------------------------------------------
child_logp      [B, R, K]  float16 / bfloat16 / float32 / float64: log-probs of lane r's children (NaN: padding)
child_tokens    [B, R, K]  int64
own_bits        [K]        int64: the next lanes' own lane-window bits (zeros after the last step)
first_id        []         int64: the step's first candidate id (candidate of lane r's child c:
                           ``first_id + r*K + c``)
lane_scores     [B, R]     float32 / float64, or None for the root's children (step 0: R = 1, score 0,
lane_mask       [B, R]     int64                 mask 0, candidate -1: the round's ``begin``)
lane_candidate  [B, R]     int64
->
scores          [B, R*K]   lane_scores' dtype (root: float32, or float64 for float64 log-probs), the record
parents         [B, R*K]   int64 parent candidate ids (-1 for the root's children)
next_tokens, next_scores, next_mask, next_candidate, next_parent_lane : [B, K], the K best, best first

Order: higher score first, ties to the lower candidate id, NaN last (ties among NaN by id), the order of
:func:`treecompile.ops.select_tree.rank_order`. ``torch.ops.treespec.expand_lanes(child_logp, child_tokens,
own_bits, first_id, lane_scores=None, lane_mask=None, lane_candidate=None)`` needs ``R >= 1`` lanes and
``R * K <= 4096`` children a request. Only metadata is checked at the boundary: no host sync, safe under CUDA-graph
capture.
"""

from __future__ import annotations

import logging

import torch

from ._common import HAS_TRITON, check_dim, check_dtype, check_same_device, use_triton
from .select_tree import rank_order

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = ["MAX_CHILDREN", "expand_lanes", "expand_lanes_reference"]

MAX_CHILDREN = 4096  # R * K of one request in one program's registers (64 lanes of 64 children)
_SCORE_DTYPES = (torch.float32, torch.float64)
_LOGP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::expand_lanes", mutates_args=())
def expand_lanes(
    child_logp: torch.Tensor, child_tokens: torch.Tensor, own_bits: torch.Tensor, first_id: torch.Tensor,
    lane_scores: torch.Tensor | None = None, lane_mask: torch.Tensor | None = None,
    lane_candidate: torch.Tensor | None = None,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """Record a draft step and pick its K best children: ``(scores, parents [B, R*K], next_tokens, next_scores,
    next_mask, next_candidate, next_parent_lane [B, K])``."""
    lanes = (lane_scores, lane_mask, lane_candidate)
    _check_expand_inputs(child_logp, child_tokens, own_bits, first_id, *lanes)
    tensors = [t for t in (child_logp, child_tokens, own_bits, first_id, *lanes) if t is not None]
    if use_triton(*tensors):
        outputs = _empty_outputs(child_logp, lane_scores)
        _launch_expand_lanes(child_logp, child_tokens, own_bits, first_id, *lanes, *outputs)
        return outputs
    return expand_lanes_reference(child_logp, child_tokens, own_bits, first_id, *lanes)


@expand_lanes.register_fake
def _(child_logp, child_tokens, own_bits, first_id, lane_scores=None, lane_mask=None, lane_candidate=None):
    _check_expand_inputs(child_logp, child_tokens, own_bits, first_id, lane_scores, lane_mask, lane_candidate)
    return _empty_outputs(child_logp, lane_scores)


def _score_dtype(child_logp: torch.Tensor, lane_scores: torch.Tensor | None) -> torch.dtype:
    if lane_scores is not None:
        return lane_scores.dtype
    return torch.promote_types(child_logp.dtype, torch.float32)


def _empty_outputs(child_logp: torch.Tensor, lane_scores: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    B, R, K = child_logp.shape
    dtype, device = _score_dtype(child_logp, lane_scores), child_logp.device
    return (
        torch.empty((B, R * K), dtype=dtype, device=device),
        torch.empty((B, R * K), dtype=torch.int64, device=device),
        torch.empty((B, K), dtype=torch.int64, device=device),
        torch.empty((B, K), dtype=dtype, device=device),
        *(torch.empty((B, K), dtype=torch.int64, device=device) for _ in range(3)),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Validation (metadata only)
# --------------------------------------------------------------------------------------------------


def _check_expand_inputs(child_logp, child_tokens, own_bits, first_id, lane_scores, lane_mask, lane_candidate):
    check_dim("child_logp", child_logp, 3, "[B, R, K]")
    check_dtype("child_logp", child_logp, *_LOGP_DTYPES)
    check_dim("child_tokens", child_tokens, 3, "[B, R, K]")
    check_dtype("child_tokens", child_tokens, torch.int64)
    if child_tokens.shape != child_logp.shape:
        raise ValueError(f"child_tokens: expected shape {tuple(child_logp.shape)} like child_logp, "
                         f"got {tuple(child_tokens.shape)}")  # fmt: skip
    B, R, K = child_logp.shape
    if R < 1 or K < 1:
        raise ValueError(f"child_logp: expected at least one lane and one child, got shape {tuple(child_logp.shape)}")
    if R * K > MAX_CHILDREN:
        raise ValueError(f"child_logp: R * K = {R * K} children a request exceed the limit of {MAX_CHILDREN}")
    check_dim("own_bits", own_bits, 1, "[K]")
    check_dtype("own_bits", own_bits, torch.int64)
    if own_bits.shape[0] != K:
        raise ValueError(f"own_bits: expected [K={K}], got {tuple(own_bits.shape)}")
    check_dim("first_id", first_id, 0, "[] (a 0-d tensor)")
    check_dtype("first_id", first_id, torch.int64)
    lanes = {"lane_scores": lane_scores, "lane_mask": lane_mask, "lane_candidate": lane_candidate}
    given = [name for name, t in lanes.items() if t is not None]
    if given and len(given) != 3:
        missing = sorted(set(lanes) - set(given))
        raise ValueError(f"{', '.join(missing)}: pass all three lane tensors, or none for the root's children")
    if not given:
        if R != 1:
            raise ValueError(f"child_logp: without lane tensors (the root's children) R must be 1, got R = {R}")
    else:
        check_dtype("lane_scores", lane_scores, *_SCORE_DTYPES)
        check_dtype("lane_mask", lane_mask, torch.int64)
        check_dtype("lane_candidate", lane_candidate, torch.int64)
        for name in given:
            check_dim(name, lanes[name], 2, "[B, R]")
            if tuple(lanes[name].shape) != (B, R):
                raise ValueError(f"{name}: expected [B={B}, R={R}], got {tuple(lanes[name].shape)}")
    check_same_device(child_logp=child_logp, child_tokens=child_tokens, own_bits=own_bits, first_id=first_id,
                      **{name: lanes[name] for name in given})  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def _launch_expand_lanes(child_logp, child_tokens, own_bits, first_id, lane_scores, lane_mask, lane_candidate,
                         scores, parents, next_tokens, next_scores, next_mask, next_candidate,
                         next_parent_lane) -> None:  # fmt: skip
    """Fill the seven preallocated outputs (any strides) of :func:`expand_lanes`."""
    B, R, K = child_logp.shape
    if B == 0:
        return
    root = lane_scores is None
    # Stand-ins for the root's absent lane tensors: never read (ROOT is a constexpr).
    lane_scores, lane_mask, lane_candidate = (scores, parents, parents) if root else (lane_scores, lane_mask,
                                                                                     lane_candidate)  # fmt: skip
    block = max(16, triton.next_power_of_2(R * K))
    outs = (scores, parents, next_tokens, next_scores, next_mask, next_candidate, next_parent_lane)
    _expand_lanes_kernel[(B,)](
        child_logp, child_tokens, own_bits, first_id, lane_scores, lane_mask, lane_candidate, *outs,
        R, K, *child_logp.stride(), *child_tokens.stride(), own_bits.stride(0), lane_scores.stride(0),
        lane_scores.stride(1), lane_mask.stride(0), lane_mask.stride(1), lane_candidate.stride(0),
        lane_candidate.stride(1), *(s for t in outs for s in t.stride()),
        ROOT=root, BLOCK=block, BLOCK_K=triton.next_power_of_2(K), num_warps=1 if block <= 256 else 4,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _expand_lanes_kernel(
        logp_ptr, tokens_ptr, own_ptr, first_ptr, lscore_ptr, lmask_ptr, lcand_ptr,
        scores_ptr, parents_ptr, ntok_ptr, nscore_ptr, nmask_ptr, ncand_ptr, nlane_ptr,
        R, K,
        s_lb, s_lr, s_lk, s_tb, s_tr, s_tk, s_own, s_sb, s_sr, s_mb, s_mr, s_cb, s_cr,
        s_ob, s_oc, s_pb, s_pc, s_ntb, s_ntk, s_nsb, s_nsk, s_nmb, s_nmk, s_ncb, s_nck, s_nlb, s_nlk,
        ROOT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # One program per request: the R*K children in registers (flat index i = r*K + c, the candidate-id
        # order), then K rounds of "best untaken" as in ops/draft_topk.py's slice kernel, with rank_order's
        # order: the highest NaN-free score, the lowest index among its equals, NaNs last by index.
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        live = i < R * K
        r, c = i // K, i % K
        logp = tl.load(logp_ptr + b * s_lb + r * s_lr + c * s_lk, mask=live, other=0.0)
        if ROOT:  # the clamped log-probs themselves
            score = logp.to(scores_ptr.dtype.element_ty)
            score = tl.where(score > 0.0, 0.0, score)  # clamp(max=0); NaN stays NaN
            parent = tl.full([BLOCK], -1, tl.int64)
        else:
            base = tl.load(lscore_ptr + b * s_sb + r * s_sr, mask=live, other=0.0)
            clamped = logp.to(base.dtype)
            score = base + tl.where(clamped > 0.0, 0.0, clamped)
            parent = tl.load(lcand_ptr + b * s_cb + r * s_cr, mask=live, other=-1)
        tl.store(scores_ptr + b * s_ob + i * s_oc, score, mask=live)
        tl.store(parents_ptr + b * s_pb + i * s_pc, parent, mask=live)

        # Everything a pick reads is loaded up front, as vectors: a load that depended on the pick would put a
        # memory latency inside every round. A pick's values come out of registers by a masked sum.
        tokens = tl.load(tokens_ptr + b * s_tb + r * s_tr + c * s_tk, mask=live, other=0)
        if ROOT:
            lane_mask = tl.zeros([BLOCK], tl.int64)
        else:
            lane_mask = tl.load(lmask_ptr + b * s_mb + r * s_mr, mask=live, other=0)
        jj = tl.arange(0, BLOCK_K)
        in_k = jj < K
        next_mask = tl.load(own_ptr + jj * s_own, mask=in_k, other=0)
        first_id = tl.load(first_ptr)
        next_token = tl.zeros([BLOCK_K], tl.int64)
        next_score = tl.zeros([BLOCK_K], scores_ptr.dtype.element_ty)
        next_index = tl.zeros([BLOCK_K], tl.int32)

        nan = score != score  # noqa: PLR0124  (NaN only)
        taken = ~live
        for j in range(K):
            finite = ~taken & ~nan
            best = tl.max(tl.where(finite, score, float("-inf")), axis=0)
            any_finite = tl.max(finite.to(tl.int32), axis=0) > 0
            pick = tl.where(any_finite, finite & (score == best), ~taken & nan)
            sel = tl.min(tl.where(pick, i, BLOCK), axis=0)
            hit = i == sel
            taken = taken | hit
            here = jj == j
            next_index = tl.where(here, sel, next_index)
            next_token = tl.where(here, tl.sum(tl.where(hit, tokens, 0), axis=0), next_token)
            next_mask = tl.where(here, next_mask | tl.sum(tl.where(hit, lane_mask, 0), axis=0), next_mask)
            next_score = tl.where(here, tl.where(any_finite, best, float("nan")), next_score)  # NaN pick: NaN
        tl.store(ntok_ptr + b * s_ntb + jj * s_ntk, next_token, mask=in_k)
        tl.store(nscore_ptr + b * s_nsb + jj * s_nsk, next_score, mask=in_k)
        tl.store(nmask_ptr + b * s_nmb + jj * s_nmk, next_mask, mask=in_k)
        tl.store(ncand_ptr + b * s_ncb + jj * s_nck, next_index.to(tl.int64) + first_id, mask=in_k)
        tl.store(nlane_ptr + b * s_nlb + jj * s_nlk, (next_index // K).to(tl.int64), mask=in_k)


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle): DraftTree's torch code
# --------------------------------------------------------------------------------------------------


def expand_lanes_reference(child_logp, child_tokens, own_bits, first_id, lane_scores=None, lane_mask=None,
                           lane_candidate=None, pairwise: bool = False):  # fmt: skip
    """Pure torch, the op's contract on any device (a sort where the kernel takes K maxima). No ``.item()``
    and fixed shapes: it compiles (``fullgraph``) and captures. ``pairwise``: ranks by counting
    (:func:`~treecompile.ops.select_tree.ascending_unique`)."""
    B, R, K = child_logp.shape
    if lane_scores is None:  # the root's children: scores are the clamped log-probs themselves (no 0 + x)
        scores = child_logp.to(_score_dtype(child_logp, None)).clamp(max=0).reshape(B, K)
        parents = torch.full((B, K), -1, dtype=torch.int64, device=child_logp.device)
    else:
        scores = (lane_scores.unsqueeze(2) + child_logp.to(lane_scores.dtype).clamp(max=0)).reshape(B, R * K)
        parents = lane_candidate.unsqueeze(2).expand(B, R, K).reshape(B, R * K)
    order = rank_order(scores, pairwise)[:, :K]  # [B, K] flat child index, best first
    parent_lane = torch.div(order, K, rounding_mode="floor")
    mask = own_bits.expand(B, K).clone() if lane_mask is None else lane_mask.gather(1, parent_lane) | own_bits
    tokens = child_tokens.reshape(B, R * K)
    return (scores, parents, tokens.gather(1, order), scores.gather(1, order), mask, order + first_id,
            parent_lane)  # fmt: skip
