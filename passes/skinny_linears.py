"""Run the target's few-row CUDA linears through ``treespec::skinny_linear`` (Triton tiles for M <= 256).

Runs only when the binding asks for it (``TargetBinding(skinny_linears=True)``, from
``TreeSpeculator(skinny_linears=...)``). Every ``linear(x, w, b)`` call whose input is a 16-bit CUDA tensor
with at most 256 rows (the product of its static leading dims: a round's B x T), whose weight has a
contiguous last dim, and whose shape the H200 sweep measured faster on Triton tiles than on cuBLAS
(``measured_tiles``; unmeasured shapes stay on cuBLAS, ``register_tiles`` adds a sweep of your own) becomes

    y = skinny_linear(x.reshape(M, K), w, b).reshape(*lead, N)

Fused projection weights (get_attr) are read the same way. float32 linears stay on cuBLAS: there the
tiles' summation order would differ from HF's own float32 GEMM, which the float32 equality checks rely on.
Why the op exists, and what it was measured against: :mod:`treecompile.ops.skinny_linear`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx

from treecompile.ops import skinny_linear as skinny_op
from treecompile.ops.skinny_linear import MAX_ROWS

from ._graph import is_constant, node_value
from .fuse_projections import _linear_args

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16)
_DEVICE_TYPES = ("cuda",)  # the op's Triton path (tests on a CPU-only machine add "cpu": the op's reference)


def _skinny_rows(gm, x, weight, bias) -> int | None:
    """M when this linear qualifies (module docstring), else None."""
    xv, wv = node_value(gm, x), node_value(gm, weight)
    if xv is None or wv is None or xv.dim() < 1 or wv.dim() != 2:
        return None
    if xv.device.type not in _DEVICE_TYPES or xv.dtype not in _DTYPES or wv.dtype != xv.dtype or wv.device != xv.device:
        return None
    if bias is not None:
        bv = node_value(gm, bias)
        if bv is None or bv.dtype != xv.dtype or bv.dim() != 1:
            return None
    lead = xv.shape[:-1]
    if not all(isinstance(d, int) for d in lead) or wv.shape[1] != xv.shape[-1] or xv.shape[-1] < 1:
        return None
    if wv.shape[1] > 1 and wv.stride(1) != 1:
        return None
    M = math.prod(lead)
    if not 1 <= M <= MAX_ROWS or skinny_op.measured_tiles(M, wv.shape[0], xv.shape[-1]) is None:
        return None  # too many rows, or a shape cuBLAS won (or nobody measured): it stays on cuBLAS
    return M


def skinny_linears(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    if not getattr(binding, "skinny_linears", False):
        return gm
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        args = _linear_args(node)
        if args is None:
            continue
        x, weight, bias = args
        M = _skinny_rows(gm, x, weight, bias)
        if M is None:
            continue
        xv, wv = node_value(gm, x), node_value(gm, weight)
        K, N = xv.shape[-1], wv.shape[0]
        with graph.inserting_before(node):
            # reshape (not view): a strided input is copied to the [M, K] rows the op reads
            rows = graph.call_method("reshape", (x, M, K))
            # a graph input or constant is a parameter, never written by the kernel just before: a
            # dependent launch may prefetch it (ops/skinny_linear.py, constant_weight)
            constant = is_constant(weight)
            out = graph.call_function(torch.ops.treespec.skinny_linear.default, (rows, weight, bias, constant))
            y = graph.call_method("reshape", (out, *xv.shape[:-1], N))
        y.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
        for new in (rows, out):
            new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
        logger.info("skinny_linears: %d linear(s) -> treespec::skinny_linear (tiles measured on: %s)", count,
                    skinny_op.gpu_class() or "H200")
    return gm
