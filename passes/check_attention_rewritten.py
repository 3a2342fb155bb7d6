"""Pass: prove the rewrite is complete before anything compiles.

After :mod:`.rewrite_attention`, a graph that had attention must hold no SDPA (or other attention) call,
and every layer the binding holds must have been rewritten exactly once: a layer missing from the graph
means the forward was split (a graph break) or the binding belongs to another model, and either would
run some attention the tree metadata never reaches. ``(gm, settings) -> gm``; raises ``ValueError``.
"""

from __future__ import annotations

import logging

import torch.fx

from ._graph import is_other_attention, is_sdpa

logger = logging.getLogger(__name__)


def check_attention_rewritten(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    left = [n.name for n in gm.graph.nodes if is_sdpa(n) or is_other_attention(n)]
    if left:
        raise ValueError(f"treespec pass: attention calls left after the rewrite: {left}")
    if not getattr(gm, "treespec_rewritten", False):
        return gm
    binding = settings.binding
    done = list(gm.treespec_layers)
    duplicated = sorted({name for name in done if done.count(name) > 1})
    missing = [layer.name for layer in binding.layers if layer.name not in done]
    if duplicated or missing:
        raise ValueError(
            f"treespec pass: the graph must rewrite each bound attention layer once; missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, duplicated {duplicated[:4]} (compile with fullgraph=True "
            "and a binding made for this model)"
        )
    logger.debug("check_attention_rewritten: %d layers rewritten, no attention left", len(done))
    return gm
