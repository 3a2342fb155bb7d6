"""Layer registry and capability resolution.

Which HF layers treecompile can run as tree attention, and whether a given target + drafter + sampler can
run tree speculation at all, decided once at startup.

Registry
--------
:data:`ATTENTION_CLASSES` names the supported HF attention classes (``LlamaAttention``,
``Qwen2Attention``, ``Qwen3Attention``, ``MistralAttention``). :func:`attention_layers` walks a model and
classifies every attention-like module (any class whose name says attention, mixer, SSM, delta net, ...):
a registered class becomes an :class:`AttentionLayer` with its geometry read off the module; anything else
is kept as *unrecognised* and refused later, never passed through (detect, don't assume: a transformers
release that renames a class must fail loudly, not run untouched attention).

Capability resolution
---------------------
Each backend declares what it supports for verify and for draft lanes (:class:`TreeSupport`: each side
supported, or refused with a reason). :func:`resolve_tree_support` composes the declarations over the
target's layers (verify), the drafter's layers (lanes) and the sampler once, and raises ONE
``ValueError`` listing every blocker, e.g.::

    tree speculation is not supported here (3 blockers):
      - target layer 0 (model.layers.0.self_attn, MistralAttention): sliding window 16 < max_seq_len 256 ...
      - target layer 3 (model.layers.3.linear_attn, Qwen3NextGatedDeltaNet): unrecognised attention class ...
      - sampler greedy: greedy-only, asked to sample (supports_tree_verify False for do_sample=True)

Sliding window and attention sinks are per layer (seed 000, "Scope"): a window that covers every key the
cache can hold (``sliding_window >= max_seq_len``) never clips anything and is allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable, Iterable

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_CLASSES",
    "AttentionLayer",
    "Support",
    "TreeSupport",
    "UnrecognisedLayer",
    "attention_layers",
    "resolve_tree_support",
    "GreedySampler",
    "PagedTreeAttentionBackend",
]


# ---------------------------------------------------------------------------------------------------------
# Capability declarations
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Support:
    """One capability: supported, or refused with a reason."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> "Support":
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> "Support":
        return cls(False, reason)


@dataclasses.dataclass(frozen=True)
class TreeSupport:
    """What a backend supports for tree verify (target layers) and for draft lanes (drafter layers)."""

    verify: Support
    lanes: Support


# ---------------------------------------------------------------------------------------------------------
# The layer registry
# ---------------------------------------------------------------------------------------------------------


def _window_from_attr(module: torch.nn.Module) -> int | None:
    # Qwen2/Qwen3 set `sliding_window` per layer (None unless layer_types says "sliding_attention").
    return getattr(module, "sliding_window", None)


def _window_from_config(module: torch.nn.Module) -> int | None:
    # Mistral reads the window from the config in every layer.
    return getattr(getattr(module, "config", None), "sliding_window", None)


@dataclasses.dataclass(frozen=True)
class _Entry:
    family: str
    sliding_window: Callable[[torch.nn.Module], int | None]


#: Supported HF attention classes, by class name (matched with the module's class and its defining
#: transformers module, so a same-named class from elsewhere is not mistaken for HF's).
ATTENTION_CLASSES: dict[str, _Entry] = {
    "LlamaAttention": _Entry("llama", lambda m: None),
    "Qwen2Attention": _Entry("qwen2", _window_from_attr),
    "Qwen3Attention": _Entry("qwen3", _window_from_attr),
    "MistralAttention": _Entry("mistral", _window_from_config),
}

# Anything whose class name says it mixes tokens: attention of any flavour, linear attention (GDN), SSMs.
_ATTENTION_LIKE = re.compile(r"(Attention|Attn|DeltaNet|Mamba|Mixer|SSM|Recurrent|RetNet|RWKV)", re.IGNORECASE)
_NOT_ATTENTION = re.compile(r"(RotaryEmbedding|Norm|MLP|Embedding$)", re.IGNORECASE)


def is_attention_like(cls: type) -> bool:
    """Whether a module class mixes tokens (attention, linear attention, SSM ...), judged by its name."""
    return bool(_ATTENTION_LIKE.search(cls.__name__)) and not _NOT_ATTENTION.search(cls.__name__)


def _registry_entry(module: torch.nn.Module) -> _Entry | None:
    cls = type(module)
    entry = ATTENTION_CLASSES.get(cls.__name__)
    if entry is None or not cls.__module__.startswith("transformers.models."):
        return None
    return entry


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """A recognised attention layer of a model, with the geometry the rewritten graph needs.

    index is the layer's cache index (order of appearance among the model's attention layers).
    """

    index: int
    name: str
    module: torch.nn.Module
    family: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None
    has_sinks: bool
    softcap: float | None
    attn_implementation: str | None

    @property
    def class_name(self) -> str:
        return type(self.module).__name__

    def describe(self) -> str:
        return f"layer {self.index} ({self.name}, {self.class_name})"


@dataclasses.dataclass(frozen=True)
class UnrecognisedLayer:
    """An attention-like module whose class treecompile does not know; always refused."""

    name: str
    module: torch.nn.Module

    @property
    def class_name(self) -> str:
        return type(self.module).__name__

    def describe(self) -> str:
        return f"{self.name} ({self.class_name})"


def _classify(index: int, name: str, module: torch.nn.Module, entry: _Entry) -> AttentionLayer:
    config = getattr(module, "config", None)
    head_dim = int(getattr(module, "head_dim"))
    q_out = module.q_proj.out_features
    k_out = module.k_proj.out_features
    return AttentionLayer(
        index=index,
        name=name,
        module=module,
        family=entry.family,
        num_heads=q_out // head_dim,
        num_kv_heads=k_out // head_dim,
        head_dim=head_dim,
        scaling=float(getattr(module, "scaling", head_dim**-0.5)),
        sliding_window=entry.sliding_window(module),
        has_sinks=getattr(module, "sinks", None) is not None,
        softcap=getattr(config, "attn_logit_softcapping", None),
        attn_implementation=getattr(config, "_attn_implementation", None),
    )


def attention_layers(model: torch.nn.Module) -> tuple[list[AttentionLayer], list[UnrecognisedLayer]]:
    """Classify every attention-like module of ``model``.

    Returns
    -------
    (recognised, unrecognised): recognised layers in ``named_modules`` order, indexed 0.. (their cache
    index); unrecognised attention-like modules (their submodules are not visited).
    """
    recognised: list[AttentionLayer] = []
    unrecognised: list[UnrecognisedLayer] = []
    claimed: list[str] = []  # prefixes of classified modules: their children are parts, not layers
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in claimed):
            continue
        entry = _registry_entry(module)
        if entry is not None:
            recognised.append(_classify(len(recognised), name, module, entry))
            claimed.append(name)
            continue
        if getattr(module, "treespec_attention", False):  # treecompile's own layers (the drafter's)
            claimed.append(name)
            continue
        if is_attention_like(type(module)):
            unrecognised.append(UnrecognisedLayer(name, module))
            claimed.append(name)
    return recognised, unrecognised


# ---------------------------------------------------------------------------------------------------------
# Backends and their declarations
# ---------------------------------------------------------------------------------------------------------


class PagedTreeAttentionBackend:
    """The target-side backend: a recognised HF attention layer rewritten to ``treespec::kv_write`` +
    ``treespec::tree_attention_paged`` by the FX pass. Verify only; target layers run no lanes."""

    name = "paged_tree_attention"

    def tree_support(
        self,
        layer: AttentionLayer,
        *,
        max_seq_len: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> TreeSupport:
        reasons = []
        window = layer.sliding_window
        if window is not None and (max_seq_len is None or window < max_seq_len):
            cap = "an unknown cache length" if max_seq_len is None else f"max_seq_len {max_seq_len}"
            reasons.append(f"sliding window {window} in a target layer (active: {window} < {cap})")
        if layer.has_sinks:
            reasons.append("attention sinks in a target layer")
        if layer.softcap is not None:
            reasons.append(f"attention logit softcapping ({layer.softcap}) is not supported")
        if layer.attn_implementation not in (None, "sdpa"):
            reasons.append(
                f"attention implementation {layer.attn_implementation!r}: the FX pass rewrites SDPA calls; "
                "load the model with attn_implementation='sdpa'"
            )
        if device is not None and torch.device(device).type == "cuda":
            from treecompile.ops.tree_attention import KERNEL_HEAD_DIMS

            if layer.head_dim not in KERNEL_HEAD_DIMS:
                reasons.append(f"head_dim {layer.head_dim} has no CUDA kernel (supported: {KERNEL_HEAD_DIMS})")
            if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
                reasons.append(f"dtype {dtype} has no CUDA kernel (bf16, fp16, fp32)")
        verify = Support.no("; ".join(reasons)) if reasons else Support.yes()
        return TreeSupport(verify=verify, lanes=Support.no("target layers run no draft lanes"))


class UnrecognisedBackend:
    """Stands for every attention-like class the registry does not know: refuses both sides."""

    name = "unrecognised"

    def tree_support(self, layer: UnrecognisedLayer, **_: object) -> TreeSupport:
        known = ", ".join(sorted(ATTENTION_CLASSES))
        reason = f"unrecognised attention class {layer.class_name} (supported: {known})"
        return TreeSupport(verify=Support.no(reason), lanes=Support.no(reason))


class GreedySampler:
    """The greedy verify backend: walks the tree accepting children equal to the target's argmax."""

    name = "greedy"
    supports_tree_verify = True

    def tree_support(self, *, do_sample: bool = False) -> TreeSupport:
        if do_sample:
            return TreeSupport(
                verify=Support.no("greedy-only, asked to sample (supports_tree_verify False for do_sample=True)"),
                lanes=Support.no("a sampler runs no lanes"),
            )
        return TreeSupport(verify=Support.yes(), lanes=Support.no("a sampler runs no lanes"))


@dataclasses.dataclass
class ResolvedSupport:
    """The outcome of :func:`resolve_tree_support` when nothing blocks."""

    target_layers: list[AttentionLayer]
    draft_layers: list
    sampler: object


def resolve_tree_support(
    target: torch.nn.Module,
    drafter: object | None = None,
    *,
    sampler: object | None = None,
    do_sample: bool = False,
    max_seq_len: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> ResolvedSupport:
    """Compose every backend's declaration over the target's and the drafter's layers, once.

    The drafter (optional) declares its own layers through ``drafter.tree_layers()``: an iterable of
    ``(description, TreeSupport)``; only their lane side is asked. Raises one ``ValueError`` listing every
    blocker; returns the recognised target layers otherwise.
    """
    blockers: list[str] = []
    recognised, unrecognised = attention_layers(target)
    paged = PagedTreeAttentionBackend()
    unknown = UnrecognisedBackend()
    for layer in recognised:
        support = paged.tree_support(layer, max_seq_len=max_seq_len, device=device, dtype=dtype).verify
        if not support.ok:
            blockers.append(f"target {layer.describe()}: {support.reason}")
    for layer in unrecognised:
        blockers.append(f"target layer {layer.describe()}: {unknown.tree_support(layer).verify.reason}")
    if not recognised and not unrecognised:
        blockers.append(f"target {type(target).__name__}: no attention layer found")

    draft_layers: list = []
    if drafter is not None:
        for description, support in _drafter_layers(drafter):
            draft_layers.append(description)
            if not support.lanes.ok:
                blockers.append(f"draft {description}: {support.lanes.reason}")

    sampler = sampler if sampler is not None else GreedySampler()
    verdict = sampler.tree_support(do_sample=do_sample).verify
    if not verdict.ok:
        blockers.append(f"sampler {getattr(sampler, 'name', type(sampler).__name__)}: {verdict.reason}")

    if blockers:
        listing = "\n".join(f"  - {b}" for b in blockers)
        raise ValueError(
            f"tree speculation is not supported here ({len(blockers)} blocker"
            f"{'s' if len(blockers) != 1 else ''}):\n{listing}"
        )
    logger.debug(
        "tree support resolved: %d target attention layers, %d draft layers, sampler %s",
        len(recognised), len(draft_layers), getattr(sampler, "name", sampler),
    )  # fmt: skip
    return ResolvedSupport(target_layers=recognised, draft_layers=draft_layers, sampler=sampler)


def _drafter_layers(drafter: object) -> Iterable[tuple[str, TreeSupport]]:
    layers = getattr(drafter, "tree_layers", None)
    if layers is None:
        return [(type(drafter).__name__, TreeSupport(Support.no("n/a"), Support.no(
            "drafter declares no tree_layers(); its lane support is unknown")))]
    return list(layers())
