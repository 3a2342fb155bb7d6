"""DraftTree: records a drafter's scored candidates and selects the verify tree.

The drafter scores, the tree selects: a drafter hands over (log-prob, token) pairs and never decides the
tree's shape. One round, for a batch of B requests, K lanes, S draft steps and N <= 64 tree nodes:

- ``begin(logp0 [B, K], tokens0 [B, K])`` records step 0: K candidates, children of the root (node 0, the
  request's current token), depth 1, candidate ids ``0 .. K-1``. It returns the lanes of step 1: the K
  step-0 candidates, best first.
- ``expand(lanes, child_logp [B, K, K], child_tokens [B, K, K])`` records step ``s = lanes.step``
  (1 .. S-1): lane r's child c is candidate ``K + (s-1)*K*K + r*K + c`` at depth ``s + 1``. It returns the
  lanes of step s+1: the K best of those K*K children.
- ``select(root_tokens [B])`` keeps the best N-1 of the ``K + (S-1)*K*K`` candidates and numbers them
  depth first, best child first, into a :class:`TreeBatch` of ``[B, N]`` tensors.

Scores are cumulative log-probs: a child's score is its parent's plus ``min(child_logp, 0)``, so a child
never beats its parent. Every ranking here orders by score (higher first), ties to the lower candidate
id, NaN last (padded requests carry NaN scores and must still yield a fully written tree). Because a
parent's id is always lower than its children's, that order puts every parent before its children, with
equal scores and NaNs too (a NaN-free child has a NaN-free parent), so the best N-1 are closed under
parents: the kept set is a tree.

Lane r of step s writes draft slot ``(s-1)*K + r`` of the lane window (``W_lane = (S-1)*K`` slots) at
position ``vc + s``; its lane mask has its own bit and the bits of the lanes it descends from.

Everything per round is fixed-shape torch on the inputs' device: no ``.item()``, no data-dependent shapes,
no Python branching on tensor values, so rounds run inside CUDA graphs and ``torch.compile(fullgraph=True)``.
Config ints are validated once, in ``__init__``; per-round methods check only metadata. The tensor work of
each method is a pure function of tensors (``_begin_core``, ``_expand_core``, ``_select_core``; every
step-dependent constant comes in as a tensor), so ``DraftTree(..., inductor=True)`` compiles each once per
batch size: eager, a round's ranking and numbering is ~100 small kernels (sorts, gathers, masks), which on
a CUDA-graph replay cost more than a small drafter's own forward.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from treecompile.compiling import batch_key, compile_inference
from treecompile.ops._common import MAX_NODES, check_dim, check_dtype, check_same_device
from treecompile.ops.expand_lanes import expand_lanes_reference
from treecompile.ops.select_tree import _bit, ascending_unique, rank_order, select_tree_reference

logger = logging.getLogger(__name__)

__all__ = ["DraftTree", "LaneState", "TreeBatch", "ascending_unique", "rank_order"]

PAIRWISE_RANK_ENV = "TREECOMPILE_PAIRWISE_RANK"
TREE_KERNELS_ENV = "TREECOMPILE_TREE_KERNELS"


@dataclass
class LaneState:
    """The K lanes a draft step runs, per request.

    Attributes
    ----------
    tokens : [B, K] int64
        Input token of each lane (a candidate of the previous step).
    scores : [B, K] float32 (float64 when the drafter scores in float64)
        Cumulative log-prob of each lane's token.
    mask : [B, K] int64
        Lane ancestor mask over the lane window: bit ``(step-1)*K + r`` (the lane's own draft slot) and the
        bits of the lanes it descends from at steps ``1 .. step-1``. After the last expand
        (``step == S``) the lanes are not run and carry no own bit.
    candidate : [B, K] int64
        Candidate id of each lane's token.
    parent_lane : [B, K] int64
        Row of the previous draft forward that produced each lane's token, i.e. whose hidden state the lane
        continues: 0 for step 1 (the single step-0 row), the parent lane index for later steps.
        (Addition to the brief's API: a drafter needs it to gather the lanes' hidden states.)
    step : int
        The draft step these lanes run at (1 .. S-1; S after the last expand). Lane positions are
        ``vc + step``.
    """

    tokens: torch.Tensor
    scores: torch.Tensor
    mask: torch.Tensor
    candidate: torch.Tensor
    parent_lane: torch.Tensor
    step: int


@dataclass
class TreeBatch:
    """A selected verify tree per request, nodes numbered depth first, best child first.

    Attributes
    ----------
    tokens : [B, N] int64
        Node 0 is the root token (the request's current token).
    parents : [B, N] int64
        Parent node index; ``parents[:, 0] == -1`` and ``parents[:, i] < i``.
    depth : [B, N] int64
        Depth of each node (root 0); RoPE position of node i is ``vc + depth[:, i]``.
    ancestor_mask : [B, N] int64
        Bit j of node i's word is set when node j is an ancestor of node i or i itself.
    candidate : [B, N] int64
        Candidate id each node came from; -1 for the root.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    ancestor_mask: torch.Tensor
    candidate: torch.Tensor


def pairwise_rank_from_env() -> bool:
    """``TREECOMPILE_PAIRWISE_RANK``: "1" ranks by pairwise comparison, "0" or unset sorts."""
    raw = os.environ.get(PAIRWISE_RANK_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{PAIRWISE_RANK_ENV}={raw!r}: expected '0' (sort) or '1' (pairwise ranks)")
    return raw == "1"


# tree_kernels setting -> (expand_lanes op, select_tree op)
TREE_KERNEL_MODES = {"0": (False, False), "1": (True, True), "expand": (True, False), "select": (False, True)}


def tree_kernels_from_env() -> str:
    """``TREECOMPILE_TREE_KERNELS``: "1" runs each round's bookkeeping through the ``treespec::expand_lanes`` and
    ``treespec::select_tree`` ops (one kernel each on CUDA), "expand" or "select" through that one op only, "0"
    or unset through their torch references (sorts and gathers; the default: Inductor's kernels for them were
    faster on an H100). The one-op settings exist because the two ops measured apart differ (H100, forty-fifth
    session, ``tests/gpu/tree_ops_bench.py``, one launch in a CUDA graph: expand_lanes 2.37 us a step,
    select_tree 20.0 us against a round's torch bookkeeping of 31.4 us in all)."""
    value = os.environ.get(TREE_KERNELS_ENV, "").strip() or "0"
    if value not in TREE_KERNEL_MODES:
        raise ValueError(f"{TREE_KERNELS_ENV}: expected one of {', '.join(TREE_KERNEL_MODES)}, got {value!r}")
    return value


def _tree_kernel_mode(tree_kernels) -> tuple[bool, bool]:
    """``DraftTree(tree_kernels=...)`` -> (expand_lanes op, select_tree op)."""
    if tree_kernels is None:
        return TREE_KERNEL_MODES[tree_kernels_from_env()]
    if isinstance(tree_kernels, bool):
        return (tree_kernels, tree_kernels)
    if tree_kernels in ("expand", "select"):
        return TREE_KERNEL_MODES[tree_kernels]
    raise ValueError(f"tree_kernels: expected True, False, 'expand' or 'select', got {tree_kernels!r}")


def _expand_op(pairwise: bool, kernels: bool):
    if kernels:
        return torch.ops.treespec.expand_lanes
    return functools.partial(expand_lanes_reference, pairwise=pairwise)


def _begin_core(logp0: torch.Tensor, tokens0: torch.Tensor, own_bits: torch.Tensor, first_id: torch.Tensor,
                pairwise: bool = False, kernels: bool = False):  # fmt: skip
    """Step 0's record and step 1's lanes: the root's K children (``expand_lanes`` without lane tensors).
    ``own_bits [K]``: the lanes' own lane-window bits (zeros when no lane step runs); ``first_id`` 0-d int64
    zero. Returns (scores, tokens, parents, lane tokens, lane scores, mask, candidate)."""
    out = _expand_op(pairwise, kernels)(logp0.unsqueeze(1), tokens0.unsqueeze(1), own_bits, first_id)
    scores, parents, lane_tokens, lane_scores, mask, candidate, _ = out
    return scores, tokens0, parents, lane_tokens, lane_scores, mask, candidate


def _expand_core(lane_scores, lane_mask, lane_candidate, child_logp, child_tokens, own_bits, first_id,
                 pairwise: bool = False, kernels: bool = False):  # fmt: skip
    """One expand's record and the next lanes. ``own_bits [K]``: the next lanes' own bits (zeros after the
    last step); ``first_id`` 0-d int64: the step's first candidate id. Returns (scores, tokens, parents,
    lane tokens, lane scores, mask, candidate, parent lane)."""
    B, K = lane_scores.shape
    out = _expand_op(pairwise, kernels)(child_logp, child_tokens, own_bits, first_id, lane_scores, lane_mask,
                                        lane_candidate)  # fmt: skip
    scores, parents, lane_tokens, next_scores, mask, candidate, parent_lane = out
    return scores, child_tokens.reshape(B, K * K), parents, lane_tokens, next_scores, mask, candidate, parent_lane


def _select_core(scores: list, tokens: list, parents: list, root_tokens, K: int, N: int, pairwise: bool = False,
                 kernels: bool = False):  # fmt: skip
    """The best N-1 of the recorded candidates, numbered depth first, best child first (select()): the
    ``treespec::select_tree`` op (one kernel on CUDA) or its torch reference (two sorts)."""
    candidates = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
    if kernels:
        return torch.ops.treespec.select_tree(*candidates, root_tokens, K, N)
    return select_tree_reference(*candidates, root_tokens, K, N, pairwise)


class DraftTree:
    """Records K + (S-1)*K*K scored candidates per request and selects the N-node verify tree.

    Parameters
    ----------
    topk : int
        K, candidates per step and lanes per draft step (>= 1). K == 1 gives the chain.
    steps : int
        S, draft steps including step 0 (>= 1); steps 1 .. S-1 run K lanes each.
    num_nodes : int
        N, verify tree nodes including the root (1 .. 64), with ``(S-1)*K <= N`` (the lane window fits the
        next verify window) and ``N-1 <= K + (S-1)*K*K`` (the candidates can fill the tree).

    Attributes
    ----------
    num_candidates : int
        ``K + (S-1)*K*K``.
    lane_window : int
        ``(S-1)*K``, lane-window slots (bits of the lane masks).
    inductor : bool
        Compile the per-round tensor work with Inductor (module docstring); default False (eager).
    pairwise_rank : bool
        Rank candidates by pairwise comparison instead of sorting (:func:`ascending_unique`; same trees).
        Default from ``TREECOMPILE_PAIRWISE_RANK`` ("1" on; off unless set), for A/B runs on the GPU.
    tree_kernels : bool or "expand" or "select"
        Record each step and select the tree with the ``treespec::expand_lanes`` and ``treespec::select_tree``
        ops (:mod:`treecompile.ops.expand_lanes`, :mod:`treecompile.ops.select_tree`: on CUDA one kernel a
        step and one for the selection, in place of ~2 a step and ~10; the same lanes and trees) instead of
        their torch references; "expand" or "select": that op only. Default from ``TREECOMPILE_TREE_KERNELS``
        (:func:`tree_kernels_from_env`; off unless set: on an H100 both together took 35.1 us a round where
        Inductor's kernels take 31.1, forty-fourth session). Read back as ``expand_kernel`` / ``select_kernel``.
    """

    def __init__(self, topk: int, steps: int, num_nodes: int, *, inductor: bool = False,
                 pairwise_rank: bool | None = None, tree_kernels: bool | str | None = None):  # fmt: skip
        for name, value in (("topk", topk), ("steps", steps), ("num_nodes", num_nodes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected a Python int, got {type(value).__name__}")
        if topk < 1:
            raise ValueError(f"topk: must be >= 1, got {topk}")
        if steps < 1:
            raise ValueError(f"steps: must be >= 1, got {steps}")
        if num_nodes < 1 or num_nodes > MAX_NODES:
            raise ValueError(f"num_nodes: the tree must have 1..{MAX_NODES} nodes, got {num_nodes}")
        lane_window = (steps - 1) * topk
        if lane_window > num_nodes:
            raise ValueError(
                f"steps, topk: the lane window (steps-1)*topk = {lane_window} must be <= num_nodes = "
                f"{num_nodes}"
            )
        num_candidates = topk + (steps - 1) * topk * topk
        if num_nodes - 1 > num_candidates:
            raise ValueError(
                f"num_nodes: num_nodes-1 = {num_nodes - 1} exceeds the {num_candidates} candidates "
                f"topk + (steps-1)*topk^2 can supply; the tree could not be filled"
            )
        self.topk = topk
        self.steps = steps
        self.num_nodes = num_nodes
        self.num_candidates = num_candidates
        self.lane_window = lane_window
        self.pairwise_rank = pairwise_rank_from_env() if pairwise_rank is None else bool(pairwise_rank)
        self.expand_kernel, self.select_kernel = _tree_kernel_mode(tree_kernels)
        # Per-step records, in candidate-id order; rebuilt by every begin().
        self._scores: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []
        self._parents: list[torch.Tensor] = []  # parent candidate id, -1 for the root
        self._next_step = 0  # 0: begin() not called yet
        self._consts: dict[torch.device, tuple] = {}
        self.inductor = bool(inductor)
        if self.inductor:
            tag = f"{id(self):x}"
            self._begin_fn, self._expand_fn, self._select_fn = (
                compile_inference(f, f"{f.__name__}_{tag}", key=batch_key, fullgraph=True)
                for f in (_begin_core, _expand_core, _select_core)
            )  # fmt: skip
        else:
            self._begin_fn, self._expand_fn, self._select_fn = _begin_core, _expand_core, _select_core

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-device step tables, built once: ``own_bits [S, K]`` (row s: the bits of the lanes that run
        step s + 1, zeros for the last row) and ``first_ids [S]`` (step s's first candidate id)."""
        consts = self._consts.get(device)
        if consts is None:  # built on the device from aranges: no host-to-device copy (a sync) in a round
            K, S = self.topk, self.steps
            slots = torch.arange(S * K, dtype=torch.int64, device=device).view(S, K)
            own_bits = torch.where(slots < (S - 1) * K, _bit(slots), 0)
            step = torch.arange(S, dtype=torch.int64, device=device)
            first_ids = torch.where(step == 0, 0, K + (step - 1) * K * K)
            consts = self._consts[device] = (own_bits, first_ids)
        return consts

    def __repr__(self) -> str:
        return f"DraftTree(topk={self.topk}, steps={self.steps}, num_nodes={self.num_nodes})"

    # -- recording -------------------------------------------------------------------------------------

    def begin(self, logp0: torch.Tensor, tokens0: torch.Tensor) -> LaneState:
        """Record step 0 and return the lanes of step 1.

        Parameters
        ----------
        logp0 : [B, K] floating, log-probs of the step-0 candidates (children of the root).
        tokens0 : [B, K] int64.

        Returns
        -------
        LaneState with ``step == 1``: the K step-0 candidates ordered best first.
        """
        K = self.topk
        check_dim("logp0", logp0, 2, "[B, K]")
        check_dim("tokens0", tokens0, 2, "[B, K]")
        if not logp0.dtype.is_floating_point:
            raise ValueError(f"logp0: expected a floating dtype, got {logp0.dtype}")
        check_dtype("tokens0", tokens0, torch.int64)
        check_same_device(logp0=logp0, tokens0=tokens0)
        if logp0.shape[1] != K:
            raise ValueError(f"logp0: expected [B, topk={K}], got {tuple(logp0.shape)}")
        if tokens0.shape != logp0.shape:
            raise ValueError(
                f"tokens0: expected shape {tuple(logp0.shape)} like logp0, got {tuple(tokens0.shape)}"
            )

        own_bits, first_ids = self._constants(logp0.device)
        scores, tokens, parents, lane_tokens, lane_scores, mask, order = self._begin_fn(
            logp0, tokens0, own_bits[0], first_ids[0], self.pairwise_rank, self.expand_kernel)
        self._scores, self._tokens, self._parents = [scores], [tokens], [parents]
        self._next_step = 1
        return LaneState(tokens=lane_tokens, scores=lane_scores, mask=mask, candidate=order,
                         parent_lane=torch.zeros_like(order), step=1)  # fmt: skip

    def expand(self, lanes: LaneState, child_logp: torch.Tensor, child_tokens: torch.Tensor) -> LaneState:
        """Record the K*K candidates of step ``lanes.step`` and return the lanes of the next step.

        Parameters
        ----------
        lanes : LaneState of step s (1 .. S-1), as returned by begin() or the previous expand().
        child_logp : [B, K, K] floating, ``child_logp[b, r, c]`` is the log-prob of lane r's child c.
        child_tokens : [B, K, K] int64.

        Returns
        -------
        LaneState of step s+1: the K best children, best first.
        """
        K = self.topk
        s = lanes.step
        if self._next_step == 0:
            raise ValueError("expand: call begin() first")
        if s != self._next_step or s >= self.steps:
            raise ValueError(
                f"lanes.step: expected step {self._next_step} (steps 1..{self.steps - 1} expand), got {s}"
            )
        B = self._scores[0].shape[0]
        check_dim("child_logp", child_logp, 3, "[B, K, K]")
        check_dim("child_tokens", child_tokens, 3, "[B, K, K]")
        if not child_logp.dtype.is_floating_point:
            raise ValueError(f"child_logp: expected a floating dtype, got {child_logp.dtype}")
        check_dtype("child_tokens", child_tokens, torch.int64)
        check_same_device(child_logp=child_logp, child_tokens=child_tokens, lane_scores=lanes.scores)
        if tuple(child_logp.shape) != (B, K, K):
            raise ValueError(
                f"child_logp: expected [B={B}, topk={K}, topk={K}], got {tuple(child_logp.shape)}"
            )
        if child_tokens.shape != child_logp.shape:
            raise ValueError(
                f"child_tokens: expected shape {tuple(child_logp.shape)} like child_logp, got "
                f"{tuple(child_tokens.shape)}"
            )

        # Lanes that will run step s + 1 own slot s*K + r of the lane window (no bits after the last step).
        own_bits, first_ids = self._constants(child_logp.device)
        scores, tokens, parents, lane_tokens, lane_scores, mask, candidate, parent_lane = self._expand_fn(
            lanes.scores, lanes.mask, lanes.candidate, child_logp, child_tokens, own_bits[s], first_ids[s],
            self.pairwise_rank, self.expand_kernel)
        self._scores.append(scores)
        self._tokens.append(tokens)
        self._parents.append(parents)
        self._next_step = s + 1
        return LaneState(tokens=lane_tokens, scores=lane_scores, mask=mask, candidate=candidate,
                         parent_lane=parent_lane, step=s + 1)  # fmt: skip

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The candidates recorded so far this round, in candidate-id order (addition to the brief's API).

        Returns
        -------
        scores : [B, C'] cumulative log-probs (clamped, as ranked)
        tokens : [B, C'] int64
        parents : [B, C'] int64 parent candidate ids, -1 for children of the root
            ``C' = K + (steps recorded - 1) * K * K``; ``C' = num_candidates`` once every step is recorded.
        """
        if self._next_step == 0:
            raise ValueError("candidates: call begin() first")
        return torch.cat(self._scores, 1), torch.cat(self._tokens, 1), torch.cat(self._parents, 1)

    # -- selection -------------------------------------------------------------------------------------

    def select(self, root_tokens: torch.Tensor) -> TreeBatch:
        """Keep the best N-1 candidates and number the tree depth first, best child first.

        Parameters
        ----------
        root_tokens : [B] int64 (any strides), the token of node 0.

        Returns
        -------
        TreeBatch of fresh ``[B, N]`` int64 tensors.
        """
        if self._next_step != self.steps:
            raise ValueError(
                f"select: needs begin() and {self.steps - 1} expand() calls this round "
                f"(recorded {max(self._next_step - 1, 0)} expands{'' if self._next_step else ', no begin'})"
            )
        B = self._scores[0].shape[0]
        check_dim("root_tokens", root_tokens, 1, "[B]")
        check_dtype("root_tokens", root_tokens, torch.int64)
        check_same_device(root_tokens=root_tokens, scores=self._scores[0])
        if root_tokens.shape[0] != B:
            raise ValueError(f"root_tokens: expected [B={B}], got {tuple(root_tokens.shape)}")

        tokens, parents, depth, ancestor_mask, candidate = self._select_fn(
            self._scores, self._tokens, self._parents, root_tokens, self.topk, self.num_nodes, self.pairwise_rank,
            self.select_kernel)
        return TreeBatch(tokens=tokens, parents=parents, depth=depth, ancestor_mask=ancestor_mask,
                         candidate=candidate)  # fmt: skip
