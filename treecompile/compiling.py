"""Compiling per-instance copies of module-level functions.

Dynamo keeps its cache entries (and its recompile limit) per code object. Compiling the same module-level
function for every speculator / tree / shape would queue all their shapes behind one code object's guards,
share one recompile limit (past it Dynamo silently runs eager), and keep a dead instance's entries alive.
A renamed copy of the code object per instance avoids all three (TargetRunner, DraftHooks, DraftTree).
"""

from __future__ import annotations

import types
from typing import Callable

import torch

__all__ = ["private_copy", "compile_inference"]


def private_copy(fn: types.FunctionType, name: str) -> types.FunctionType:
    """``fn`` on its own code object named ``name`` (same globals, defaults and behaviour)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__)


def compile_inference(fn: types.FunctionType, name: str, **compile_kwargs) -> Callable:
    """Inductor-compiled private copy of ``fn`` (``dynamic=False`` unless given) that always runs under
    ``no_grad``: with grad on, Inductor would build a joint graph the treespec ops cannot serve."""
    compile_kwargs.setdefault("dynamic", False)
    if "mode" not in compile_kwargs and "backend" not in compile_kwargs:
        from treecompile.ops._common import inductor_pdl_patch

        patch = inductor_pdl_patch()  # Hopper: Inductor's kernels as dependent launches, like treecompile's
        if patch:
            compile_kwargs["options"] = {**patch, **compile_kwargs.get("options", {})}
    compiled = torch.compile(private_copy(fn, name), **compile_kwargs)

    def call(*args):
        with torch.no_grad():
            return compiled(*args)

    return call
