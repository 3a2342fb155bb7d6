"""TreeSpec: the verify tree's bound metadata buffers and the two position shifts.

Node i of a request's verify window has RoPE position ``vc + depth[i]`` and KV slot ``window_start + i``:
only positions change for a tree. ``load_step`` shifts the window's positions ``vc + i -> vc + depth``
before the verify forward; ``compact_rows`` moves the accepted path's hidden rows to the front and shifts
positions back to ``vc + i`` after it (row i then holds the path node at depth i). The two shifts cancel
for any depth buffer, and a fresh TreeSpec holds the chain (``parents[i] = i - 1``, ``depth[i] = i``), so a
graph warm-up that replays the forward without step prep still sees a chain.

Buffers, all ``[B, N]`` int64 and bound once (fixed addresses, written in place, so captured graphs read
them): ``parents``, ``depth``, ``ancestor_mask`` (bit j of node i set when j is an ancestor of i or i
itself), ``positions``. Methods are fixed-shape torch on the buffers' device: no host syncs.
"""

from __future__ import annotations

import logging

import torch

from treecompile.ops._common import MAX_NODES, check_dim, check_dtype, check_same_device

logger = logging.getLogger(__name__)

__all__ = ["TreeSpec", "chain_ancestor_mask"]


def chain_ancestor_mask(num_nodes: int, device=None) -> torch.Tensor:
    """``[N]`` int64 ancestor masks of the chain: node i has bits 0..i (node 63's word is -1)."""
    words = []
    for i in range(num_nodes):
        word = (1 << (i + 1)) - 1
        words.append(word - (1 << 64) if word >= 1 << 63 else word)  # two's complement int64
    return torch.tensor(words, dtype=torch.int64, device=device)


class TreeSpec:
    """Bound tree metadata for B requests of N verify nodes.

    Parameters
    ----------
    batch_size : int
        B >= 1.
    num_nodes : int
        N, 1 .. 64.
    device : torch.device or str, optional

    Attributes
    ----------
    parents, depth, ancestor_mask : [B, N] int64
        The verify tree, initialised to the chain.
    positions : [B, N] int64
        RoPE positions of the verify window, initialised to the chain at ``vc = 0``.
    """

    def __init__(self, batch_size: int, num_nodes: int, device=None):
        for name, value in (("batch_size", batch_size), ("num_nodes", num_nodes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected a Python int, got {type(value).__name__}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if num_nodes < 1 or num_nodes > MAX_NODES:
            raise ValueError(f"num_nodes: the tree must have 1..{MAX_NODES} nodes, got {num_nodes}")
        self.batch_size = batch_size
        self.num_nodes = num_nodes
        B, N = batch_size, num_nodes
        self._node = torch.arange(N, dtype=torch.int64, device=device)  # [N], 0..N-1
        self._chain_parents = self._node - 1
        self._chain_mask = chain_ancestor_mask(N, device=device)
        self.parents = self._chain_parents.expand(B, N).clone()
        self.depth = self._node.expand(B, N).clone()
        self.ancestor_mask = self._chain_mask.expand(B, N).clone()
        self.positions = self._node.expand(B, N).clone()

    @property
    def device(self) -> torch.device:
        return self.parents.device

    def __repr__(self) -> str:
        return f"TreeSpec(batch_size={self.batch_size}, num_nodes={self.num_nodes}, device={self.device})"

    def _check_rows(self, name: str, t: torch.Tensor) -> None:
        """``t`` must be a ``[B, N]`` int64 tensor on this spec's device."""
        check_dim(name, t, 2, "[B, N]")
        check_dtype(name, t, torch.int64)
        if tuple(t.shape) != (self.batch_size, self.num_nodes):
            raise ValueError(
                f"{name}: expected [B={self.batch_size}, N={self.num_nodes}], got {tuple(t.shape)}"
            )
        check_same_device(**{name: t, "spec": self.parents})

    def _check_batch(self, name: str, t: torch.Tensor) -> None:
        """``t`` must be a ``[B]`` int64 tensor on this spec's device."""
        check_dim(name, t, 1, "[B]")
        check_dtype(name, t, torch.int64)
        if t.shape[0] != self.batch_size:
            raise ValueError(f"{name}: expected [B={self.batch_size}], got {tuple(t.shape)}")
        check_same_device(**{name: t, "spec": self.parents})

    def set_tree(self, tree) -> None:
        """Copy a selected tree (a :class:`~treecompile.draft_tree.TreeBatch`) into the bound buffers.

        Parameters
        ----------
        tree : TreeBatch with ``parents``, ``depth``, ``ancestor_mask`` of shape [B, N] int64.
        """
        for name in ("parents", "depth", "ancestor_mask"):
            self._check_rows(f"tree.{name}", getattr(tree, name))
        self.parents.copy_(tree.parents)
        self.depth.copy_(tree.depth)
        self.ancestor_mask.copy_(tree.ancestor_mask)

    def reset_chain(self, rows: torch.Tensor | None = None) -> None:
        """Reset requests' trees to the chain (bootstrap, recovery); positions are left to ``load_step``.

        Parameters
        ----------
        rows : None (every request), a [B] bool mask, or an [R] int64 tensor of request indices.
        """
        B, N = self.batch_size, self.num_nodes
        chain = (self._chain_parents, self._node, self._chain_mask)
        buffers = (self.parents, self.depth, self.ancestor_mask)
        if rows is None:
            for buf, row in zip(buffers, chain):
                buf.copy_(row.expand(B, N))
            return
        check_same_device(rows=rows, spec=self.parents)
        if rows.dtype == torch.bool:
            check_dim("rows", rows, 1, "[B] bool")
            if rows.shape[0] != B:
                raise ValueError(f"rows: expected a [B={B}] bool mask, got {tuple(rows.shape)}")
            for buf, row in zip(buffers, chain):
                buf.copy_(torch.where(rows.unsqueeze(1), row, buf))
        elif rows.dtype == torch.int64:
            check_dim("rows", rows, 1, "[R] int64 request indices")
            for buf, row in zip(buffers, chain):
                buf.index_copy_(0, rows, row.expand(rows.shape[0], N))
        else:
            raise ValueError(f"rows: expected a bool mask or int64 indices, got {rows.dtype}")

    def load_step(self, vc: torch.Tensor) -> torch.Tensor:
        """Positions ``vc + depth`` for the verify forward, written into the bound ``positions``.

        Parameters
        ----------
        vc : [B] int64, each request's committed length (the root's position).

        Returns
        -------
        ``positions``, the bound [B, N] int64 buffer.
        """
        self._check_batch("vc", vc)
        torch.add(vc.unsqueeze(1), self.depth, out=self.positions)
        return self.positions

    def compact_rows(
        self,
        hidden: torch.Tensor,
        accepted_path: torch.Tensor,
        accept_len: torch.Tensor,
        vc: torch.Tensor,
    ) -> None:
        """Move the accepted path's hidden rows to the front, in place, and positions back to ``vc + i``.

        Parameters
        ----------
        hidden : [B, N, H], modified in place: row i < accept_len becomes old row ``accepted_path[i]``;
            rows past accept_len keep their values.
        accepted_path : [B, N] int64 node indices, root first; entries past accept_len are padding (-1).
        accept_len : [B] int64, 1 .. N (counts the root).
        vc : [B] int64, the same committed lengths ``load_step`` was given.
        """
        B, N = self.batch_size, self.num_nodes
        check_dim("hidden", hidden, 3, "[B, N, H]")
        if tuple(hidden.shape[:2]) != (B, N):
            raise ValueError(f"hidden: expected [B={B}, N={N}, H], got {tuple(hidden.shape)}")
        check_same_device(hidden=hidden, spec=self.parents)
        self._check_rows("accepted_path", accepted_path)
        self._check_batch("accept_len", accept_len)
        self._check_batch("vc", vc)

        # Gather everything before writing, so overlapping source/destination rows are safe; padding and
        # rows past accept_len read a clamped in-range row and are masked out.
        src = accepted_path.clamp(0, N - 1)
        moved = hidden.gather(1, src.unsqueeze(2).expand(B, N, hidden.shape[2]))
        keep = (self._node < accept_len.unsqueeze(1)).unsqueeze(2)
        hidden.copy_(torch.where(keep, moved, hidden))
        torch.add(vc.unsqueeze(1), self._node, out=self.positions)
