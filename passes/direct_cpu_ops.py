"""On an eager CPU graph, call the attention ops' CPU implementations directly, not through the dispatcher.

A Python ``torch.library.custom_op`` costs ~80-100 us of dispatch a call on the CPU (measured on the CI VM:
``treespec::kv_write`` of one row 123 us through ``torch.ops``, 24 us as the plain function), and a SmolLM2
forward makes 60 such calls (``kv_write`` and ``tree_attention_paged`` per layer): ~5 ms of a ~100 ms decode
step. The ops' metadata checks ran on the fake tensors when Dynamo traced the graph, and Dynamo guards
those shapes, dtypes and strides (``dynamic=False``), so the per-call checks add nothing here. Runs last
(after dead-code elimination: ``kv_write`` mutates and returns nothing) and only where the graph is not
handed to Inductor and the binding lives on the CPU; CUDA graphs keep the ops (Triton kernels, capture).
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from treecompile.ops.kv_write import kv_write_reference
from treecompile.ops.tree_attention import _tree_attention_paged_cpu

logger = logging.getLogger(__name__)

# op -> its CPU implementation with the op's argument order (what the op body runs after its checks).
DIRECT = {
    torch.ops.treespec.kv_write.default: kv_write_reference,
    torch.ops.treespec.tree_attention_paged.default: _tree_attention_paged_cpu,
}


def direct_cpu_ops(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    if getattr(settings, "inductor", True) or binding is None or binding.device.type != "cpu":
        return gm
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in DIRECT and not node.kwargs:
            node.target = DIRECT[node.target]
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        logger.debug("direct_cpu_ops: %d op call(s) run their CPU implementation directly", count)
    return gm
