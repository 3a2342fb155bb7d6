"""Pass: prove the rewrite is complete before anything compiles.

After :mod:`.rewrite_attention`, a graph that had attention must hold no SDPA (or other attention) call,
and every layer the binding holds must have been rewritten exactly once: a layer missing from the graph
means the forward was split (a graph break) or the binding belongs to another model, and either would
run some attention the tree metadata never reaches. ``(gm, settings) -> gm``; raises ``ValueError``.
"""

from __future__ import annotations

import logging

import torch.fx

from ._graph import check_each_layer_once, is_other_attention, is_sdpa

logger = logging.getLogger(__name__)


def check_attention_rewritten(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    left = [n.name for n in gm.graph.nodes if is_sdpa(n) or is_other_attention(n)]
    if left:
        raise ValueError(f"treespec pass: attention calls left after the rewrite: {left}")
    if not getattr(gm, "treespec_rewritten", False):
        return gm
    binding = settings.binding
    done = list(gm.treespec_layers)
    check_each_layer_once("attention", done, [layer.name for layer in binding.layers])
    logger.debug("check_attention_rewritten: %d layers rewritten, no attention left", len(done))
    return gm
