"""Sibling projections as one weight: q/k/v and gate/up of each decoder layer share storage.

A decoder layer runs its q, k and v projections (and its MLP's gate and up projections) as separate GEMMs
on the same input. For a small model each of those is a launch-bound kernel of a few microseconds (SmolLM2
on the H200: seven GEMMs a layer, ~3.5 us each, about half of a decode step), and a large model reads the
same bytes either way, so one GEMM per group is never worse. :func:`fuse_projection_weights` copies each
group's weights (and biases) into one contiguous tensor ``[sum of out_features, in_features]`` and makes
every member's parameter a view of its rows: the model's values, names and ``state_dict`` are unchanged and
no memory is added (the old per-member storage is released). The pass
:mod:`treecompile.passes.fuse_projections` then replaces the group's linear calls on one input by a single
linear over the fused tensor and a split.

The views hold only while nobody replaces the parameters' storage: ``model.to(...)``, ``model.half()`` or
assigning ``param.data`` after fusing breaks them, and :meth:`ProjectionGroup.check` says so (the runtime
calls it once per ``generate``; a captured graph would otherwise read the old storage).
Loading a state dict copies into the views and keeps them valid.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["GROUPS", "ProjectionGroup", "fuse_projection_weights"]

# (member attribute names) of one module whose linears read the same input in HF decoder layers.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclasses.dataclass
class ProjectionGroup:
    """One fused group: ``module`` is the owner's qualified name (``model.layers.0.self_attn``), ``members``
    its linear attribute names in order, ``sizes`` their out_features; ``weight [sum(sizes), in]`` and
    ``bias [sum(sizes)]`` (or None) the fused storage the members' parameters are views of."""

    module: str
    members: tuple[str, ...]
    sizes: tuple[int, ...]
    weight: torch.Tensor
    bias: torch.Tensor | None
    linears: tuple[nn.Linear, ...] = dataclasses.field(repr=False, default=())
    _views: tuple | None = dataclasses.field(init=False, repr=False, default=None, compare=False)  # intact()'s keys

    def member_names(self) -> tuple[str, ...]:
        return tuple(f"{self.module}.{m}" if self.module else m for m in self.members)

    def intact(self) -> bool:
        """Whether every member's weight (and bias) is still the view of the fused storage (host only).

        The runtime asks once per ``generate`` for every group (SmolLM2-135M: 60 groups, 150 members). A
        slice of the fused storage per member to compare against cost ~480 us of host time a request on the
        CPU machine, the same order as a batch-1 request's whole fixed cost on the H200 (~2.2 ms,
        ``tests/gpu/request_probe.py``, thirty-second session); the views' (pointer, shape, stride, dtype,
        device) are worked out once instead, and a check compares tuples."""
        if self._views is None:
            self._views = _view_keys(self.weight, self.sizes) + (
                _view_keys(self.bias, self.sizes) if self.bias is not None else ()
            )
        params = [_param(lin, "weight") for lin in self.linears]
        if self.bias is not None:
            params += [_param(lin, "bias") for lin in self.linears]
        return all(
            p is not None and (p.data_ptr(), p.shape, p.stride(), p.dtype, p.device) == key
            for p, key in zip(params, self._views)
        )

    def check(self) -> None:
        if not self.intact():
            raise ValueError(
                f"model: the weights of {self.module} ({', '.join(self.members)}) no longer share the storage "
                "treecompile fused them into (model.to(...), .half() or a param.data assignment after the "
                "speculator was built?); build a new TreeSpeculator for the changed model"
            )


def _param(lin: nn.Module, name: str) -> torch.Tensor | None:
    """``lin.<name>`` without ``nn.Module.__getattr__`` where it is a registered parameter (~10x cheaper)."""
    p = lin._parameters.get(name)
    return p if p is not None else getattr(lin, name, None)


def _view_keys(fused: torch.Tensor, sizes: tuple[int, ...]) -> tuple:
    """(data_ptr, shape, stride, dtype, device) of each member's view ``fused[row : row + size]``."""
    keys, row = [], 0
    for size in sizes:
        view = fused[row : row + size]
        keys.append((view.data_ptr(), view.shape, view.stride(), view.dtype, view.device))
        row += size
    return tuple(keys)


def _fusable(linears: list) -> bool:
    if not all(type(lin) is nn.Linear for lin in linears):  # subclasses (quantised linears) keep their own code
        return False
    first = linears[0].weight
    if first.device.type == "meta":
        return False
    same = all(
        lin.in_features == linears[0].in_features and lin.weight.dtype == first.dtype
        and lin.weight.device == first.device and lin.weight.is_contiguous()
        for lin in linears
    )  # fmt: skip
    has_bias = {lin.bias is not None for lin in linears}
    return same and len(has_bias) == 1


@torch.no_grad()
def fuse_projection_weights(model: nn.Module) -> list[ProjectionGroup]:
    """Fuse every q/k/v and gate/up group of ``model`` in place (module docstring); returns the groups.

    A group is fused only when all its members are plain ``nn.Linear`` with one in_features, dtype and
    device and all or none of them have a bias; anything else stays as it is (the pass then leaves those
    linears alone). Fusing again returns the existing groups while their storage is alive and still viewed
    (a speculator or drafter holds it), and lays the weights out afresh otherwise.
    """
    groups: list[ProjectionGroup] = []
    for name, module in model.named_modules():
        for members in GROUPS:
            linears = [getattr(module, m, None) for m in members]
            if any(lin is None for lin in linears) or not _fusable(linears):
                continue
            sizes = tuple(lin.out_features for lin in linears)
            w0 = linears[0].weight
            refs = getattr(w0, "_treecompile_fused", None)
            if refs is not None:  # fused before: reuse the storage if it is alive and still viewed
                old_w, old_b = refs[0](), refs[1]() if refs[1] is not None else None
                old = ProjectionGroup(name, members, sizes, old_w, old_b, tuple(linears)) if old_w is not None else None
                if old is not None and old.intact():
                    groups.append(old)
                    continue
            weight = torch.empty(sum(sizes), linears[0].in_features, dtype=w0.dtype, device=w0.device)
            bias = None
            if linears[0].bias is not None:
                bias = torch.empty(sum(sizes), dtype=linears[0].bias.dtype, device=w0.device)
            group = ProjectionGroup(name, members, sizes, weight, bias, tuple(linears))
            row = 0
            for lin, size in zip(linears, sizes):
                weight[row : row + size].copy_(lin.weight)
                lin.weight.data = weight[row : row + size]
                if bias is not None:
                    bias[row : row + size].copy_(lin.bias)
                    lin.bias.data = bias[row : row + size]
                # Weak: after model.to(...) the parameters must not keep the old fused storage alive.
                lin.weight._treecompile_fused = (weakref.ref(weight), weakref.ref(bias) if bias is not None else None)
                row += size
            groups.append(group)
    logger.info("fused %d projection group(s) into one weight each", len(groups))
    return groups
