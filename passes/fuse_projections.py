"""Fuse each decoder layer's sibling projections (q/k/v, gate/up) into one linear call.

Runs only when the binding carries fused projection groups (``TargetBinding(fuse_projections=True)``; the
weights were laid out by :func:`treecompile.projections.fuse_projection_weights`, members' parameters are
views of one ``[sum(out), in]`` tensor). For every group whose member linears all appear in the graph on
the same input, the pass replaces them by::

    fused = linear(x, <fused weight>, <fused bias>)      # get_attr: the group's storage, no copy
    q, k, v = split(fused, sizes, dim=-1)

Members are found by the ``nn_module_stack`` path of their linear call (``L['model'].model.layers.0.
self_attn.q_proj`` -> ``model.layers.0.self_attn.q_proj``). A group with a member missing, on another input,
or called twice is left exactly as it was (correct either way, only slower). Pure layout: the values are
the same GEMM over the same rows, so the per-path references and HF greedy equality hold unchanged.
"""

from __future__ import annotations

import logging
import operator
import re

import torch
import torch.fx

from ._graph import module_stack, register_constant

logger = logging.getLogger(__name__)

_PREFIX = "_treespec_fused_"
_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
_ROOT = re.compile(r"^L(\[[^\]]*\])+\.")  # Dynamo's root of a module path: L['model'].  or  L['args'][0].


def _linear_args(node: torch.fx.Node):
    """(input, weight, bias) of a linear call, or None when it is not one we can fuse."""
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    names = ("input", "weight", "bias")
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    if set(bound) - set(names) or "input" not in bound or "weight" not in bound:
        return None
    return bound["input"], bound["weight"], bound.get("bias")


def _module_name(node: torch.fx.Node) -> str | None:
    stack = module_stack(node)
    return _ROOT.sub("", stack[-1][0]) if stack else None


def fuse_projections(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    groups = getattr(binding, "projection_groups", None) or []
    if not groups:
        return gm
    graph = gm.graph
    by_name: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if _linear_args(node) is not None:
            name = _module_name(node)
            if name is not None:
                by_name.setdefault(name, []).append(node)

    order = {n: i for i, n in enumerate(graph.nodes)}  # original nodes only: members are looked up in it
    fused = 0
    for j, group in enumerate(groups):
        calls = [by_name.get(name, []) for name in group.member_names()]
        if not all(len(c) == 1 for c in calls):
            continue  # a member missing (another graph's layer) or called twice: leave the group alone
        nodes = [c[0] for c in calls]
        args = [_linear_args(n) for n in nodes]
        inputs = {a[0] for a in args}
        has_bias = {a[2] is not None for a in args}
        if len(inputs) != 1 or has_bias != {group.bias is not None}:
            continue
        (x,) = inputs
        first = min(nodes, key=order.__getitem__)
        register_constant(gm, f"{_PREFIX}w{j}", group.weight)
        if group.bias is not None:
            register_constant(gm, f"{_PREFIX}b{j}", group.bias)
        with graph.inserting_before(first):
            weight = graph.get_attr(f"{_PREFIX}w{j}")
            bias = graph.get_attr(f"{_PREFIX}b{j}") if group.bias is not None else None
            out = graph.call_function(torch._C._nn.linear, (x, weight, bias))
            parts = graph.call_function(torch.split, (out, list(group.sizes)), {"dim": -1})
            out.meta["nn_module_stack"] = dict(first.meta.get("nn_module_stack") or {})
            for i, node in enumerate(nodes):
                piece = graph.call_function(operator.getitem, (parts, i))
                piece.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "nn_module_stack")})
                node.replace_all_uses_with(piece)
        for node in nodes:
            graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
        logger.info("fuse_projections: %d projection group(s) -> one linear each", fused)
    return gm
