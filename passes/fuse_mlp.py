"""Run each few-row gated MLP, ``down(silu(gate(x)) * up(x))``, as one ``treespec::fused_mlp`` call.

Runs only when the binding asks for few-row Triton kernels (``TargetBinding(skinny_linears=True)``, as
``passes/skinny_linears.py`` does), before that pass takes the MLP's linears one by one. It matches the
HF ``LlamaMLP`` pattern (Llama, Qwen2, Qwen3, Mistral) as Dynamo records it, in either layout::

    g = linear(x, gate_w); u = linear(x, up_w)                        # separate projections
    gu = linear(x, gate_up_w); g, u = split(gu, [I, I], dim=-1)       # fuse_projections' layout
    y = linear(silu(g) * u, down_w)

and rewrites it to ``fused_mlp(x.reshape(M, H), gate_w, up_w, down_w).reshape(*lead, H)``, the fused layout's
halves passed as ``narrow`` views (no copy). When x is HF's ``LlamaRMSNorm`` of ``s`` (``s.to(float32)``, ``pow(2)
.mean(-1, keepdim=True)``, ``+ eps``, ``rsqrt``, the product cast back, times the norm's weight) and every value
of the norm has no user outside it, the norm goes into the op too (its RMSNorm prologue: one launch fewer a
layer); when ``s`` is a residual add ``a + b``, the op takes ``a`` and ``b`` and the add stays in the graph for
its other users (the layer's closing residual add, where Inductor fuses it). ``TREECOMPILE_FUSED_MLP_NORM=0``
leaves the norm out (A/B runs). It applies where the input is a 16-bit CUDA tensor of 1..16 rows
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

from ._graph import is_constant, node_value
from .fuse_projections import _LINEAR as _LINEAR_TARGETS
from .fuse_projections import _linear_args

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16)
_DEVICE_TYPES = ("cuda",)  # the op's Triton path (tests on a CPU-only machine add "cpu": the op's reference)
# the targets Dynamo records for HF's MLP and RMSNorm (the pass runs on Dynamo's torch-level graph)
_SILU = {torch.nn.functional.silu}
_MUL = {operator.mul, torch.mul}
_ADD = {operator.add, torch.add}
_RSQRT = {torch.rsqrt}
NORM_ENV = mlp_op.FUSED_MLP_NORM_ENV


def _sole_user(node, user) -> bool:
    return isinstance(node, torch.fx.Node) and list(node.users) == [user]


def _silu_input(node):
    """The input of ``silu(input)`` (no in-place form), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _SILU:
        return None
    if len(node.args) != 1 or node.kwargs.get("inplace", False) or set(node.kwargs) - {"inplace"}:
        return None
    return node.args[0]


def _gated_product(h):
    """(silu node, gate input, up input) when ``h`` is ``silu(g) * up`` (either order) and the silu and both
    inputs have no other user, else None."""
    if not isinstance(h, torch.fx.Node) or h.op != "call_function" or h.target not in _MUL or len(h.args) != 2:
        return None
    if h.kwargs:
        return None
    a, b = h.args
    act, up = (a, b) if _silu_input(a) is not None else (b, a)
    g = _silu_input(act)
    if g is None or not _sole_user(act, h) or not _sole_user(g, act) or not _sole_user(up, h):
        return None
    return act, g, up


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
    if not isinstance(parts, torch.fx.Node) or parts.op != "call_function" or parts.target is not torch.split:
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
    fused_value = node_value(gm, proj[1]) if proj is not None else None
    # the split must cut the fused output's last dim; that output (made by fuse_projections, no example value)
    # has its input's rank
    x_value = node_value(gm, proj[0]) if proj is not None else None
    if proj is None or fused_value is None or fused_value.dim() != 2 or x_value is None:
        return None
    if dim not in (-1, x_value.dim() - 1):
        return None
    half = fused_value.shape[0] // 2
    got = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes, sizes]  # an int size: equal halves
    if got != [half, half]:
        return None
    if 2 * half != fused_value.shape[0] or set(split.users) != {g, u} or not _sole_user(fused, split):
        return None
    return proj[0], None, None, [g, u, split, fused], (proj[1], half)


def _call(node, targets, nargs=None) -> bool:
    ok = isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets
    return ok and (nargs is None or len(node.args) == nargs)


def _method(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _cast_input(node, dtype):
    """The input of ``input.to(dtype)`` (positional dtype, nothing else), else None."""
    if not _method(node, "to") or len(node.args) != 2 or node.kwargs or node.args[1] is not dtype:
        return None
    return node.args[0]


def _rms_norm(gm, x, x_users):
    """(s, norm weight node, eps, the norm's nodes users-first) when ``x`` is HF's LlamaRMSNorm of ``s`` (module
    docstring) and the norm's values have no other users (``x`` itself only ``x_users``), else None."""
    if not _call(x, _MUL, 2) or x.kwargs or set(x.users) != set(x_users):
        return None
    a, b = x.args
    weight, cast = (a, b) if _method(b, "to") else (b, a)
    w_value = node_value(gm, weight)
    if w_value is None or not is_constant(weight) or w_value.dim() != 1:
        return None
    scaled = _cast_input(cast, w_value.dtype)
    if scaled is None or not _call(scaled, _MUL, 2) or scaled.kwargs:
        return None
    p, q = scaled.args
    h32, rs = (p, q) if _call(q, _RSQRT, 1) else (q, p)
    if not _call(rs, _RSQRT, 1):
        return None
    var_eps = rs.args[0]
    if not _call(var_eps, _ADD, 2) or var_eps.kwargs or not isinstance(var_eps.args[1], float):
        return None
    var, eps = var_eps.args
    if not _method(var, "mean"):
        return None
    positional = var.args[1:] == (-1,) and var.kwargs == {"keepdim": True}  # HF: .mean(-1, keepdim=True)
    keyword = var.args[1:] == () and var.kwargs == {"dim": -1, "keepdim": True}
    if not (positional or keyword):
        return None
    square = var.args[0]
    if not _method(square, "pow") or len(square.args) != 2 or square.args[1] != 2 or square.args[0] is not h32:
        return None
    s = _cast_input(h32, torch.float32)
    if s is None or set(h32.users) != {square, scaled}:
        return None
    chain = ((cast, x), (scaled, cast), (rs, scaled), (var_eps, rs), (var, var_eps), (square, var))
    if not all(_sole_user(n, user) for n, user in chain):
        return None
    return s, weight, float(eps), [x, cast, scaled, rs, var_eps, var, square, h32]


def _prologue(gm, norm, x_value):
    """(the op's x, its residual or None, norm weight node, eps, the norm's nodes) for a norm ``_rms_norm`` found,
    when its weight is [H] of x's dtype and ``s`` is a residual add of two tensors shaped like x (the op takes
    both; the add stays for its other users) or itself shaped like x; else None (the norm stays a kernel)."""
    s, norm_w, eps, nodes = norm

    def like_x(node) -> bool:
        v = node_value(gm, node)
        return v is not None and v.shape == x_value.shape and v.dtype == x_value.dtype and v.device == x_value.device

    w = node_value(gm, norm_w)
    if w is None or tuple(w.shape) != (x_value.shape[-1],) or w.dtype != x_value.dtype:
        return None
    if _call(s, _ADD, 2) and not s.kwargs and all(isinstance(t, torch.fx.Node) and like_x(t) for t in s.args):
        return s.args[0], s.args[1], norm_w, eps, nodes
    return (s, None, norm_w, eps, nodes) if like_x(s) else None


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
    count = normed = 0
    for node in list(graph.nodes):
        down = _plain_linear(node)
        if down is None:
            continue
        h, down_w = down
        gated = _gated_product(h)
        if gated is None or not _sole_user(h, node):
            continue
        act, g, up = gated
        found = _projections(gm, g, up)
        if found is None:
            continue
        x, gate_w, up_w, removed, fused = found
        x_value, down_value = node_value(gm, x), node_value(gm, down_w)
        if fused is not None:
            fused_value = node_value(gm, fused[0])
            weights = [fused_value, down_value]
        else:
            weights = [node_value(gm, gate_w), node_value(gm, up_w), down_value]
        M = _rows(x_value, weights)
        if M is None:
            continue
        H, I = x_value.shape[-1], down_value.shape[1]
        want = [(I, H)] * 2 if fused is None else [(2 * I, H)]  # gate and up, or the fused [2I, H]
        if any(tuple(w.shape) != shape for w, shape in zip(weights[:-1], want)):
            continue
        if tuple(down_value.shape) != (H, I):
            continue
        if not (mlp_op.fused_mlp_wanted() or mlp_op.measured_mlp_tiles(M, H, I) is not None):
            continue  # unmeasured, or the unfused chain won: cuBLAS keeps it
        x_users = [n for n in removed if n.op == "call_function" and n.target in _LINEAR_TARGETS]
        norm = _rms_norm(gm, x, x_users) if mlp_op.fold_norm_wanted() else None
        prologue = _prologue(gm, norm, x_value) if norm is not None else None
        src, residual = (prologue[0], prologue[1]) if prologue else (x, None)
        with graph.inserting_before(node):
            rows = graph.call_method("reshape", (src, M, H))
            norm_args = ()
            if prologue:
                if residual is not None:
                    residual = graph.call_method("reshape", (residual, M, H))
                norm_args = (prologue[2], residual, prologue[3])
            if fused is not None:  # the two halves of fuse_projections' [2I, H] weight, as views
                gate_w = graph.call_function(torch.narrow, (fused[0], 0, 0, I))
                up_w = graph.call_function(torch.narrow, (fused[0], 0, I, I))
            sources = [fused[0]] if fused is not None else [gate_w, up_w]
            constant = all(is_constant(w) for w in [*sources, down_w])
            args = (rows, gate_w, up_w, down_w, constant, *norm_args)
            out = graph.call_function(torch.ops.treespec.fused_mlp.default, args)
            y = graph.call_method("reshape", (out, *x_value.shape[:-1], H))
        y.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
        for new in (rows, out):
            new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
        node.replace_all_uses_with(y)
        for dead in [node, h, act, *removed, *(prologue[4] if prologue else [])]:
            graph.erase_node(dead)
        count += 1
        normed += prologue is not None
    if count:
        graph.lint()
        gm.recompile()
        logger.info("fuse_mlp: %d gated MLP(s) -> treespec::fused_mlp (%d with their RMSNorm)", count, normed)
    return gm
