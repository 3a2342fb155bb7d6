"""Run each few-row gated MLP, ``down(silu(gate(x)) * up(x))``, as one ``treespec::fused_mlp`` call.

Runs only when the binding asks for few-row Triton kernels (``TargetBinding(skinny_linears=True)``, as
``passes/skinny_linears.py`` does), before that pass takes the MLP's linears one by one. It matches the
HF ``LlamaMLP`` pattern (Llama, Qwen2, Qwen3, Mistral) as Dynamo records it, in either layout::

    g = linear(x, gate_w); u = linear(x, up_w)                        # separate projections
    gu = linear(x, gate_up_w); g, u = split(gu, [I, I], dim=-1)       # fuse_projections' layout
    y = linear(silu(g) * u, down_w)

and rewrites it to ``fused_mlp(x.reshape(M, H), gate_w, up_w, down_w).reshape(*lead, H)``, the fused layout's
halves passed as ``narrow`` views (no copy). It applies where the input is a 16-bit CUDA tensor of 1..16 rows
(static leading dims), no projection has a bias, every intermediate value has no other user, and the shape
has a measured win in ``ops/fused_mlp.py``'s table (or ``TREECOMPILE_FUSED_MLP=1`` asks for every
qualifying shape). Anything else is left exactly as it was. Why one call, and what it was measured against:
:mod:`treecompile.ops.fused_mlp`.
"""

from __future__ import annotations

import logging
import math
import operator

import torch
import torch.fx

from treecompile.ops import fused_mlp as mlp_op

from .fuse_projections import _linear_args

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16)
_DEVICE_TYPES = ("cuda",)  # the op's Triton path (tests on a CPU-only machine add "cpu": the op's reference)
_SILU = {torch.nn.functional.silu, torch.ops.aten.silu.default}
_MUL = {operator.mul, torch.mul, torch.ops.aten.mul.Tensor}
_SPLIT = {torch.split, torch.functional.split}


def _value(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node):
        return None
    value = getattr(gm, node.target, None) if node.op == "get_attr" else node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None


def _sole_user(node, user) -> bool:
    return isinstance(node, torch.fx.Node) and list(node.users) == [user]


def _silu_input(node):
    """The input of ``silu(input)`` (no in-place form), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _SILU:
        return None
    if len(node.args) != 1 or node.kwargs.get("inplace", False) or set(node.kwargs) - {"inplace"}:
        return None
    return node.args[0]


def _plain_linear(node):
    """(x, weight) of ``linear(x, weight)`` without a bias, else None."""
    args = _linear_args(node) if isinstance(node, torch.fx.Node) else None
    if args is None or args[2] is not None:
        return None
    return args[0], args[1]


def _split_half(node):
    """(split node, index) when ``node`` is ``getitem(split(...), index)``, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is not operator.getitem:
        return None
    parts, index = node.args
    if not isinstance(parts, torch.fx.Node) or parts.op != "call_function" or parts.target not in _SPLIT:
        return None
    return parts, index


def _projections(gm, g, u):
    """(x, gate weight, up weight, nodes the rewrite removes, fused weight and I or None) when ``g`` and ``u``
    are the gate and up projections of one input in a layout the module docstring names, else None."""
    pg, pu = _plain_linear(g), _plain_linear(u)
    if pg is not None and pu is not None:
        if pg[0] is not pu[0]:
            return None
        return pg[0], pg[1], pu[1], [g, u], None
    sg, su = _split_half(g), _split_half(u)
    if sg is None or su is None or sg[0] is not su[0] or (sg[1], su[1]) != (0, 1):
        return None
    split = sg[0]
    sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size_or_sections")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    fused = split.args[0]
    proj = _plain_linear(fused)
    fused_value = _value(gm, proj[1]) if proj is not None else None
    if proj is None or fused_value is None or fused_value.dim() != 2 or dim not in (-1, fused_value.dim()):
        return None
    half = fused_value.shape[0] // 2
    got = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes, sizes]  # an int size: equal halves
    if got != [half, half]:
        return None
    if 2 * half != fused_value.shape[0] or set(split.users) != {g, u} or not _sole_user(fused, split):
        return None
    return proj[0], None, None, [g, u, split, fused], (proj[1], half)


def _rows(x_value, weights) -> int | None:
    """M when the input and weights qualify (module docstring), else None."""
    if x_value is None or any(w is None for w in weights):
        return None
    if x_value.device.type not in _DEVICE_TYPES or x_value.dtype not in _DTYPES or x_value.dim() < 1:
        return None
    if any(w.dtype != x_value.dtype or w.device != x_value.device or w.dim() != 2 or w.stride(1) != 1 for w in weights):
        return None
    lead = x_value.shape[:-1]
    if not all(isinstance(d, int) for d in lead):
        return None
    M = math.prod(lead)
    return M if 1 <= M <= mlp_op.MAX_ROWS else None


def fuse_mlp(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    if not getattr(binding, "skinny_linears", False):
        return gm
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        down = _plain_linear(node)
        if down is None:
            continue
        h, down_w = down
        if not isinstance(h, torch.fx.Node) or h.op != "call_function" or h.target not in _MUL or len(h.args) != 2:
            continue
        if h.kwargs or not _sole_user(h, node):
            continue
        a, b = h.args
        act, up = (a, b) if _silu_input(a) is not None else (b, a)
        g = _silu_input(act)
        if g is None or not _sole_user(act, h) or not _sole_user(g, act) or not _sole_user(up, h):
            continue
        found = _projections(gm, g, up)
        if found is None:
            continue
        x, gate_w, up_w, removed, fused = found
        x_value, down_value = _value(gm, x), _value(gm, down_w)
        if fused is not None:
            fused_value = _value(gm, fused[0])
            weights = [fused_value, down_value]
        else:
            weights = [_value(gm, gate_w), _value(gm, up_w), down_value]
        M = _rows(x_value, weights)
        if M is None:
            continue
        H, I = x_value.shape[-1], down_value.shape[1]
        if any(tuple(w.shape) != shape for w, shape in zip(weights[:-1], [(I, H)] * 2 if fused is None else [(2 * I, H)])):
            continue
        if tuple(down_value.shape) != (H, I):
            continue
        if not (mlp_op.fused_mlp_wanted() or mlp_op.measured_mlp_tiles(M, H, I) is not None):
            continue  # unmeasured, or the unfused chain won: cuBLAS keeps it
        with graph.inserting_before(node):
            rows = graph.call_method("reshape", (x, M, H))
            if fused is not None:  # the two halves of fuse_projections' [2I, H] weight, as views
                gate_w = graph.call_function(torch.narrow, (fused[0], 0, 0, I))
                up_w = graph.call_function(torch.narrow, (fused[0], 0, I, I))
            sources = [fused[0]] if fused is not None else [gate_w, up_w]
            constant = all(isinstance(w, torch.fx.Node) and w.op in ("get_attr", "placeholder") for w in [*sources, down_w])
            out = graph.call_function(torch.ops.treespec.fused_mlp.default, (rows, gate_w, up_w, down_w, constant))
            y = graph.call_method("reshape", (out, *x_value.shape[:-1], H))
        y.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
        for new in (rows, out):
            new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
        node.replace_all_uses_with(y)
        for dead in [node, h, act, *removed]:
            graph.erase_node(dead)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
        logger.info("fuse_mlp: %d gated MLP(s) -> treespec::fused_mlp", count)
    return gm
