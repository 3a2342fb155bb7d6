"""The ``treespec`` torch.compile backend.

Found through the ``torch_dynamo_backends`` entry point, so ``torch.compile(m, backend="treespec")``
needs no import. It runs the ordered pass list of :mod:`treecompile.passes` on the Dynamo graph, then
hands the graph to Inductor (honouring ``mode=``, e.g. ``"reduce-overhead"`` for CUDA graphs), or runs
it eagerly with ``options={"inductor": False}``.

The attention pass needs a :class:`treecompile.target.TargetBinding` (the caches and metadata tensors the
rewritten graph reads): ``options={"binding": binding}``, or the binding active in
``treecompile.target.bound(binding)`` while the graph compiles. A graph with attention and no binding is
refused with a clear error (see :mod:`treecompile.target` for why the binding travels this way).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass
class TreespecOptions:
    """Options of the treespec backend (``torch.compile(..., options={...})``).

    inductor: hand the rewritten graph to Inductor (default) or run it as an eager GraphModule.
    inductor_options: extra Inductor config patches, passed through unchanged.
    binding: the TargetBinding the rewritten attention reads (default: the one active in
        ``treecompile.target.bound``).
    mode: the Inductor mode, for callers that pass options (``torch.compile`` refuses ``mode=`` and
        ``options=`` together); ``mode=`` itself wins when both reach the backend.
    """

    inductor: bool = True
    inductor_options: dict = dataclasses.field(default_factory=dict)
    binding: Any = None
    mode: str | None = None

    @classmethod
    def parse(cls, options: dict | None) -> "TreespecOptions":
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"treespec backend: unknown option(s) {unknown}; known options are {sorted(known)}"
            )
        return cls(**options)


def treespec_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    mode: str | None = None,
    options: dict | None = None,
) -> Callable:
    """Rewrite ``gm`` with the treespec passes, then compile it."""
    from treecompile.passes import PASSES
    from treecompile.target import active_binding

    settings = TreespecOptions.parse(options)
    mode = mode if mode is not None else settings.mode
    if mode not in _MODES:
        raise ValueError(f"treespec backend: mode must be one of {_MODES[1:]}, got {mode!r}")
    if settings.binding is None:
        settings.binding = active_binding()
    for graph_pass in PASSES:
        gm = graph_pass(gm, settings)
    if not settings.inductor:
        compiled = gm.forward
    else:
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        from treecompile.ops._common import inductor_patches

        patches = dict(list_mode_options(mode or "default"))
        cuda = next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None)
        if cuda is not None:  # dependent launches (Hopper) and combo kernels: ops/_common.inductor_patches
            patches.update(inductor_patches(cuda))
        patches.update(settings.inductor_options)
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    binding = settings.binding
    if binding is None or not getattr(gm, "treespec_rewritten", False):
        return compiled

    # Counting calls lets the runtime prove the rewritten graph ran (no silent eager fallback). Dynamo
    # calls the backend's result with positional tensors (Inductor's boxed convention stays inside it).
    def run(*args):
        binding.note_call()
        return compiled(*args)

    return run
