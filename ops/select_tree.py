"""Select a draft round's verify tree in one kernel: the best N-1 candidates, numbered depth first.

Why it exists: a draft round records ``C = K + (S-1)K^2`` scored candidates per request and keeps the best
N-1 as the next verify tree, numbered depth first, best child first (:class:`treecompile.DraftTree`).
Written in torch that is two sorts (the ranking, then the depth-first order of the kept rank paths), two
scatters and a dozen gathers and masks: ~10 launches of a CUDA-graph replay on the H100 (~30 us a round,
notes/gpu-2026-12-05-s42/prof_h100_glu_pdl0/draft.txt), each a kernel of a few hundred elements. Here one
program per request does it all in registers. Measured (H100, forty-fourth session, with ``expand_lanes``): a
round's bookkeeping took 35.1 us against Inductor's 31.1 at (K, S, N) = (4, 5, 64), and 112.9 against 51.2 at
(10, 6, 64), where the C^2 ranking of 610 candidates in one program dominates. So it is opt-in
(``TREECOMPILE_TREE_KERNELS=1``), not the default.

How, without a sort (all counts are over registers, [64, 64] at most per step):

- rank: candidate i's rank is the number of candidates ranked before it (higher score, ties to the lower
  id, NaN last); the kept position p < M = N-1 holds the candidate of rank p.
- ``parent_pos[p]``: the kept position of p's parent (-1 for children of the root). Scores never rise along
  a path and a parent's id is below its children's, so a parent ranks before its children and the kept
  set is closed under parents (the caller's contract, see below).
- ``anc[p]``: a 64-bit word of p's kept ancestors and p itself, by S-1 steps up the parents.
- Depth-first, best-child-first order: node u comes before v when u is an ancestor of v, or when, where
  their paths part, u's branch is a better-ranked sibling of v's. So v's index is 1 (the root) plus its
  depth - 1 strict ancestors plus the sizes of the subtrees of every better-ranked sibling of v and of v's
  ancestors. Those siblings' subtrees are disjoint, and each word below is a sum of distinct bits (an OR).

Shapes
------
scores       [B, C]  float32 / float64: cumulative log-probs in candidate-id order (NaN: padded, ranks last)
tokens       [B, C]  int64
parents      [B, C]  int64: parent candidate id, -1 for the K children of the root (ids 0 .. K-1)
root_tokens  [B]     int64: node 0's token
->
tree_tokens, tree_parents, depth, ancestor_mask, candidate : [B, N] int64, as
:class:`treecompile.draft_tree.TreeBatch` documents (node 0: root token, parent -1, depth 0, mask 1,
candidate -1).

``torch.ops.treespec.select_tree(scores, tokens, parents, root_tokens, topk, num_nodes)`` with
``C = topk + (steps-1) * topk^2`` for some ``steps >= 1`` and ``1 <= num_nodes <= min(64, C + 1)``. Candidate
c's depth follows from its id: 1 for ``c < topk``, else ``(c - topk) // topk^2 + 2``.

Contract (not checked: reading values would be a host sync): every candidate ranks after its parent. That
holds when a parent's id is below its children's and a child's score is NaN or at most its parent's, with NaN
parents having NaN children, as DraftTree's clamped cumulative log-probs are. Then the best N-1 are closed under
parents, so the kept set is a tree. Only metadata is checked at the boundary: no host sync, safe under
CUDA-graph capture.
"""

from __future__ import annotations

import logging

import torch

from ._common import HAS_TRITON, MAX_NODES, check_dim, check_dtype, check_same_device, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = ["ascending_unique", "rank_order", "select_tree", "select_tree_reference", "tree_steps"]

_SCORE_DTYPES = (torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::select_tree", mutates_args=())
def select_tree(
    scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, root_tokens: torch.Tensor, topk: int,
    num_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The best ``num_nodes - 1`` candidates as a depth-first tree: ``[B, C] x3, [B] -> 5 x [B, N]`` int64
    (tokens, parents, depth, ancestor_mask, candidate)."""
    _check_select_inputs(scores, tokens, parents, root_tokens, topk, num_nodes)
    if use_triton(scores, tokens, parents, root_tokens):
        outputs = _empty_outputs(scores, num_nodes)
        _launch_select_tree(scores, tokens, parents, root_tokens, topk, *outputs)
        return outputs
    return select_tree_reference(scores, tokens, parents, root_tokens, topk, num_nodes)


@select_tree.register_fake
def _(scores, tokens, parents, root_tokens, topk, num_nodes):
    _check_select_inputs(scores, tokens, parents, root_tokens, topk, num_nodes)
    return _empty_outputs(scores, num_nodes)


def _empty_outputs(scores: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, ...]:
    shape = (scores.shape[0], num_nodes)
    return tuple(torch.empty(shape, dtype=torch.int64, device=scores.device) for _ in range(5))


# --------------------------------------------------------------------------------------------------
# Validation (metadata only)
# --------------------------------------------------------------------------------------------------


def tree_steps(num_candidates: int, topk: int) -> int | None:
    """S with ``num_candidates == topk + (S-1) * topk^2`` (S >= 1), or None when there is none."""
    if topk < 1 or num_candidates < topk or (num_candidates - topk) % (topk * topk):
        return None
    return 1 + (num_candidates - topk) // (topk * topk)


def _check_select_inputs(scores, tokens, parents, root_tokens, topk: int, num_nodes: int) -> None:
    check_dim("scores", scores, 2, "[B, C]")
    check_dtype("scores", scores, *_SCORE_DTYPES)
    for name, t in (("tokens", tokens), ("parents", parents)):
        check_dim(name, t, 2, "[B, C]")
        check_dtype(name, t, torch.int64)
        if t.shape != scores.shape:
            raise ValueError(f"{name}: expected shape {tuple(scores.shape)} like scores, got {tuple(t.shape)}")
    check_dim("root_tokens", root_tokens, 1, "[B]")
    check_dtype("root_tokens", root_tokens, torch.int64)
    if root_tokens.shape[0] != scores.shape[0]:
        raise ValueError(f"root_tokens: expected [B={scores.shape[0]}], got {tuple(root_tokens.shape)}")
    check_same_device(scores=scores, tokens=tokens, parents=parents, root_tokens=root_tokens)
    num_candidates = scores.shape[1]
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected an int >= 1, got {topk!r}")
    if tree_steps(num_candidates, topk) is None:
        raise ValueError(
            f"scores: C = scores.shape[1] = {num_candidates} is not topk + (steps-1) * topk^2 for topk = {topk} "
            "and any steps >= 1"
        )
    if not 1 <= num_nodes <= MAX_NODES:
        raise ValueError(f"num_nodes: the tree must have 1..{MAX_NODES} nodes, got {num_nodes}")
    if num_nodes - 1 > num_candidates:
        raise ValueError(f"num_nodes: num_nodes - 1 = {num_nodes - 1} exceeds the C = {num_candidates} candidates")


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def _launch_select_tree(scores, tokens, parents, root_tokens, topk, out_tokens, out_parents, out_depth,
                        out_mask, out_candidate, block_c: int = 64) -> None:  # fmt: skip
    """Fill preallocated ``[B, N]`` int64 outputs (any strides). ``block_c``: candidates per tile of the
    ranking (a power of two >= 16; a [block_c, block_c] tile of comparisons per step)."""
    batch, num_candidates = scores.shape
    num_nodes = out_tokens.shape[1]
    if batch == 0:
        return
    if block_c < 16 or block_c & (block_c - 1):
        raise ValueError(f"block_c: expected a power of two >= 16, got {block_c}")
    steps = tree_steps(num_candidates, topk)
    outs = (out_tokens, out_parents, out_depth, out_mask, out_candidate)
    _select_tree_kernel[(batch,)](
        scores, tokens, parents, root_tokens, *outs,
        num_candidates, num_nodes - 1, topk, steps,
        scores.stride(0), scores.stride(1), tokens.stride(0), tokens.stride(1), parents.stride(0),
        parents.stride(1), root_tokens.stride(0),
        *(s for t in outs for s in t.stride()),
        BLOCK_C=block_c, BLOCK_M=MAX_NODES, num_warps=8,  # 4 warps spill (ptxas -v, sm_90a, Triton 3.6)
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _select_tree_kernel(
        scores_ptr, tokens_ptr, parents_ptr, root_ptr,
        out_tokens_ptr, out_parents_ptr, out_depth_ptr, out_mask_ptr, out_cand_ptr,
        num_candidates, num_kept, topk, steps,
        stride_sb, stride_sc, stride_tb, stride_tc, stride_pb, stride_pc, stride_rb,
        stride_otb, stride_otn, stride_opb, stride_opn, stride_odb, stride_odn, stride_omb, stride_omn,
        stride_ocb, stride_ocn,
        BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        # One program per request; the algorithm is the module docstring's. Row vectors indexed by kept
        # position are [BLOCK_M]; a "gather" among them is a masked sum over a [BLOCK_M, BLOCK_M] tile.
        b = tl.program_id(0).to(tl.int64)
        pos = tl.arange(0, BLOCK_M)
        kept = pos < num_kept

        # 1. Ranks by counting, tile by tile; the candidate of rank p < M goes to kept position p.
        cand = tl.zeros([BLOCK_M], tl.int64)
        token = tl.zeros([BLOCK_M], tl.int64)
        parent_cand = tl.zeros([BLOCK_M], tl.int64)
        for i0 in range(0, num_candidates, BLOCK_C):
            ci = i0 + tl.arange(0, BLOCK_C)
            in_i = ci < num_candidates
            si = tl.load(scores_ptr + b * stride_sb + ci * stride_sc, mask=in_i, other=float("nan"))
            nan_i = si != si  # noqa: PLR0124  (NaN only)
            rank = tl.zeros([BLOCK_C], tl.int32)
            for j0 in range(0, num_candidates, BLOCK_C):
                cj = j0 + tl.arange(0, BLOCK_C)
                in_j = cj < num_candidates
                sj = tl.load(scores_ptr + b * stride_sb + cj * stride_sc, mask=in_j, other=float("nan"))
                nan_j = (sj != sj)[:, None]  # noqa: PLR0124
                lower = cj[:, None] < ci[None, :]
                s_j, s_i = sj[:, None], si[None, :]
                # j before i: a NaN-free j beats a NaN i, a higher score, or an equal score at a lower id
                # (-0.0 == 0.0 here, as in rank_order's keys); NaNs rank among themselves by id.
                finite_first = ~nan_j & (nan_i[None, :] | (s_j > s_i) | ((s_j == s_i) & lower))
                before = (finite_first | (nan_j & nan_i[None, :] & lower)) & in_j[:, None]
                rank += tl.sum(before.to(tl.int32), axis=0)
            # The kept candidates' tokens and parents come along by the same masked sums (loaded with the
            # scores, not gathered by id afterwards: no memory latency after the ranking).
            tok_i = tl.load(tokens_ptr + b * stride_tb + ci * stride_tc, mask=in_i, other=0)
            par_i = tl.load(parents_ptr + b * stride_pb + ci * stride_pc, mask=in_i, other=0)
            at = (rank[None, :] == pos[:, None]) & in_i[None, :]  # [BLOCK_M, BLOCK_C]
            cand += tl.sum(tl.where(at, ci[None, :], 0), axis=1).to(tl.int64)
            token += tl.sum(tl.where(at, tok_i[None, :], 0), axis=1)
            parent_cand += tl.sum(tl.where(at, par_i[None, :], 0), axis=1)

        parent_cand = tl.where(kept, parent_cand, -1)
        depth = tl.where(cand < topk, 1, (cand - topk) // (topk * topk) + 2)

        # 2. The kept position of each parent (-1: a child of the root).
        row, col = pos[:, None], pos[None, :]  # [BLOCK_M, 1], [1, BLOCK_M]
        is_parent = (parent_cand[:, None] == cand[None, :]) & kept[None, :]
        parent_pos = tl.sum(tl.where(is_parent, col, 0), axis=1)
        parent_pos = tl.where(kept & (parent_cand >= 0), parent_pos, -1)

        # 3. anc[p]: bits of p's kept ancestors and p (positions < 63: no sign bit). Depth <= steps.
        one = tl.full([BLOCK_M], 1, tl.int64)
        anc = tl.where(kept, one << pos.to(tl.int64), 0)
        up = parent_pos
        for _ in range(steps - 1):
            anc |= tl.where(up >= 0, one << tl.maximum(up, 0).to(tl.int64), 0)
            up_next = tl.sum(tl.where(up[:, None] == col, parent_pos[None, :], 0), axis=1)
            up = tl.where(up >= 0, up_next, -1)

        # 4. Depth-first index. better[p]: p's better-ranked siblings (same parent, lower position);
        # before[v]: those of v and of all v's ancestors; size[y]: y's kept subtree, y included.
        one_col = tl.full([1, BLOCK_M], 1, tl.int64) << col.to(tl.int64)
        same_parent = (parent_pos[:, None] == parent_pos[None, :]) & (col < row) & kept[:, None] & kept[None, :]
        better = tl.sum(tl.where(same_parent, one_col, 0), axis=1)
        anc_bit = ((anc[:, None] >> col.to(tl.int64)) & 1) != 0  # [v, x]: x is an ancestor of v (or v)
        before = tl.sum(tl.where(anc_bit, better[None, :], 0), axis=1)
        size = tl.sum(anc_bit.to(tl.int64), axis=0)  # [y]: kept nodes under y
        before_bit = ((before[:, None] >> col.to(tl.int64)) & 1) != 0
        node = depth + tl.sum(tl.where(before_bit, size[None, :], 0), axis=1)  # 1 + (depth - 1) + subtrees

        # 5. Outputs by node index: the ancestor word over node indices (node 63 sets the sign bit; the
        # bits are distinct, so the sum is the OR), the parent's node index.
        node_bit = tl.full([1, BLOCK_M], 1, tl.int64) << node[None, :]
        mask_word = tl.sum(tl.where(anc_bit, node_bit, 0), axis=1) | 1
        parent_node = tl.sum(tl.where(parent_pos[:, None] == col, node[None, :], 0), axis=1)
        parent_node = tl.where(parent_pos >= 0, parent_node, 0)
        tl.store(out_tokens_ptr + b * stride_otb + node * stride_otn, token, mask=kept)
        tl.store(out_parents_ptr + b * stride_opb + node * stride_opn, parent_node, mask=kept)
        tl.store(out_depth_ptr + b * stride_odb + node * stride_odn, depth, mask=kept)
        tl.store(out_mask_ptr + b * stride_omb + node * stride_omn, mask_word, mask=kept)
        tl.store(out_cand_ptr + b * stride_ocb + node * stride_ocn, cand, mask=kept)
        # The root, node 0.
        tl.store(out_tokens_ptr + b * stride_otb, tl.load(root_ptr + b * stride_rb))
        tl.store(out_parents_ptr + b * stride_opb, -1)
        tl.store(out_depth_ptr + b * stride_odb, 0)
        tl.store(out_mask_ptr + b * stride_omb, 1)
        tl.store(out_cand_ptr + b * stride_ocb, -1)


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle): two sorts, as DraftTree ran before this op
# --------------------------------------------------------------------------------------------------


def ascending_unique(keys: torch.Tensor, pairwise: bool = False) -> torch.Tensor:
    """Permutation sorting ``keys [..., C]`` (int64, distinct along the last dim) ascending: ``sort().indices``.

    ``pairwise``: no sort. Each key's rank is the number of keys below it (a ``[.., C, C]`` comparison summed:
    one reduction kernel under Inductor, every element in parallel) and the permutation is a scatter of the
    indices to their ranks. Exact for distinct keys, the same result as the sort; C^2 comparisons, so meant
    for the few dozen to few hundred candidates of a round (opt-in, ``TREECOMPILE_PAIRWISE_RANK=1``, until the
    GPU has timed it against the single-program sort)."""
    if not pairwise:
        return torch.sort(keys, dim=-1).indices
    rank = (keys.unsqueeze(-2) < keys.unsqueeze(-1)).sum(-1)  # [.., i]: #{j : key_j < key_i}
    index = torch.arange(keys.shape[-1], device=keys.device).expand_as(rank)
    return torch.empty_like(rank).scatter_(-1, rank, index)


def rank_order(scores: torch.Tensor, pairwise: bool = False) -> torch.Tensor:
    """Permutation ranking the last dim of ``scores``: higher first, ties to the lower index, NaN last.

    Parameters
    ----------
    scores : [..., C] floating, whose last-dim index is the candidate id order.
    pairwise : rank without a sort (:func:`ascending_unique`); float32 and 16-bit scores only, float64 keeps
        its two stable sorts.

    Returns
    -------
    [..., C] int64: ``order[..., 0]`` is the best candidate's index.
    """
    nan = torch.isnan(scores)
    if scores.dtype != torch.float64 and scores.shape[-1] <= 1 << 31:
        # One sort of unique int64 keys: the float32 bits of `0 - s` (-0.0 and +0.0 become one key) mapped to
        # their unsigned order, NaN above everything, then the candidate index: ties go to the lower index
        # without a stable sort. (Under Inductor a sort of a few hundred candidates is one single-program
        # kernel of ~19 us on the H200: one pass instead of two.) 16-bit scores widen to float32 exactly.
        bits = (0.0 - scores.float()).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        ordered = torch.where(bits >= 1 << 31, (~bits) & 0xFFFFFFFF, bits | (1 << 31))
        ordered = torch.where(nan, 0xFFFFFFFF, ordered)
        index = torch.arange(scores.shape[-1], device=scores.device)
        return ascending_unique((ordered << 31) | index, pairwise)
    # float64 (the CPU reference path): its bits do not fit a key beside an index; two stable passes.
    # `0 - s` maps -0.0 and +0.0 to one key (a radix sort would split them); NaN's own sort position
    # differs across devices and NaN sign bits, so NaN gets a finite-free key and a second stable pass.
    key = torch.where(nan, torch.full_like(scores, float("inf")), 0.0 - scores)
    order = torch.sort(key, dim=-1, stable=True).indices
    nan_last = torch.sort(nan.gather(-1, order).to(torch.uint8), dim=-1, stable=True).indices
    return order.gather(-1, nan_last)


def _bit(index: torch.Tensor) -> torch.Tensor:
    """``1 << index`` as int64 (index int64 in 0..63; bit 63 is the sign bit)."""
    return torch.bitwise_left_shift(torch.ones_like(index), index)


def select_tree_reference(scores, tokens, parents, root_tokens, topk: int, num_nodes: int, pairwise: bool = False):
    """Pure torch, same contract as the op (any device, float64 exact): rank, keep the best M = N-1, then
    order the kept rank paths lexicographically. No ``.item()`` and fixed shapes, so it compiles
    (``fullgraph``) and captures too. ``pairwise``: :func:`ascending_unique`'s counting in place of sorts."""
    B, C = scores.shape
    S = tree_steps(C, topk)
    M = num_nodes - 1  # kept candidates
    device = scores.device
    ids = torch.arange(C, dtype=torch.int64, device=device)
    cand_depth = torch.where(ids < topk, 1, (ids - topk) // (topk * topk) + 2)

    kept = rank_order(scores, pairwise)[:, :M]  # [B, M] candidate ids; position p = global rank p
    pos = torch.arange(M, dtype=torch.int64, device=device).expand(B, M)
    pos_of_cand = torch.full_like(tokens, M).scatter_(1, kept, pos)  # M: not kept
    kept_parent = parents.gather(1, kept)
    # Closure under parents (the module's contract) makes every non-root parent a kept position.
    parent_pos = torch.where(kept_parent < 0, -1, pos_of_cand.gather(1, kept_parent.clamp(min=0)))
    kept_depth = cand_depth.expand(B, -1).gather(1, kept)

    # path[b, p, l-1]: rank of p's ancestor at depth l (p itself at its own depth), -1 past p's depth.
    # Depth-first, best-child-first order is the lexicographic order of these rank paths: two nodes
    # first differ at siblings, which the global rank orders like their scores.
    levels = torch.arange(1, S + 1, dtype=torch.int64, device=device)
    path = torch.full((B, M, S), -1, dtype=torch.int64, device=device)
    cur, cur_depth = pos, kept_depth
    for _ in range(S):
        path = torch.where(levels == cur_depth.unsqueeze(2), cur.unsqueeze(2), path)
        cur = torch.where(cur >= 0, parent_pos.gather(1, cur.clamp(min=0)), -1)
        cur_depth = cur_depth - 1

    bits = max(1, M.bit_length())  # a rank + 1 is 0..M (-1, past a node's depth, becomes 0)
    if S * bits <= 63:
        # One sort: each rank path packed into an int64, depth 1 most significant, is its lexicographic order,
        # and the keys are unique (one path per node), so no stable pass is needed.
        shifts = (S - levels) * bits  # level l (column l - 1) shifts by (S - l) * bits
        perm = ascending_unique(((path + 1) << shifts).sum(-1), pairwise)
    else:
        perm = pos  # S stable sorts, deepest level first: LSD-radix order gives the lexicographic one
        for level in range(S - 1, -1, -1):
            key = path[:, :, level].gather(1, perm)
            perm = perm.gather(1, torch.sort(key, dim=1, stable=True).indices)

    node_of_pos = torch.empty_like(pos).scatter_(1, perm, pos + 1)  # kept position -> node index
    node_path = node_of_pos.gather(1, path.clamp(min=0).reshape(B, M * S)).view(B, M, S)
    node_bits = torch.where(path >= 0, _bit(node_path), 0)
    kept_mask = node_bits[:, :, 0]
    for level in range(1, S):
        kept_mask = kept_mask | node_bits[:, :, level]
    kept_mask = kept_mask | 1  # the root is everyone's ancestor

    parent_of_node = parent_pos.gather(1, perm)  # kept position of each node's parent, -1: the root
    parent_node = node_of_pos.gather(1, parent_of_node.clamp(min=0))
    parent_of_node = torch.where(parent_of_node >= 0, parent_node, 0)
    col0 = torch.zeros(B, 1, dtype=torch.int64, device=device)
    return (
        torch.cat([root_tokens.reshape(B, 1), tokens.gather(1, kept.gather(1, perm))], 1),
        torch.cat([col0 - 1, parent_of_node], 1),
        torch.cat([col0, kept_depth.gather(1, perm)], 1),
        torch.cat([col0 + 1, kept_mask.gather(1, perm)], 1),
        torch.cat([col0 - 1, kept.gather(1, perm)], 1),
    )  # fmt: skip
