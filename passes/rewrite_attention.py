"""Pass: replace each HF attention layer's SDPA call with treecompile's paged tree attention.

Input: the Dynamo graph of an HF causal LM called with ``use_cache=False`` and explicit ``position_ids``
(the queries and keys therefore already carry the round's RoPE positions: ``vc + depth``). For every
``scaled_dot_product_attention`` node the pass

1. locates the layer from ``nn_module_stack`` (innermost attention module) and looks it up in the
   binding (:class:`treecompile.target.TargetBinding`, whose layers came from the registry); an SDPA call
   inside an unrecognised class, or anywhere outside a recognised layer, is refused;
2. walks the key/value inputs back through HF's ``repeat_kv`` (GQA expansion) to the ``[B, Hkv, T, D]``
   tensors the layer computed;
3. emits ``treespec::kv_write(k_cache[l], v_cache[l], k [B*T, Hkv, D], v, slots)`` and
   ``treespec::tree_attention_paged(q [B, T, Hq, D], k_cache[l], v_cache[l], page_table[:B],
   prefix_len[:B], ancestor_mask[:B, :T], page_size, T, scale)`` and substitutes its transposed output
   ``[B, Hq, T, D]`` for the SDPA result. HF's own causal / packed-sequence mask then has no users and
   the clean-up pass deletes it.

The cache and metadata tensors enter the graph as buffers registered on the GraphModule (``get_attr``),
the binding's own tensors, never copies (see :mod:`treecompile.target` for why). Shapes must be static
(``dynamic=False``): B and T are baked into the slices and the op's ``window``.

``(gm, settings) -> gm``; logs how many layers it rewrote. A graph without any attention passes through.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from treecompile.registry import ATTENTION_CLASSES, is_attention_like

from ._graph import (
    example_dtype, example_shape, is_other_attention, is_repeat_step, is_sdpa, module_stack, register_constant,
    static_size,
)

logger = logging.getLogger(__name__)

_PREFIX = "_treespec_"


def _attention_scope(node: torch.fx.Node) -> tuple[str, type] | None:
    """Innermost module on the node's stack whose class looks like attention (registered or not)."""
    for path, cls in reversed(module_stack(node)):
        if cls.__name__ in ATTENTION_CLASSES or is_attention_like(cls):
            return path, cls
    return None


def _kv_source(node: torch.fx.Node, num_kv_heads: int) -> torch.fx.Node:
    """Undo HF's repeat_kv: walk shape-only steps back to the layer's own ``[B, Hkv, T, D]`` K or V."""
    cur = node
    for _ in range(8):
        shape = example_shape(cur)
        if shape is not None and len(shape) == 4 and shape[1] == num_kv_heads:
            return cur
        if not (isinstance(cur, torch.fx.Node) and is_repeat_step(cur)):
            break
        cur = cur.args[0]
    raise ValueError(
        f"treespec pass: cannot trace SDPA input {node.name} back to a [B, {num_kv_heads}, T, D] key/value "
        "tensor of the layer (an unexpected GQA expansion?)"
    )


def _sdpa_inputs(node: torch.fx.Node):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def rewrite_attention(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    graph = gm.graph
    sites = []
    recognised_scopes: dict[str, type] = {}
    for node in graph.nodes:
        for path, cls in module_stack(node):
            if cls.__name__ in ATTENTION_CLASSES:
                recognised_scopes[path] = cls
        if is_sdpa(node) or is_other_attention(node):
            scope = _attention_scope(node)
            if scope is None or scope[1].__name__ not in ATTENTION_CLASSES:
                where = f"inside {scope[1].__name__} ({scope[0]})" if scope else "outside any attention module"
                known = ", ".join(sorted(ATTENTION_CLASSES))
                raise ValueError(
                    f"treespec pass: attention call {node.name} ({node.target}) {where}: unrecognised "
                    f"attention class, refused (supported: {known})"
                )
            if not is_sdpa(node):
                raise ValueError(
                    f"treespec pass: layer {scope[0]} ({scope[1].__name__}) calls {node.target}, not SDPA; "
                    "load the model with attn_implementation='sdpa'"
                )
            sites.append((node, scope[0]))

    if not sites and not recognised_scopes:
        logger.debug("rewrite_attention: no attention in this graph; nothing to rewrite")
        return gm
    binding = getattr(settings, "binding", None)
    if binding is None:
        raise ValueError(
            f"treespec backend: this graph has {max(len(sites), len(recognised_scopes))} attention layer(s) "
            "but no TargetBinding to read caches and tree metadata from. Use treecompile.TreeSpeculator, "
            "or compile with options={'binding': TargetBinding(model, ...)} (or inside "
            "treecompile.target.bound(binding)); refusing to leave HF's attention untouched"
        )
    with_sdpa = {scope for _, scope in sites}
    missing = sorted(set(recognised_scopes) - with_sdpa)
    if missing:
        raise ValueError(
            f"treespec pass: no SDPA call found in attention layer(s) {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} (attn_implementation 'eager'?); load the model with "
            "attn_implementation='sdpa'"
        )

    # Register the binding's tensors on the GraphModule (the same storage, no copies).
    for name, tensor in binding.graph_tensors().items():
        register_constant(gm, _PREFIX + name, tensor)

    first = sites[0][0]
    q_shape = example_shape(_sdpa_inputs(first)["query"])
    if q_shape is None or len(q_shape) != 4:
        raise ValueError(f"treespec pass: SDPA query {first.name} has no static 4-d shape metadata")
    B = static_size("batch size", q_shape[0])
    T = static_size("rows per forward", q_shape[2])
    if B > binding.max_batch or T > binding.max_rows:
        raise ValueError(
            f"treespec pass: the forward has B={B} requests x T={T} rows but the binding holds "
            f"max_batch={binding.max_batch} x max_rows={binding.max_rows}"
        )
    with graph.inserting_before(first):
        page_table = graph.get_attr(_PREFIX + "page_table")
        page_table = graph.call_function(operator.getitem, (page_table, slice(None, B)))
        prefix_len = graph.get_attr(_PREFIX + "prefix_len")
        prefix_len = graph.call_function(operator.getitem, (prefix_len, slice(None, B)))
        mask = graph.get_attr(_PREFIX + "ancestor_mask")
        mask = graph.call_function(operator.getitem, (mask, (slice(None, B), slice(None, T))))
        slots = graph.get_attr(_PREFIX + "slots")
        slots = graph.call_function(operator.getitem, (slots, (slice(None, B), slice(None, T))))
        slots = graph.call_method("reshape", (slots, B * T))

    rewritten = []
    for node, scope in sites:
        layer = binding.layer_for(scope)
        if layer is None:
            raise ValueError(
                f"treespec pass: attention layer {scope} is not one the binding holds "
                f"({[l.name for l in binding.layers][:4]} ...): the binding was made for another model"
            )
        inputs = _sdpa_inputs(node)
        q = inputs["query"]
        shape = example_shape(q)
        if shape is None or (shape[0], shape[2]) != (B, T):
            raise ValueError(f"treespec pass: layer {scope}: query shape {shape} differs from [B={B}, ., T={T}, .]")
        Hq, D = shape[1], shape[3]
        if (Hq, D) != (layer.num_heads, layer.head_dim):
            raise ValueError(
                f"treespec pass: layer {scope}: query has {Hq} heads x {D} dims, the layer declares "
                f"{layer.num_heads} x {layer.head_dim}"
            )
        k = _kv_source(inputs["key"], layer.num_kv_heads)
        v = _kv_source(inputs["value"], layer.num_kv_heads)
        for name, t in (("key", k), ("value", v)):
            if example_shape(t) != (B, layer.num_kv_heads, T, D):
                raise ValueError(
                    f"treespec pass: layer {scope}: {name} has shape {example_shape(t)}, expected "
                    f"[{B}, {layer.num_kv_heads}, {T}, {D}]. Was the model called with an HF cache? Call it "
                    "with use_cache=False: treecompile owns the KV cache"
                )
        dropout = inputs.get("dropout_p", 0.0)
        if dropout not in (0, 0.0):
            raise ValueError(f"treespec pass: layer {scope}: attention dropout {dropout} (model in training mode?)")
        scale = inputs.get("scale")
        scale = D**-0.5 if scale is None else scale
        if not isinstance(scale, (int, float)):
            raise ValueError(f"treespec pass: layer {scope}: the attention scale must be a constant, got {scale}")
        if example_dtype(q) != binding.cache.dtype:
            raise ValueError(
                f"treespec pass: layer {scope}: queries are {example_dtype(q)} but the binding's cache is "
                f"{binding.cache.dtype}"
            )

        with graph.inserting_before(node):
            k_cache = graph.get_attr(f"{_PREFIX}k{layer.index}")
            v_cache = graph.get_attr(f"{_PREFIX}v{layer.index}")
            k_rows = graph.call_method("reshape", (graph.call_method("transpose", (k, 1, 2)), B * T, -1, D))
            v_rows = graph.call_method("reshape", (graph.call_method("transpose", (v, 1, 2)), B * T, -1, D))
            graph.call_function(torch.ops.treespec.kv_write.default, (k_cache, v_cache, k_rows, v_rows, slots))
            q_rows = graph.call_method("contiguous", (graph.call_method("transpose", (q, 1, 2)),))
            out = graph.call_function(
                torch.ops.treespec.tree_attention_paged.default,
                (q_rows, k_cache, v_cache, page_table, prefix_len, mask, binding.page_size, T, float(scale)),
            )
            out = graph.call_method("transpose", (out, 1, 2))
        for new in _nodes_between(k_cache, out):
            new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
            new.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten.append(layer.name)

    gm.treespec_rewritten = True
    gm.treespec_layers = rewritten
    gm.treespec_shape = (B, T)
    logger.info("rewrite_attention: %d attention layer(s) -> treespec::kv_write + tree_attention_paged "
                "(B=%d, T=%d)", len(rewritten), B, T)  # fmt: skip
    return gm


def _nodes_between(first: torch.fx.Node, last: torch.fx.Node):
    node = first
    while True:
        yield node
        if node is last:
            return
        node = node.next
