"""Run a verify tree's fused q/k/v projection and the rotary embedding of q and k as one treespec::skinny_qkv_rope.

Runs only when the binding asks for few-row Triton kernels (``TargetBinding(skinny_linears=True)``), unless
``TREECOMPILE_SKINNY_ROPE=0`` (A/B runs; it took 31-49 us off an 8B verify(64) on an H200), after ``fuse_glu`` and
before ``skinny_linears`` (which would take the projection alone). It matches ``fuse_projections``' layout and HF's
``apply_rotary_pos_emb`` as Dynamo records them in Llama, Qwen2 and Mistral attention::

    qkv = linear(x, qkv_w, qkv_b or None); gq, gk, gv = split(qkv, [Hq D, Hkv D, Hkv D], dim=-1)
    q = view(gq, (B, T, -1, D)).transpose(1, 2)          (k likewise)
    q_embed = q * cos.unsqueeze(1) + cat((-q[..., D/2:], q[..., :D/2]), dim=-1) * sin.unsqueeze(1)

and rewrites it to ``q, k, v = skinny_qkv_rope(x.reshape(M, H), qkv_w, qkv_b, cos.reshape(M, D),
sin.reshape(M, D), Hq, Hkv)``, each reshaped to the split's ``[B, T, *]``: the views and transposes after the
split then read rotated q and k, and ``q_embed`` / ``k_embed`` are those views. It applies where x is a 16-bit CUDA tensor of
17..64 rows (static dims: a tree's verify), D / 2 is a multiple of 16, q and k are rotated by the same tables
and every replaced value has no other user; anything else (Qwen3's per-head q/k norms between the view and the
rotation, say) is left exactly as it was. Why one call: :mod:`treecompile.ops.skinny_qkv_rope`.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from treecompile.ops import skinny_qkv_rope as rope_op

from ._graph import node_value
from .fuse_mlp import _ADD, _MUL, _call, _method, _sole_user, _split_half
from .fuse_projections import _linear_args

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16)
_DEVICE_TYPES = ("cuda",)  # the op's Triton path (tests on a CPU-only machine add "cpu": the op's reference)
MIN_ROWS = 17  # up to 16 rows: the gemv kernels


def _mul_with(node, first_ok):
    """(a, b) of ``mul(a, b)`` or ``mul(b, a)`` where ``first_ok(a)``, else None."""
    if not _call(node, _MUL, 2) or node.kwargs:
        return None
    a, b = node.args
    if first_ok(a):
        return a, b
    if first_ok(b):
        return b, a
    return None


def _half_slice(node, source, lower: bool, half: int) -> bool:
    """``source[..., :half]`` (lower) or ``source[..., half:]``."""
    if not _call(node, {operator.getitem}, 2) or node.args[0] is not source:
        return False
    index = node.args[1]
    want = slice(None, half, None) if lower else slice(half, None, None)
    return isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and index[1] == want


def _rotation(embed):
    """(a, cos_u, sin_u, nodes the rewrite removes) when ``embed`` is HF's ``a * cos_u + rotate_half(a) * sin_u``
    with a 4-d ``a`` and no other user of any intermediate, else None."""
    if not _call(embed, _ADD, 2) or embed.kwargs:
        return None
    for first, second in (embed.args, embed.args[::-1]):
        straight = _mul_with(first, lambda n: _method(n, "transpose"))
        rotated = _mul_with(second, lambda n: _call(n, {torch.cat}))
        if straight is None or rotated is None:
            continue
        (a, cos_u), (cat, sin_u) = straight, rotated
        shape = getattr(a.meta.get("example_value"), "shape", None)
        if shape is None or len(shape) != 4 or shape[-1] % 2:
            return None
        half = shape[-1] // 2
        parts = cat.args[0] if cat.args else None
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if not isinstance(parts, (list, tuple)) or len(parts) != 2 or dim not in (-1, 3):
            return None
        neg, low = parts
        if not _call(neg, {operator.neg, torch.neg}, 1) or not _half_slice(neg.args[0], a, False, half):
            return None
        if not _half_slice(low, a, True, half):
            return None
        high = neg.args[0]
        chain = [(first, embed), (second, embed), (cat, second), (neg, cat), (high, neg)]
        if not all(_sole_user(n, user) for n, user in chain) or list(low.users) != [cat]:
            return None
        if set(a.users) != {first, low, high}:  # the unrotated a is read by nothing else
            return None
        return a, cos_u, sin_u, [embed, first, second, cat, neg, high, low]
    return None


def _head_view(a, D: int):
    """The split getitem when ``a`` is ``view(getitem(split, i), (B, T, -1 or H, D)).transpose(1, 2)`` with single
    users along the way, else None."""
    if not _method(a, "transpose") or tuple(a.args[1:]) not in ((1, 2), (2, 1)) or a.kwargs:
        return None
    view = a.args[0]
    if not _method(view, "view") or not _sole_user(view, a) or view.kwargs:
        return None
    shape = view.args[1] if len(view.args) == 2 and isinstance(view.args[1], (tuple, list)) else view.args[1:]
    if len(shape) != 4 or shape[-1] != D:
        return None
    item = view.args[0]
    if _split_half(item) is None or not _sole_user(item, view):
        return None
    return item


def _unsqueezed(node):
    """``t`` of ``t.unsqueeze(1)``, else None."""
    if _method(node, "unsqueeze") and len(node.args) == 2 and node.args[1] == 1 and not node.kwargs:
        return node.args[0]
    return None


def _match(gm, split, q_rot, k_rot):
    """The rewrite's pieces for the split whose q and k parts the rotations ``q_rot`` / ``k_rot`` (embed, a, cos_u,
    sin_u, removed nodes) rotate, else None."""
    (q_embed, a, cos_u, sin_u, removed_q), (k_embed, ka, kc, ks, removed_k) = q_rot, k_rot
    B, _, T, D = (int(d) if isinstance(d, int) else None for d in a.meta["example_value"].shape)
    if None in (B, T, D) or (kc, ks) != (cos_u, sin_u) or ka.meta["example_value"].shape[-1] != D:
        return None
    sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size_or_sections")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 3 or dim not in (-1, 2):
        return None
    if sizes[0] % D or sizes[1] % D or sizes[1] != sizes[2]:
        return None
    Hq, Hkv = sizes[0] // D, sizes[1] // D
    items = {idx: user for user in split.users if (found := _split_half(user)) and (idx := found[1]) in (0, 1, 2)}
    if len(items) != 3 or len(split.users) != 3:
        return None
    proj = _linear_args(split.args[0]) if isinstance(split.args[0], torch.fx.Node) else None
    if proj is None or not _sole_user(split.args[0], split):
        return None
    x, weight, bias = proj
    cos_b, sin_b = _unsqueezed(cos_u), _unsqueezed(sin_u)
    x_value, w_value = node_value(gm, x), node_value(gm, weight)
    c_value, s_value = node_value(gm, cos_b), node_value(gm, sin_b)
    if x_value is None or w_value is None or c_value is None or s_value is None:
        return None
    if x_value.device.type not in _DEVICE_TYPES or x_value.dtype not in _DTYPES:
        return None
    if x_value.device.type == "cuda" and (D // 2) % rope_op.MIN_HALF:
        return None
    if w_value.dtype != x_value.dtype or w_value.device != x_value.device or not w_value.is_contiguous():
        return None
    if tuple(w_value.shape) != ((Hq + 2 * Hkv) * D, x_value.shape[-1]):
        return None
    if bias is not None:  # Qwen2: a [N] bias of the weight's dtype and device
        b_value = node_value(gm, bias)
        if b_value is None or tuple(b_value.shape) != (w_value.shape[0],) or b_value.dtype != w_value.dtype:
            return None
        if b_value.device != w_value.device:
            return None
    for t in (c_value, s_value):
        if tuple(t.shape) != (B, T, D) or t.dtype != x_value.dtype or t.device != x_value.device:
            return None
    if tuple(x_value.shape[:-1]) != (B, T) or not MIN_ROWS <= B * T <= rope_op.MAX_ROWS:
        return None
    return dict(x=x, weight=weight, bias=bias, cos=cos_b, sin=sin_b, B=B, T=T, D=D, H=x_value.shape[-1], Hq=Hq,
                Hkv=Hkv, items=items, linear=split.args[0], q=(q_embed, a, removed_q), k=(k_embed, ka, removed_k),
                cos_u=cos_u, sin_u=sin_u)  # fmt: skip


def fuse_qkv_rope(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    if not getattr(binding, "skinny_linears", False) or not rope_op.rope_wanted():
        return gm
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    by_part = {}  # (split node, 0 for q / 1 for k) -> (embed, a, cos_u, sin_u, removed nodes)
    for node in graph.nodes:
        found = _rotation(node)
        item = _head_view(found[0], found[0].meta["example_value"].shape[-1]) if found is not None else None
        if item is not None:
            by_part[_split_half(item)] = (node, *found)
    count = 0
    for (split, index), q_rot in by_part.items():
        k_rot = by_part.get((split, 1))
        m = _match(gm, split, q_rot, k_rot) if index == 0 and k_rot is not None else None
        if m is None:
            continue
        lin = m["linear"]
        if max(order[m["cos"]], order[m["sin"]]) > order[lin]:  # the tables must exist where the GEMM goes
            continue
        B, T, D, M = m["B"], m["T"], m["D"], m["B"] * m["T"]
        widths = (m["Hq"] * D, m["Hkv"] * D, m["Hkv"] * D)
        with graph.inserting_before(lin):
            rows = graph.call_method("reshape", (m["x"], M, m["H"]))
            cos = graph.call_method("reshape", (m["cos"], M, D))
            sin = graph.call_method("reshape", (m["sin"], M, D))
            out = graph.call_function(torch.ops.treespec.skinny_qkv_rope.default,
                                      (rows, m["weight"], m["bias"], cos, sin, m["Hq"], m["Hkv"]))  # fmt: skip
            parts = [graph.call_function(operator.getitem, (out, i)) for i in range(3)]
            shaped = [graph.call_method("reshape", (p, B, T, w)) for p, w in zip(parts, widths)]
        stack = dict(lin.meta.get("nn_module_stack") or {})
        for new in (rows, cos, sin, out, *parts, *shaped):
            new.meta["nn_module_stack"] = stack
        for i, new in enumerate(shaped):
            item = m["items"][i]
            new.meta.update({k: v for k, v in item.meta.items() if k in ("example_value", "stack_trace")})
            item.replace_all_uses_with(new)
        for embed, a, removed in (m["q"], m["k"]):
            embed.replace_all_uses_with(a)
            for dead in removed:
                graph.erase_node(dead)
        for dead in (*m["items"].values(), split, lin, m["cos_u"], m["sin_u"]):
            if not dead.users:
                graph.erase_node(dead)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
        logger.info("fuse_qkv_rope: %d q/k/v projection(s) + rotary embedding -> treespec::skinny_qkv_rope", count)
    return gm
