"""Run a verify tree's fused gate/up projection and its ``silu(g) * u`` as one ``treespec::skinny_glu`` call.

Runs when the binding asks for few-row Triton kernels (``TargetBinding(skinny_linears=True)``) unless
``TREECOMPILE_SKINNY_GLU=0`` (A/B runs; it took 78-91 us off an 8B verify(64) on an H100), after ``fuse_mlp`` (which takes <= 16 rows
whole) and before ``skinny_linears`` (which takes the linears one by one). It matches ``fuse_projections``'
layout as Dynamo records HF's ``LlamaMLP`` (Llama, Qwen2, Qwen3, Mistral)::

    gu = linear(x, gate_up_w); g, u = split(gu, [I, I], dim=-1); h = silu(g) * u

and rewrites ``h`` to ``skinny_glu(x.reshape(M, H), gate_up_w).reshape(*lead, I)``; the down projection that
reads ``h`` stays for ``skinny_linears``. It applies where x is a 16-bit CUDA tensor of 17..64 rows (static
leading dims: a tree's verify; fewer rows run the gemv kernels or the fused MLP), the projection has no bias,
and every intermediate value has no other user. Anything else is left exactly as it was. Why one call:
:mod:`treecompile.ops.skinny_glu`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx

from treecompile.ops import skinny_glu as glu_op

from ._graph import node_value
from .fuse_mlp import _gated_product, _projections

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16)
_DEVICE_TYPES = ("cuda",)  # the op's Triton path (tests on a CPU-only machine add "cpu": the op's reference)
MIN_ROWS = 17  # up to 16 rows: the gemv kernels and the fused MLP


def _rows(x_value, weight_value) -> int | None:
    """M when the input and the fused weight qualify (module docstring), else None."""
    if x_value is None or weight_value is None or x_value.dim() < 1:
        return None
    if x_value.device.type not in _DEVICE_TYPES or x_value.dtype not in _DTYPES:
        return None
    if weight_value.dtype != x_value.dtype or weight_value.device != x_value.device or not weight_value.is_contiguous():
        return None
    lead = x_value.shape[:-1]
    if not all(isinstance(d, int) for d in lead):
        return None
    M = math.prod(lead)
    return M if MIN_ROWS <= M <= glu_op.MAX_ROWS else None


def fuse_glu(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    if not getattr(binding, "skinny_linears", False) or not glu_op.glu_wanted():
        return gm
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        gated = _gated_product(node)
        if gated is None:
            continue
        act, g, up = gated
        found = _projections(gm, g, up)
        if found is None or found[4] is None:  # separate gate and up projections: not this op's layout
            continue
        x, _, _, removed, (fused_w, I) = found
        x_value, w_value = node_value(gm, x), node_value(gm, fused_w)
        M = _rows(x_value, w_value)
        if M is None:
            continue
        H = x_value.shape[-1]
        with graph.inserting_before(node):
            rows = graph.call_method("reshape", (x, M, H))
            out = graph.call_function(torch.ops.treespec.skinny_glu.default, (rows, fused_w))
            h = graph.call_method("reshape", (out, *x_value.shape[:-1], I))
        h.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
        for new in (rows, out):
            new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
        node.replace_all_uses_with(h)
        for dead in [node, act, *removed]:
            graph.erase_node(dead)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
        logger.info("fuse_glu: %d gate/up + silu-mul(s) -> treespec::skinny_glu", count)
    return gm
