"""The ``treespec`` torch.compile backend.

Found through the ``torch_dynamo_backends`` entry point, so ``torch.compile(m, backend="treespec")``
needs no import. It runs the ordered pass list of :mod:`treecompile.passes` on the Dynamo graph, then
hands the graph to Inductor (honouring ``mode=``, e.g. ``"reduce-overhead"`` for CUDA graphs), or runs
it eagerly with ``options={"inductor": False}``.
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
    """

    inductor: bool = True
    inductor_options: dict = dataclasses.field(default_factory=dict)

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

    if mode not in _MODES:
        raise ValueError(f"treespec backend: mode must be one of {_MODES[1:]}, got {mode!r}")
    settings = TreespecOptions.parse(options)
    for graph_pass in PASSES:
        gm = graph_pass(gm, settings)
    if not settings.inductor:
        return gm.forward
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = dict(list_mode_options(mode or "default"))
    patches.update(settings.inductor_options)
    return compile_fx(gm, example_inputs, config_patches=patches)
