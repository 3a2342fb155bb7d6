"""Fold a verify tree's residual add and RMSNorm into the GEMM that produces the norm's input.

Runs when the binding asks for few-row Triton kernels (``TargetBinding(skinny_linears=True)``) and
``TREECOMPILE_FUSE_NORM=1`` asks (off by default until a GPU round A/B: below), after ``skinny_linears`` (so each
GEMM's kernel is already chosen) and before ``clean_up_graph``. Between two GEMMs of an HF decoder layer (Llama,
Qwen2, Qwen3, Mistral) Dynamo records::

    y = skinny_linear(rows, w, b, c).reshape(*lead, H)     # o_proj or down_proj, on Triton tiles
    s = residual + y                                        # the residual add (either order)
    x = norm_weight * (s.to(float32) * rsqrt(s.to(float32).pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    consumer(x.reshape(M, H), ...)                          # skinny_glu (gate/up) or skinny_qkv_rope (q/k/v)

and Inductor runs the add and the norm as one reduction kernel between the GEMMs: two a layer, ~2.5 us each on
an 8B verify of 64 nodes (H100, PDL off: 160 us a round, notes/gpu-2026-12-05-s42.md). This pass rewrites it to::

    s, u, sumsq = skinny_linear_norm_out(rows, w, b, c, residual.reshape(M, H), norm_weight)
    consumer(u, ..., sumsq, eps)                            # s.reshape(*lead, H) for s's other users

The producer's epilogue adds the residual (rounded as the unfused graph rounds), stores ``u = norm_weight * s``
rounded once and the partial sums of ``s^2`` over its output slices; the consumer streams ``u`` into its MMA as it
would any input and scales its sums by the row's ``rsqrt(sum(sumsq) / H + eps)`` after the loop, so a layer's
GEMMs follow one another with no kernel between them. One rounding where HF rounds ``s * r`` and then
``norm_weight * (...)``: ~2^-8 relative in bfloat16 (:mod:`treecompile.ops.skinny_glu`). Where the producer is
not on Triton tiles (a cuBLAS-won shape such as the H100's 64-row o, or the embedding before the first layer),
or its tiles are not the plain MMA kernel (``skinny_linear.norm_out_supported``), the norm stays a kernel; so
does the final norm before the LM head.

Why this shape (forty-third session): the first version put the norm in the consumer's prologue, feeding
``norm_weight * s`` to the MMA from registers. That made Hopper's wgmma synchronous (the sm_90 PTX of
``skinny_glu`` waited on every K step: 17 ``wgmma.wait_group`` against 2) and the 8B verify went 6.335 ->
9.633 ms on an H100 (notes/gpu-2026-12-05-s43.md). Here the consumer's K loop is exactly the plain one.

It applies to 16-bit CUDA graphs whose consumer calls ``fuse_glu`` / ``fuse_qkv_rope`` made (17..64 rows: a
verify), where every value of the norm has no user outside it, the GEMM's own output has no other user, and the
norm weight is ``[H]`` of s's dtype. Anything else is left exactly as it was.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from treecompile.ops import skinny_linear as skinny_op
from treecompile.ops._common import env_switch

from ._graph import node_value
from .fuse_mlp import _ADD, _call, _method, _rms_norm, _sole_user

logger = logging.getLogger(__name__)

NORM_ENV = "TREECOMPILE_FUSE_NORM"
_DTYPES = (torch.float16, torch.bfloat16)
_DEVICE_TYPES = ("cuda",)  # the ops' Triton paths (tests on a CPU-only machine add "cpu": the ops' references)


def norm_fusion_wanted() -> bool:
    """Whether the pass runs: only where ``TREECOMPILE_FUSE_NORM=1`` asks (not yet timed in a round: module
    docstring). Anything but 0 / 1 is refused by name."""
    return env_switch(NORM_ENV, False)


def _consumers() -> dict:
    """Consumer op -> its argument count without the norm (the partial sums and eps are appended)."""
    return {torch.ops.treespec.skinny_glu.default: 2, torch.ops.treespec.skinny_qkv_rope.default: 7}


def _qualifies(value, H: int) -> bool:
    return (
        value is not None and value.dim() >= 1 and value.shape[-1] == H and value.dtype in _DTYPES
        and value.device.type in _DEVICE_TYPES and all(isinstance(d, int) for d in value.shape)
    )  # fmt: skip


def _producer(y, s):
    """The skinny_linear node when ``y`` is ``skinny_linear(...).reshape(...)`` with no residual of its own and no
    user but the add ``s``, else None."""
    if not _method(y, "reshape") or not _sole_user(y, s):
        return None
    call = y.args[0]
    if not _call(call, {torch.ops.treespec.skinny_linear.default}) or not _sole_user(call, y):
        return None
    if len(call.args) > 4 or call.kwargs:  # a residual (or anything past constant_weight) already there
        return None
    return call


def _fold_norm(gm, graph, consumer, nargs: int) -> bool:
    """Give ``consumer``'s norm and the residual add before it to the producing GEMM (module docstring)."""
    rows = consumer.args[0]
    if len(consumer.args) != nargs or consumer.kwargs or not _method(rows, "reshape") or not _sole_user(rows, consumer):
        return False
    norm = _rms_norm(gm, rows.args[0], [rows])
    if norm is None:
        return False
    s, norm_w, eps, nodes = norm
    s_value, w_value = node_value(gm, s), node_value(gm, norm_w)
    M, H = rows.args[1:] if len(rows.args) == 3 else (None, None)
    if not isinstance(H, int) or not isinstance(M, int) or not _qualifies(s_value, H) or w_value is None:
        return False
    if tuple(w_value.shape) != (H,) or w_value.dtype != s_value.dtype or w_value.device != s_value.device:
        return False
    if not _call(s, _ADD, 2) or s.kwargs:
        return False
    for y, residual in (s.args, s.args[::-1]):
        call = _producer(y, s) if isinstance(residual, torch.fx.Node) else None
        r_value = node_value(gm, residual) if call is not None else None
        if r_value is None or r_value.shape != s_value.shape or r_value.dtype != s_value.dtype:
            continue
        w = node_value(gm, call.args[1])  # (its input rows are a reshape the earlier pass made: no example value)
        if w is None or w.dim() != 2 or w.shape[0] != H or not skinny_op.norm_out_supported(M, H, w.shape[1]):
            continue
        # skinny_linear(x, weight, bias=None, constant_weight=False): fill the defaults in
        args = (*call.args, *(None, False)[len(call.args) - 2 :])
        with graph.inserting_before(s):  # after both the residual and the producer's input
            r_rows = graph.call_method("reshape", (residual, M, H))
            out = graph.call_function(torch.ops.treespec.skinny_linear_norm_out.default, (*args, r_rows, norm_w))
            s_rows, u, sumsq = (graph.call_function(operator.getitem, (out, i)) for i in range(3))
            new_s = graph.call_method("reshape", (s_rows, *s_value.shape))
        new_s.meta.update({k: v for k, v in s.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
        for new in (r_rows, out, s_rows, u, sumsq):
            new.meta["nn_module_stack"] = dict(s.meta.get("nn_module_stack") or {})
        s.replace_all_uses_with(new_s)
        consumer.args = (u, *consumer.args[1:], sumsq, eps)
        for dead in [rows, *nodes, s, y, call]:
            graph.erase_node(dead)
        return True
    return False


def fuse_residual_norm(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    if not getattr(binding, "skinny_linears", False) or not norm_fusion_wanted():
        return gm
    graph = gm.graph
    consumers = _consumers()
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in consumers:
            count += _fold_norm(gm, graph, node, consumers[node.target])
    if count:
        graph.lint()
        gm.recompile()
        logger.info("fuse_residual_norm: %d residual add(s) + RMSNorm(s) into their GEMMs' epilogues", count)
    return gm
