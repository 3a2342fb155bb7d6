"""treecompile: draft-tree speculative decoding as a property of an ordinary Hugging Face model.

``torch.compile(model, backend="treespec")`` rewrites attention and linear-attention layers into
tree-aware ``torch.ops.treespec`` custom ops; :class:`TreeSpeculator` drives EAGLE-style draft trees.
"""

from __future__ import annotations

import logging

from . import ops  # noqa: F401  registers torch.ops.treespec.*

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

_LAZY = {
    "DraftTree": ("treecompile.draft_tree", "DraftTree"),
    "TreeBatch": ("treecompile.draft_tree", "TreeBatch"),
    "TreeSpec": ("treecompile.tree_spec", "TreeSpec"),
    "tree_attention": ("treecompile.ops.tree_attention", "tree_attention"),
    "PagedKVCache": ("treecompile.kv_cache", "PagedKVCache"),
    "LaneState": ("treecompile.draft_tree", "LaneState"),
    "TreeSpeculator": ("treecompile.speculator", "TreeSpeculator"),
    "GenerateOutput": ("treecompile.speculator", "GenerateOutput"),
    "EagleDrafter": ("treecompile.drafter", "EagleDrafter"),
    "DraftContext": ("treecompile.drafter", "DraftContext"),
    "TargetBinding": ("treecompile.target", "TargetBinding"),
    "TargetRunner": ("treecompile.target", "TargetRunner"),
    "resolve_tree_support": ("treecompile.registry", "resolve_tree_support"),
    "load_smollm2": ("treecompile.models", "load_smollm2"),
}


def __getattr__(name: str):
    # Lazy so that `import treecompile` stays cheap and modules can land independently.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'treecompile' has no attribute {name!r}")
