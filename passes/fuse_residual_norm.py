"""Fold a verify tree's residual adds and RMSNorms into the GEMMs on either side of them.

Runs when the binding asks for few-row Triton kernels (``TargetBinding(skinny_linears=True)``) and
``TREECOMPILE_FUSE_NORM=1`` asks: off by default, it LOST on the GPU (below). After ``skinny_linears`` (so each GEMM's kernel is already chosen) and
before ``clean_up_graph``. Between two GEMMs of an HF decoder layer (Llama, Qwen2, Qwen3, Mistral) Dynamo
records::

    y = skinny_linear(rows, w, b, c).reshape(*lead, N)     # o_proj or down_proj, on Triton tiles
    s = residual + y                                        # the residual add (either order)
    x = norm_weight * (s.to(float32) * rsqrt(s.to(float32).pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    consumer(x.reshape(M, H), ...)                          # skinny_glu (gate/up) or skinny_qkv_rope (q/k/v)

and Inductor runs the add and the norm as one reduction kernel between the GEMMs: two a layer, ~2.5 us each
on an 8B verify of 64 nodes (H100, PDL off: 160 us a round, notes/gpu-2026-12-05-s42.md). This pass gives the
norm to the consumer (its RMSNorm prologue: ``consumer(s.reshape(M, H), ..., norm_weight, eps)``) and, where the
producer is a ``skinny_linear`` call with no residual of its own and ``y`` has no other user, the add to the
producer (its residual epilogue: ``s = skinny_linear(rows, w, b, c, residual.reshape(M, N)).reshape(*lead, N)``),
so a layer's GEMMs follow one another with no kernel between them. Where the producer is not on Triton tiles
(a cuBLAS-won shape, or the embedding before the first layer) only the norm moves: the add stays in the graph
as a pointwise kernel. The final norm before the LM head stays (its consumer has no prologue).

Numerics: the residual epilogue rounds like the unfused graph (the GEMM's output, then the add); the prologue
scales the GEMM's sums by the row's ``rsqrt`` after the loop and rounds ``norm_weight * s`` once where HF rounds
twice (~2^-8 relative in bfloat16, as ``fused_mlp``'s prologue: :mod:`treecompile.ops.skinny_glu`). On the
CPU (float64, the lossless tests) the ops run HF's exact norm.

Measured (forty-third session, H100 SXM, ``tests/gpu/session70.sh``, 8B rounds, ``--nodes 64``): 64 norms and
31 adds folded, verify(64) 6.335 -> 9.633 ms (+52%); decode and draft unchanged (the pass touches only the verify).
Not separated: the prologue (its K loop feeds the MMA from registers: x no longer goes straight from the async
copy to the MMA; the sm_90 compile of ``skinny_glu`` with it has a 48% larger cubin and 16 KB less shared
memory, the same async copies) is the likely cost, not the epilogue (one load at the store). A prologue-free
design is the lead: the producer's epilogue also stores ``norm_weight * s`` and per-slice partial sums of ``s^2``,
so the consumer streams its input straight into the MMA and scales by the row's rsqrt at the end.

It applies to 16-bit CUDA graphs whose consumer calls ``fuse_glu`` / ``fuse_qkv_rope`` made (17..64 rows: a
verify), where every value of the norm has no user outside it and its weight is ``[H]`` of s's dtype. Anything
else is left exactly as it was.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from treecompile.ops._common import env_switch

from ._graph import node_value
from .fuse_mlp import _ADD, _call, _method, _rms_norm, _sole_user

logger = logging.getLogger(__name__)

NORM_ENV = "TREECOMPILE_FUSE_NORM"
_DTYPES = (torch.float16, torch.bfloat16)
_DEVICE_TYPES = ("cuda",)  # the ops' Triton paths (tests on a CPU-only machine add "cpu": the ops' references)


def norm_fusion_wanted() -> bool:
    """Whether the pass runs: only where ``TREECOMPILE_FUSE_NORM=1`` asks (it lost on the GPU: module docstring).
    Anything but 0 / 1 is refused by name."""
    return env_switch(NORM_ENV, False)


def _consumers() -> dict:
    """Consumer op -> its argument count without the prologue (the norm weight and eps are appended)."""
    return {torch.ops.treespec.skinny_glu.default: 2, torch.ops.treespec.skinny_qkv_rope.default: 7}


def _qualifies(value, H: int) -> bool:
    return (
        value is not None and value.dim() >= 1 and value.shape[-1] == H and value.dtype in _DTYPES
        and value.device.type in _DEVICE_TYPES and all(isinstance(d, int) for d in value.shape)
    )  # fmt: skip


def _producer(gm, y, s):
    """(skinny_linear node, the reshape producing ``y``) when ``y`` is ``skinny_linear(...).reshape(...)`` with no
    residual of its own and no user but the add ``s``, else None."""
    if not _method(y, "reshape") or not _sole_user(y, s):
        return None
    call = y.args[0]
    if not _call(call, {torch.ops.treespec.skinny_linear.default}) or not _sole_user(call, y):
        return None
    if len(call.args) > 4 or call.kwargs:  # a residual (or anything past constant_weight) already there
        return None
    return call, y


def _fold_norm(gm, graph, consumer, nargs: int) -> tuple[bool, bool]:
    """Give ``consumer`` its norm (and the add before it to the producer where it can). (norm folded, add folded)."""
    rows = consumer.args[0]
    if len(consumer.args) != nargs or consumer.kwargs or not _method(rows, "reshape") or not _sole_user(rows, consumer):
        return False, False
    norm = _rms_norm(gm, rows.args[0], [rows])
    if norm is None:
        return False, False
    s, norm_w, eps, nodes = norm
    s_value, w_value = node_value(gm, s), node_value(gm, norm_w)
    M, H = rows.args[1:] if len(rows.args) == 3 else (None, None)
    if not isinstance(H, int) or not _qualifies(s_value, H) or w_value is None:
        return False, False
    if tuple(w_value.shape) != (H,) or w_value.dtype != s_value.dtype or w_value.device != s_value.device:
        return False, False
    fused_add = False
    if _call(s, _ADD, 2) and not s.kwargs:
        for y, residual in (s.args, s.args[::-1]):
            found = _producer(gm, y, s) if isinstance(residual, torch.fx.Node) else None
            r_value = node_value(gm, residual) if found else None
            if r_value is None or r_value.shape != s_value.shape or r_value.dtype != s_value.dtype:
                continue
            call, _ = found
            w = node_value(gm, call.args[1])
            if w is None or w.shape[0] != H:
                continue
            # skinny_linear(x, weight, bias=None, constant_weight=False, residual=None): fill the defaults in
            args = (*call.args, *(None, False)[len(call.args) - 2 :])
            with graph.inserting_before(s):  # after both the residual and the producer's input
                r_rows = graph.call_method("reshape", (residual, M, H))
                out = graph.call_function(call.target, (*args, r_rows))
                new_s = graph.call_method("reshape", (out, *s_value.shape))
            new_s.meta.update({k: v for k, v in s.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
            for new in (r_rows, out):
                new.meta["nn_module_stack"] = dict(s.meta.get("nn_module_stack") or {})
            s.replace_all_uses_with(new_s)
            for dead in (s, y, call):
                graph.erase_node(dead)
            s, fused_add = new_s, True
            break
    with graph.inserting_before(consumer):
        new_rows = graph.call_method("reshape", (s, M, H))
    new_rows.meta["nn_module_stack"] = dict(rows.meta.get("nn_module_stack") or {})
    consumer.args = (new_rows, *consumer.args[1:], norm_w, eps)
    for dead in [rows, *nodes]:
        graph.erase_node(dead)
    return True, fused_add


def fuse_residual_norm(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    if not getattr(binding, "skinny_linears", False) or not norm_fusion_wanted():
        return gm
    graph = gm.graph
    consumers = _consumers()
    norms = adds = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in consumers:
            continue
        normed, added = _fold_norm(gm, graph, node, consumers[node.target])
        norms += normed
        adds += added
    if norms:
        graph.lint()
        gm.recompile()
        logger.info("fuse_residual_norm: %d RMSNorm(s) into their GEMMs' prologues, %d residual add(s) into epilogues",
                    norms, adds)
    return gm
