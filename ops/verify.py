"""Greedy verification of draft trees.

After the target's verify forward over a tree's N nodes, ``target_tokens[b, i]`` is the target's greedy
token after node i. Acceptance walks from the root (node 0, already committed): a child of the current
node is accepted when its token equals the current node's target token; when several children carry
that token the lowest node index wins; the walk stops at the first node none of whose children matches.
A chain (``parents[i] == i - 1``) therefore accepts exactly while ``tokens[i + 1] == target_tokens[i]``.

Shapes (all int64)
------------------
parents        [B, N]   ``parents[b, 0] == -1``, ``parents[b, i] < i``; 1 <= N <= 64
tokens         [B, N]   the draft token of each node (``tokens[b, 0]``, the root's, is not read)
target_tokens  [B, N]   the target's greedy token after each node
accepted_path  [B, N]   accepted node indices, root first: ``accepted_path[b, :accept_len[b]]``;
                        entries at ``i >= accept_len[b]`` are padding, always -1
accept_len     [B]      number of accepted nodes, counting the root (1 <= accept_len <= N)
bonus          [B]      ``target_tokens[b, accepted_path[b, accept_len[b] - 1]]``, the token the target
                        emits after the last accepted node

``torch.ops.treespec.verify_tree_greedy(parents, tokens, target_tokens) -> (accepted_path, accept_len,
bonus)``. Only metadata is checked at the boundary (no host sync); run
:func:`treecompile.ops.tree_mask.validate_parents` outside capture to check that ``parents`` is a tree.
"""

from __future__ import annotations

import logging

import torch

from ._common import (
    HAS_TRITON,
    MAX_NODES,
    check_dim,
    check_dtype,
    check_num_nodes,
    check_same_device,
    use_triton,
    values_checkable,
)
from .tree_mask import requests_per_program, validate_parents

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = ["verify_tree_greedy", "verify_tree_greedy_reference"]

PATH_PADDING = -1  # accepted_path entries past accept_len


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::verify_tree_greedy", mutates_args=())
def verify_tree_greedy(
    parents: torch.Tensor, tokens: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree walk: ``[B, N] x3 -> (accepted_path [B, N], accept_len [B], bonus [B])``, int64."""
    _check_verify_inputs(parents, tokens, target_tokens)
    if values_checkable(parents):
        validate_parents(parents)
    if use_triton(parents, tokens, target_tokens):
        accepted_path, accept_len, bonus = _empty_outputs(parents)
        _launch_verify_tree_greedy(parents, tokens, target_tokens, accepted_path, accept_len, bonus)
        return accepted_path, accept_len, bonus
    return verify_tree_greedy_reference(parents, tokens, target_tokens)


@verify_tree_greedy.register_fake
def _(parents: torch.Tensor, tokens: torch.Tensor, target_tokens: torch.Tensor):
    _check_verify_inputs(parents, tokens, target_tokens)
    return _empty_outputs(parents)


def _empty_outputs(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, num_nodes = parents.shape
    return (
        parents.new_empty((batch, num_nodes)),
        parents.new_empty((batch,)),
        parents.new_empty((batch,)),
    )


# --------------------------------------------------------------------------------------------------
# Validation (metadata only)
# --------------------------------------------------------------------------------------------------


def _check_verify_inputs(
    parents: torch.Tensor, tokens: torch.Tensor, target_tokens: torch.Tensor
) -> None:
    named = {"parents": parents, "tokens": tokens, "target_tokens": target_tokens}
    for name, t in named.items():
        check_dtype(name, t, torch.int64)
        check_dim(name, t, 2, "[B, N]")
    check_num_nodes("parents.shape[1]", parents.shape[1])
    for name in ("tokens", "target_tokens"):
        t = named[name]
        if t.shape[0] != parents.shape[0]:
            raise ValueError(
                f"{name}: batch size {t.shape[0]} does not match parents' batch size {parents.shape[0]}"
            )
        if t.shape[1] != parents.shape[1]:
            raise ValueError(
                f"{name}: {t.shape[1]} nodes per tree, but parents has {parents.shape[1]}"
            )
    check_same_device(**named)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def _launch_verify_tree_greedy(
    parents: torch.Tensor,
    tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    accepted_path: torch.Tensor,
    accept_len: torch.Tensor,
    bonus: torch.Tensor,
    block_b: int | None = None,
) -> None:
    """Fill preallocated ``accepted_path [B, N]``, ``accept_len [B]``, ``bonus [B]`` (int64).

    ``block_b``: requests per program (a power of two; default ``requests_per_program``).
    """
    batch, num_nodes = parents.shape
    if batch == 0:
        return
    block_b = block_b or requests_per_program(batch)
    _verify_tree_greedy_kernel[(triton.cdiv(batch, block_b),)](
        parents,
        tokens,
        target_tokens,
        accepted_path,
        accept_len,
        bonus,
        batch,
        num_nodes,
        parents.stride(0),
        parents.stride(1),
        tokens.stride(0),
        tokens.stride(1),
        target_tokens.stride(0),
        target_tokens.stride(1),
        accepted_path.stride(0),
        accepted_path.stride(1),
        accept_len.stride(0),
        bonus.stride(0),
        BLOCK_B=block_b,
        BLOCK_N=MAX_NODES,
        num_warps=1 if block_b == 1 else 4,
    )


if HAS_TRITON:

    @triton.jit
    def _verify_tree_greedy_kernel(
        parents_ptr,
        tokens_ptr,
        target_ptr,
        path_ptr,
        accept_len_ptr,
        bonus_ptr,
        batch,
        num_nodes,
        stride_pb,
        stride_pn,
        stride_tb,
        stride_tn,
        stride_gb,
        stride_gn,
        stride_ab,
        stride_an,
        stride_lb,
        stride_bb,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # Each program walks BLOCK_B whole trees (on the GPU one: idea from SGLang's verify_tree_greedy
        # in sgl-kernel/csrc/speculative/eagle_utils.cu). Parents and tokens sit in registers; each step
        # picks, per tree, the lowest-index child of `cur` carrying cur's target token with one
        # min-reduction. Children have higher indices than parents, so N - 1 steps always finish the
        # walk; once a step finds no child, later steps find none either (cur is unchanged).
        reqs = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        nodes = tl.arange(0, BLOCK_N)[None, :]
        live_req = reqs < batch
        in_tree = live_req[:, None] & (nodes < num_nodes)
        parents = tl.load(
            parents_ptr + reqs[:, None] * stride_pb + nodes * stride_pn, mask=in_tree, other=-2
        )
        tokens = tl.load(tokens_ptr + reqs[:, None] * stride_tb + nodes * stride_tn, mask=in_tree)
        target_row = target_ptr + reqs * stride_gb

        path = tl.where(nodes == 0, 0, -1) + tl.zeros((BLOCK_B, BLOCK_N), tl.int64)
        cur = tl.zeros((BLOCK_B,), tl.int64)
        length = cur + 1
        for _ in range(1, num_nodes):
            want = tl.load(target_row + cur * stride_gn, mask=live_req, other=0)
            hit = in_tree & (parents == cur[:, None]) & (tokens == want[:, None])
            child = tl.min(tl.where(hit, nodes, BLOCK_N), axis=1).to(tl.int64)
            found = child < BLOCK_N
            path = tl.where((nodes == length[:, None]) & found[:, None], child[:, None], path)
            cur = tl.where(found, child, cur)
            length = length + found.to(tl.int64)
        bonus = tl.load(target_row + cur * stride_gn, mask=live_req, other=0)
        tl.store(path_ptr + reqs[:, None] * stride_ab + nodes * stride_an, path, mask=in_tree)
        tl.store(accept_len_ptr + reqs * stride_lb, length, mask=live_req)
        tl.store(bonus_ptr + reqs * stride_bb, bonus, mask=live_req)


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle)
# --------------------------------------------------------------------------------------------------


def verify_tree_greedy_reference(
    parents: torch.Tensor, tokens: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch greedy tree walk, vectorised over the batch; same contract as the op."""
    batch, num_nodes = parents.shape
    device = parents.device
    nodes = torch.arange(num_nodes, device=device).expand(batch, num_nodes)
    accepted_path = torch.full((batch, num_nodes), PATH_PADDING, dtype=torch.int64, device=device)
    accepted_path[:, 0] = 0
    cur = torch.zeros((batch, 1), dtype=torch.int64, device=device)
    accept_len = torch.ones((batch, 1), dtype=torch.int64, device=device)
    for _ in range(1, num_nodes):
        want = target_tokens.gather(1, cur)
        hit = (parents == cur) & (tokens == want)
        child = torch.where(hit, nodes, num_nodes).amin(dim=1, keepdim=True)
        found = child < num_nodes
        accepted_path = torch.where((nodes == accept_len) & found, child, accepted_path)
        cur = torch.where(found, child, cur)
        accept_len = accept_len + found.long()
    bonus = target_tokens.gather(1, cur).squeeze(1)
    return accepted_path, accept_len.squeeze(1), bonus
