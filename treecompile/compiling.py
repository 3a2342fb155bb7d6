"""Compiling per-instance copies of module-level functions.

Dynamo keeps its cache entries (and its recompile limit) per code object. Compiling the same module-level
function for every speculator / tree / shape would queue all their shapes behind one code object's guards,
share one recompile limit (past it Dynamo silently runs eager), and keep a dead instance's entries alive.
A renamed copy of the code object per instance avoids all three (TargetRunner, DraftHooks, DraftTree), and a
copy per batch size (``key=batch_key``) keeps a speculator serving any number of batch sizes under the limit.
"""

from __future__ import annotations

import types
from typing import Callable

import torch

__all__ = ["private_copy", "compile_inference", "batch_key"]


def private_copy(fn: types.FunctionType, name: str) -> types.FunctionType:
    """``fn`` on its own code object named ``name`` (same globals, defaults and behaviour)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__)


def compile_inference(fn: types.FunctionType, name: str, key: Callable | None = None, **compile_kwargs) -> Callable:
    """Inductor-compiled private copy of ``fn`` (``dynamic=False`` unless given) that always runs under
    ``no_grad``: with grad on, Inductor would build a joint graph the treespec ops cannot serve.

    ``key(*args)`` (optional, hashable) gives each key its own private copy, compiled at its first call, as
    :class:`treecompile.target.TargetRunner` does per shape. Keyed by batch size, a speculator serving many
    batch sizes never reaches Dynamo's recompile limit (8 a code object): past it a ``fullgraph`` compile raises
    and any other silently runs eager."""
    compile_kwargs.setdefault("dynamic", False)
    if "mode" not in compile_kwargs and "backend" not in compile_kwargs:
        from treecompile.ops._common import inductor_patches

        patch = inductor_patches()  # dependent launches (Hopper) and combo kernels, like the target's compile
        if patch:
            compile_kwargs["options"] = {**patch, **compile_kwargs.get("options", {})}
    if key is None:
        compiled = torch.compile(private_copy(fn, name), **compile_kwargs)

        def call(*args):
            with torch.no_grad():
                return compiled(*args)

        return call

    variants: dict = {}

    def call_keyed(*args):
        if torch.compiler.is_compiling():  # traced inside a larger compiled region (a whole draft round): inline
            return fn(*args)
        k = key(*args)
        compiled = variants.get(k)
        if compiled is None:
            compiled = variants[k] = torch.compile(private_copy(fn, f"{name}_v{len(variants)}"), **compile_kwargs)
        with torch.no_grad():
            return compiled(*args)

    return call_keyed


def batch_key(*args) -> tuple:
    """The first tensor argument's leading size and rank, and the ``step`` of any argument that has one (a
    ``DraftContext``): what a ``dynamic=False`` compile of a round's functions specializes on as batch sizes and
    draft steps change (the rest of their arguments is fixed for a speculator)."""
    lead = next(((a.shape[0] if a.dim() else 0, a.dim()) for a in args if isinstance(a, torch.Tensor)), None)
    steps = tuple(a.step for a in args if not isinstance(a, torch.Tensor) and type(getattr(a, "step", None)) is int)
    return (lead, steps)
