"""On a CUDA graph, fold each layer's ``treespec::kv_write`` into its attention: ``tree_attention_paged_write``.

:mod:`.rewrite_attention` emits, per attention layer, ``kv_write(k_cache, v_cache, k, v, slots)`` followed by
``tree_attention_paged(q, k_cache, v_cache, ..., window=T, ...)``, the window being the T rows just written.
On CUDA the pair becomes one ``tree_attention_paged_write`` call whose window programs read those rows
directly and write them to the cache (:mod:`treecompile.ops.tree_attention`): one launch a layer fewer (the
separate ``kv_write`` kernel took ~1.2-1.4 us a layer on the H200, 30-32 layers a forward). The binding lays
rows out as the fused op's contract asks: row t of request b goes to the slot of key ``prefix_len[b] + t``,
padding rows to the dummy slot that no key maps to. CPU graphs keep the pair (their direct CPU calls,
:mod:`.direct_cpu_ops`). ``(gm, settings) -> gm``.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

logger = logging.getLogger(__name__)

_DEVICE_TYPES = ("cuda",)  # where the fused kernel runs (tests on a CPU-only machine add "cpu")


def fuse_cache_write(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    binding = getattr(settings, "binding", None)
    device = getattr(binding, "device", None)
    if device is None or device.type not in _DEVICE_TYPES or not getattr(gm, "treespec_rewritten", False):
        return gm
    _, T = gm.treespec_shape  # every layer's pair: B * T rows written, window T (rewrite_attention's layout)
    graph = gm.graph
    write_op, attn_op = torch.ops.treespec.kv_write.default, torch.ops.treespec.tree_attention_paged.default
    nodes = list(graph.nodes)
    fused = 0
    for i, write in enumerate(nodes):
        if write.op != "call_function" or write.target is not write_op or write.kwargs or len(write.args) != 5:
            continue
        k_cache, v_cache, k_rows, v_rows, slots = write.args
        attn = None
        for later in nodes[i + 1 :]:
            if later.op == "call_function" and later.target is attn_op:
                if later.args[1] is k_cache and later.args[2] is v_cache:
                    attn = later
                break  # the rewrite puts the layer's attention right after its write
        if attn is None or attn.kwargs or len(attn.args) != 9:
            continue
        q, _, _, page_table, prefix_len, mask, page_size, window, scale = attn.args
        if window != T:
            continue
        with graph.inserting_before(attn):
            node = graph.call_function(
                torch.ops.treespec.tree_attention_paged_write.default,
                (q, k_cache, v_cache, k_rows, v_rows, slots, page_table, prefix_len, mask, page_size, window, scale),
            )  # fmt: skip
        node.meta.update({k: v for k, v in attn.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
        attn.replace_all_uses_with(node)
        graph.erase_node(attn)
        graph.erase_node(write)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
        logger.info("fuse_cache_write: %d layer(s) -> treespec::tree_attention_paged_write", fused)
    return gm
