"""Opt-in (``TREECOMPILE_WEIGHT_PREFETCH=1`` or ``=end``): each attention call prefetches the weight of the
projection that consumes it into L2, so the GEMM after the attention starts from L2 instead of HBM.

Why: a batch-1 decode is a weight stream broken by latency-bound kernels. On the H200 an 8B layer's attention
over a 2k prefix takes ~7 us and reads ~8 MB, so HBM idles through it, and then the o projection streams its
33.5 MB from HBM (11.4 us a layer, 2.9 TB/s, against a copy rate of 4.3; thirty-first session's profile,
BENCHMARKS.md). ``tree_attention_paged_write(..., prefetch=W)`` has each stage-1 program prefetch its share
of W (``ops/tree_attention.py``), so W (which fits in L2) arrives while the attention runs. A prefetch never
changes a value.

History. The first version (thirty-sixth session) had every program issue one ``prefetch.global.L2`` a 128-byte
line, ~1000 a program before its own work, and it LOST on the H200 (thirty-seventh session, 8B ``bench
rounds``: decode 4.501 -> 4.572 ms, verify 5.10 -> 5.17-5.19, draft round 1.205 -> 1.221; the leading 16 MB only:
decode 4.541) and was removed. The likely cost was those instructions in front of a latency-bound kernel. This
version (fifty-sixth session) issues one sm_90 ``cp.async.bulk.prefetch.L2`` a program, which the copy engine
walks, at the start of the program (``=1``) or after its own loads (``=end``). Off until a GPU A/B shows a win.

The pass follows each ``tree_attention_paged_write`` node through shape-only steps (views, reshapes,
transposes, ``contiguous``) to the one linear that reads it (``aten.linear`` / ``F.linear`` or
``treespec::skinny_linear`` / ``skinny_linear_norm_out``) and passes that linear's weight as the call's ``prefetch``, when the weight is a
parameter or constant (a graph input or ``get_attr``) on the attention's device. CUDA graphs only (the CPU
path ignores the hint). ``(gm, settings) -> gm``; runs after :mod:`.skinny_linears`.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from treecompile.ops._common import WEIGHT_PREFETCH_ENV as ENV
from treecompile.ops._common import weight_prefetch_enabled as enabled

from .fuse_projections import _linear_args
from ._graph import node_value as _value

__all__ = ["prefetch_weights", "enabled", "ENV"]

logger = logging.getLogger(__name__)

_DEVICE_TYPES = ("cuda",)  # where the hint does anything (tests on a CPU-only machine add "cpu")
_SHAPE_METHODS = {"view", "reshape", "contiguous", "transpose", "permute", "flatten"}
_SHAPE_FUNCTIONS = {torch.reshape, torch.transpose, torch.permute, torch.flatten}
_SKINNY_OPS = (torch.ops.treespec.skinny_linear.default, torch.ops.treespec.skinny_linear_norm_out.default)
_MAX_STEPS = 8  # shape steps between an attention and its projection (HF: transpose, reshape, contiguous)


def _is_shape_step(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    return node.op == "call_function" and node.target in _SHAPE_FUNCTIONS


def _consumer_weight(attn: torch.fx.Node) -> torch.fx.Node | None:
    """The weight node of the one linear that reads ``attn``'s output through shape steps, else None."""
    node = attn
    for _ in range(_MAX_STEPS):
        users = list(node.users)
        if len(users) != 1:
            return None
        user = users[0]
        if user.op == "call_function" and user.target in _SKINNY_OPS:
            return user.args[1] if user.args[0] is node else None
        args = _linear_args(user)
        if args is not None:
            return args[1] if args[0] is node else None
        if not _is_shape_step(user) or user.args[0] is not node:
            return None
        node = user
    return None


def _weight_value(gm: torch.fx.GraphModule, weight) -> torch.Tensor | None:
    if not isinstance(weight, torch.fx.Node) or weight.op not in ("get_attr", "placeholder"):
        return None  # computed in the graph (maybe by the kernel just before): not a constant to hint
    return _value(gm, weight)


def prefetch_weights(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    device = getattr(binding, "device", None)
    if not enabled() or device is None or device.type not in _DEVICE_TYPES:
        return gm
    graph = gm.graph
    attn_op = torch.ops.treespec.tree_attention_paged_write.default
    count = 0
    for attn in list(graph.nodes):
        if attn.op != "call_function" or attn.target is not attn_op or "prefetch" in attn.kwargs or len(attn.args) > 13:
            continue
        weight = _consumer_weight(attn)
        value = _weight_value(gm, weight)
        if value is None or value.device.type != device.type or not value.is_contiguous():
            continue  # (the rewritten q carries no example value: the binding's device stands for it)
        if weight.op == "get_attr":  # a get_attr may sit after the attention (the fused weights'): a fresh one
            with graph.inserting_before(attn):
                weight = graph.get_attr(weight.target)
        attn.kwargs = {**attn.kwargs, "prefetch": weight}
        count += 1
    if count:
        graph.lint()
        gm.recompile()
        logger.info("prefetch_weights: %d attention call(s) hint their projection's weight into L2", count)
    return gm
