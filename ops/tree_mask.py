"""Ancestor masks and depths of draft trees.

A draft tree of N <= 64 nodes is given by its parent array; node 0 is the root (already committed) and
every other node's parent has a lower index (topological order), so one forward pass over the nodes
sees each parent before its children.

Shapes
------
parents        int64 [B, N]   ``parents[b, 0] == -1``, ``0 <= parents[b, i] < i`` for i > 0
ancestor_mask  int64 [B, N]   bit j of word i is set when node j is node i or one of its ancestors;
                              bit 63 is the int64 sign bit (node 63 of a 64-node tree), so a word may
                              be negative. A chain's node i holds ``(1 << (i + 1)) - 1``.
depth          int64 [B, N]   edges from the root; the root has depth 0.

``torch.ops.treespec.build_ancestor_mask(parents) -> (ancestor_mask, depth)`` checks only metadata
(shape, dtype, N <= 64) so it is safe inside captured regions. Whether ``parents`` really is a tree is a
value check: run :func:`validate_parents` once on the host, outside capture. On parents that are not a
tree the op still touches no memory out of bounds, but its output is unspecified.
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
    triton_interpret,
    use_triton,
    values_checkable,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = ["build_ancestor_mask", "build_ancestor_mask_reference", "validate_parents"]


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::build_ancestor_mask", mutates_args=())
def build_ancestor_mask(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor mask and depth of each node of B trees: ``parents [B, N] -> ([B, N], [B, N])`` int64."""
    _check_parents_meta(parents, "parents")
    if values_checkable(parents):
        validate_parents(parents)
    if use_triton(parents):
        ancestor_mask = torch.empty_like(parents, memory_format=torch.contiguous_format)
        depth = torch.empty_like(parents, memory_format=torch.contiguous_format)
        _launch_build_ancestor_mask(parents, ancestor_mask, depth)
        return ancestor_mask, depth
    return build_ancestor_mask_reference(parents)


@build_ancestor_mask.register_fake
def _(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_parents_meta(parents, "parents")
    return parents.new_empty(parents.shape), parents.new_empty(parents.shape)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _check_parents_meta(parents: torch.Tensor, name: str) -> None:
    """Metadata-only checks (no host sync)."""
    check_dtype(name, parents, torch.int64)
    check_dim(name, parents, 2, "[B, N]")
    check_num_nodes(f"{name}.shape[1]", parents.shape[1])


def validate_parents(parents: torch.Tensor, name: str = "parents") -> None:
    """Raise ValueError unless every row of ``parents [B, N]`` describes a tree in topological order.

    Reads tensor values (one device-to-host copy), so call it once outside any captured region. Checks:
    int64, 2-d, 1 <= N <= 64, ``parents[b, 0] == -1`` and ``0 <= parents[b, i] < i`` for i > 0 (the last
    rule also rules out cycles and self-loops).
    """
    _check_parents_meta(parents, name)
    if parents.numel() == 0:
        return
    values = parents.detach().cpu()
    roots = values[:, 0]
    bad_root = (roots != -1).nonzero()
    if bad_root.numel():
        b = int(bad_root[0, 0])
        raise ValueError(f"{name}: the root's parent must be -1, got {name}[{b}, 0] = {int(roots[b])}")
    n = values.shape[1]
    index = torch.arange(n).expand_as(values)
    bad = ((values >= index) | (values < 0))[:, 1:].nonzero()
    if bad.numel():
        b, i = int(bad[0, 0]), int(bad[0, 1]) + 1
        raise ValueError(
            f"{name}: not a tree in topological order: need 0 <= {name}[b, i] < i for i >= 1, "
            f"got {name}[{b}, {i}] = {int(values[b, i])}"
        )


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def requests_per_program(batch: int, cap: int = 1024) -> int:
    """How many requests one program of the tree kernels handles (a power of two).

    On the GPU one request per program (a tree is tiny, latency comes from the node loop, and more
    programs fill more SMs). The CPU interpreter costs per operation, not per element, so there one
    program takes up to ``cap`` requests and runs each loop step for all of them at once.
    """
    if not triton_interpret():
        return 1
    return min(triton.next_power_of_2(max(batch, 1)), cap)


def _launch_build_ancestor_mask(
    parents: torch.Tensor,
    ancestor_mask: torch.Tensor,
    depth: torch.Tensor,
    block_b: int | None = None,
) -> None:
    """Fill preallocated ``ancestor_mask`` and ``depth`` ([B, N] int64, any strides) from ``parents``.

    ``block_b``: requests per program (a power of two; default :func:`requests_per_program`).
    """
    batch, num_nodes = parents.shape
    if batch == 0:
        return
    block_b = block_b or requests_per_program(batch)
    _build_ancestor_mask_kernel[(triton.cdiv(batch, block_b),)](
        parents,
        ancestor_mask,
        depth,
        batch,
        num_nodes,
        parents.stride(0),
        parents.stride(1),
        ancestor_mask.stride(0),
        ancestor_mask.stride(1),
        depth.stride(0),
        depth.stride(1),
        BLOCK_B=block_b,
        BLOCK_N=MAX_NODES,
        num_warps=1 if block_b == 1 else 4,
    )


if HAS_TRITON:

    @triton.jit
    def _build_ancestor_mask_kernel(
        parents_ptr,
        mask_ptr,
        depth_ptr,
        batch,
        num_nodes,
        stride_pb,
        stride_pn,
        stride_mb,
        stride_mn,
        stride_db,
        stride_dn,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # Each program owns BLOCK_B whole trees. Their [BLOCK_B, N <= 64] words live in registers and are
        # filled in node order, so a parent is final before any child reads it (idea from SGLang's
        # tree_ancestor_bitmask_kernel: word = parent's word | own bit). The parent's word and depth are
        # read by masked reductions over registers, not from memory: no store->load ordering inside the
        # program, and no out-of-bounds access even when parents is not a tree.
        reqs = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        nodes = tl.arange(0, BLOCK_N)[None, :]
        live_req = reqs < batch
        in_tree = live_req[:, None] & (nodes < num_nodes)
        # 64-bit shift on an int64 operand: node 63 sets the sign bit, as intended.
        own_bit = tl.full((1, BLOCK_N), 1, tl.int64) << nodes.to(tl.int64)
        words = tl.where(nodes == 0, own_bit, 0) + tl.zeros((BLOCK_B, BLOCK_N), tl.int64)
        depth = tl.zeros((BLOCK_B, BLOCK_N), tl.int64)
        for i in range(1, num_nodes):
            parent = tl.load(parents_ptr + reqs * stride_pb + i * stride_pn, mask=live_req, other=-1)
            is_parent = nodes == parent[:, None]
            parent_word = tl.sum(tl.where(is_parent, words, 0), axis=1)
            parent_depth = tl.sum(tl.where(is_parent, depth, 0), axis=1)
            words = tl.where(nodes == i, parent_word[:, None] | own_bit, words)
            depth = tl.where(nodes == i, parent_depth[:, None] + 1, depth)
        tl.store(mask_ptr + reqs[:, None] * stride_mb + nodes * stride_mn, words, mask=in_tree)
        tl.store(depth_ptr + reqs[:, None] * stride_db + nodes * stride_dn, depth, mask=in_tree)


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle)
# --------------------------------------------------------------------------------------------------


def _bit(i: int) -> int:
    """Bit i of an int64 word as a Python int in int64 range (bit 63 is the sign bit)."""
    return (1 << i) if i < 63 else -(1 << 63)


def build_ancestor_mask_reference(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch ancestor mask and depth: ``parents [B, N] -> (ancestor_mask, depth)``, int64 [B, N].

    Vectorised over the batch, sequential over nodes (topological order). On parents that are not a
    tree it reproduces the kernel bit for bit (a parent outside [0, N) or not yet visited contributes an
    empty word and depth 0), which keeps the two comparable on any input.
    """
    batch, num_nodes = parents.shape
    ancestor_mask = torch.zeros((batch, num_nodes), dtype=torch.int64, device=parents.device)
    depth = torch.zeros((batch, num_nodes), dtype=torch.int64, device=parents.device)
    if num_nodes == 0:
        return ancestor_mask, depth
    ancestor_mask[:, 0] = 1
    for i in range(1, num_nodes):
        parent = parents[:, i]
        known = (parent >= 0) & (parent < num_nodes)
        index = parent.clamp(0, num_nodes - 1).unsqueeze(1)
        parent_word = torch.where(known, ancestor_mask.gather(1, index).squeeze(1), 0)
        parent_depth = torch.where(known, depth.gather(1, index).squeeze(1), 0)
        ancestor_mask[:, i] = parent_word | _bit(i)
        depth[:, i] = parent_depth + 1
    return ancestor_mask, depth
