"""Pass: delete what the rewrite left dead (HF's causal mask, repeat_kv copies), lint, recompile.

Dead-code elimination uses a conservative purity test (:func:`._graph.is_pure`): FX deems every
``call_method`` pure, but an in-place method whose result nobody reads still changes its operand.
``treespec::kv_write`` declares its mutation, so it is never removed. ``(gm, settings) -> gm``.
"""

from __future__ import annotations

import logging

import torch.fx

from ._graph import is_pure

logger = logging.getLogger(__name__)


def clean_up_graph(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code(is_impure_node=lambda node: not is_pure(node))
    gm.graph.lint()
    gm.recompile()
    logger.debug("clean_up_graph: %d -> %d nodes", before, len(gm.graph.nodes))
    return gm
