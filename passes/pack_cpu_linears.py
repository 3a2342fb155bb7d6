"""Run the target's float32 CPU linears on oneDNN-packed weights (:func:`treecompile.packed_linear.packed_linear`).

Runs only when the binding asks for it (``TargetBinding(packed_linears=True)``; ``TreeSpeculator`` turns it
on for float32 CPU targets) and the graph runs eagerly (Inductor does its own CPU weight prepacking). Every
``linear(x, w, b)`` call whose weight is a float32 CPU tensor becomes ``packed_linear(x, w, b)``, which runs
on a packed copy of ``w`` that is re-packed when the weight changes. The weight stays a graph input, so the
user's parameters are still what the graph reads; fused projection weights (get_attr) are packed the same
way. Values are the same GEMM in another kernel (float32 rounding may differ in the last bits, as between any
two GEMM libraries).
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from treecompile.packed_linear import can_pack, packed_linear

from .fuse_projections import _linear_args

logger = logging.getLogger(__name__)


def _packable(gm: torch.fx.GraphModule, weight) -> bool:
    if not isinstance(weight, torch.fx.Node):
        return False
    value = getattr(gm, weight.target, None) if weight.op == "get_attr" else weight.meta.get("example_value")
    return isinstance(value, torch.Tensor) and can_pack(value)


def pack_cpu_linears(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    if not getattr(binding, "packed_linears", False) or getattr(settings, "inductor", False):
        return gm
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        args = _linear_args(node)
        if args is None:
            continue
        x, weight, bias = args
        if not _packable(gm, weight):
            continue
        with graph.inserting_before(node):
            packed = graph.call_function(packed_linear, (x, weight, bias))
        packed.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "nn_module_stack")})
        node.replace_all_uses_with(packed)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
        logger.info("pack_cpu_linears: %d linear(s) -> oneDNN-packed weights", count)
    return gm
