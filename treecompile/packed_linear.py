"""Linears on oneDNN-packed weights: the CPU path's GEMMs for the few-row forwards of speculation.

A verify forward multiplies N = 8..24 rows by every weight of the model. On the CPU that is a small-M GEMM,
and MKL's ``sgemm`` (what ``F.linear`` runs) is slow there on the AMD CPU of this project's CI VM: a 24-row
SmolLM2 forward took 2.3x a 1-row one although it reads the same weights. oneDNN's matmul on a weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` /
``_linear_pointwise``, the pair Inductor's CPU weight prepacking uses) ran the same forwards far faster
(SmolLM2 float32, 2 threads, the model's own forward with a 200-key cache: 1 row 120 -> 96 ms, 6 rows 232 ->
131 ms, 24 rows 274 -> 209 ms; same argmax, logits within 7e-5).

:func:`packed_linear` computes ``x @ weight.T + bias`` on a packed copy of ``weight`` that is re-packed
whenever the weight tensor it is given changes (another storage, an in-place write: the version counter),
so a packed copy never goes stale; one copy per weight serves every compiled graph. It packs float32 CPU
weights only (oneDNN has no float64 matmul) and runs ``F.linear`` for anything else. The copy costs the
weight's memory once more.

Used by the pass :mod:`treecompile.passes.pack_cpu_linears` (the target's linears, inside the rewritten
graph: the user's model and HF's own ``generate`` stay untouched) and by :func:`pack_module_linears` (the
drafter's ``nn.Linear`` modules, which are treecompile's own).
"""

from __future__ import annotations

import logging
import types
import weakref

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["can_pack", "is_packed", "pack_module_linears", "packed_linear", "packed_weight", "packing_available"]


def packing_available() -> bool:
    """Whether this torch build has oneDNN (mkldnn) and its linear prepacking ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`packed_linear` packs ``weight`` (a 2-D float32 CPU tensor)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


# id(weight) -> (weakref to the weight, key, packed copy): one packed copy per weight, shared by every graph
# and speculator that runs it, dropped with the weight.
# Keyed by id, not by the tensor: tensor == tensor is elementwise, so tensors cannot be dict keys by value.
_PACKED: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of ``weight`` (float32 CPU), packed again when the tensor changed since (data
    pointer, shape or version counter)."""
    key = (weight.data_ptr(), tuple(weight.shape), weight._version)
    entry = _PACKED.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1] == key:
        return entry[2]
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    if entry is None or entry[0]() is not weight:
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
    _PACKED[id(weight)] = (weakref.ref(weight), key, packed)
    return packed


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [.., in] @ weight [out, in].T + bias [out]`` on the packed copy of weight (:func:`packed_weight`).

    The weight comes in with every call, so its packed copy follows it; the check is a few host reads per
    call (this path never runs under CUDA graphs). Anything but float32 on the CPU runs ``F.linear``, and so
    does a call traced by torch.compile (a drafter packed by an eager speculator, then traced by an Inductor
    one): Inductor packs CPU weights itself, and the cache is host-side Python. So does a call that autograd
    records (grad mode on and an input or parameter requiring grad, e.g. training a head a speculator packed):
    ``_linear_pointwise`` has no backward, so gradients would silently not flow, and it ran ~100x slower on
    inputs that require grad (a [1, 576] x [8192, 576] call: ~110 ms against ~1 ms).
    """
    records_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if (
        records_grad
        or torch.compiler.is_compiling()
        or not (can_pack(weight) and x.dtype == torch.float32 and x.device.type == "cpu")
    ):
        return nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight(weight), bias, "none", [], "")


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, self.weight, self.bias)


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` that :func:`pack_module_linears` set to run :func:`packed_linear`."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _packed_forward


def pack_module_linears(module: nn.Module) -> int:
    """Run every plain ``nn.Linear`` of ``module`` (not subclasses: quantised linears keep their code) through
    :func:`packed_linear`; returns how many. Idempotent. Packing happens at the first call and follows the
    weights afterwards; on another device or dtype (``module.to(...)``) the linears run ``F.linear``."""
    count = 0
    for sub in module.modules():
        if type(sub) is not nn.Linear:
            continue
        if not is_packed(sub):
            sub.forward = types.MethodType(_packed_forward, sub)
        count += 1
    logger.info("packed_linears: %d linear(s) run on oneDNN-packed weights", count)
    return count
