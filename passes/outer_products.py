"""Rewrite a matmul whose contraction dim is 1 (an outer product) into a broadcast multiply.

Why: transformers 5.17's rotary embedding forms its frequencies as ``inv_freq[:, None] @ positions[None, :]``
in float32, a matmul with K = 1. Inductor keeps it a GEMM (a ~2.9 us SIMT launch per forward on the H200) and
materialises the product as a ``[32, T]`` buffer with positions minor. Every layer's q / k rope kernel then
recomputes cos / sin from it with a strided load and 2-D tiling: at 64 verify rows they took 2.2-2.8 us
against ~1.1 us at 1 row, 60 kernels a round (notes/gpu-2026-12-01.md). As ``a * b`` the product fuses into
those kernels like any pointwise op (transformers 5.24 already writes it that way).

Exactness: one product per output element, no sum: ``a @ b`` (IEEE float32 / float64, no TF32) and ``a * b``
round the same product once. The pass leaves alone:
- half-precision operands;
- a matmul under an enabled autocast region, where autocast would have cast it;
- float32 on CUDA when matmuls may use TF32 (``torch.get_float32_matmul_precision() != "highest"``).

Shapes: ``a [..., M, 1] @ b [..., 1, N] -> [..., M, N]``, both operands at least 2-d. Batch dims broadcast
the same way under matmul and under the multiply.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

logger = logging.getLogger(__name__)

_MATMULS = {operator.matmul, torch.matmul, torch.bmm}
_EXACT_DTYPES = (torch.float32, torch.float64)


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_outer_product(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _MATMULS or len(node.args) != 2 or node.kwargs:
        return False
    a, b = (_example(x) for x in node.args)
    if a is None or b is None or a.dim() < 2 or b.dim() < 2:
        return False
    if a.dtype != b.dtype or a.dtype not in _EXACT_DTYPES:
        return False
    k_a, k_b = a.shape[-1], b.shape[-2]
    if not (isinstance(k_a, int) and isinstance(k_b, int) and k_a == 1 and k_b == 1):
        return False  # a symbolic K could be anything
    if a.dtype == torch.float32 and a.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return False
    return True


def _autocast_call(node: torch.fx.Node) -> str | None:
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name if name in ("_enter_autocast", "_exit_autocast") else None


def outer_products(gm: torch.fx.GraphModule, settings=None) -> torch.fx.GraphModule:
    autocast: list[bool] = []  # enabled flag of each open autocast region, innermost last
    rewritten = 0
    for node in list(gm.graph.nodes):
        kind = _autocast_call(node)
        if kind == "_enter_autocast":
            enabled = node.args[2] if len(node.args) > 2 else node.kwargs.get("enabled", True)
            autocast.append(bool(enabled))
            continue
        if kind == "_exit_autocast":
            if autocast:
                autocast.pop()
            continue
        if (autocast and autocast[-1]) or not _is_outer_product(node):
            continue
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(torch.mul, tuple(node.args))
        product.meta.update(node.meta)
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
        logger.info("outer_products: %d matmul(s) with a contraction of 1 -> broadcast multiply", rewritten)
    return gm
