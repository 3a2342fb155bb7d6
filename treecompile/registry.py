"""Layer registry and capability resolution.

Which HF layers treecompile can run as tree attention, and whether a given target + drafter + sampler can
run tree speculation at all, decided once at startup.

Registry
--------
:data:`ATTENTION_CLASSES` names the supported HF attention classes (``LlamaAttention``,
``Qwen2Attention``, ``Qwen3Attention``, ``MistralAttention``, the gated attention of Qwen3-Next and
Qwen3.5, Bamba's). :data:`LINEAR_ATTENTION_CLASSES` names the supported linear-attention layers (the gated
delta nets of Qwen3-Next and Qwen3.5; ``Mamba2Mixer`` and Bamba's ``BambaMixer``) together with the
module-level HF functions ("seams") their forward calls for the short conv and the recurrence, which the
FX pass replaces.
:func:`attention_layers` walks a model and classifies every attention-like module (any class whose name
says attention, mixer, SSM, delta net, ...): a registered class becomes an :class:`AttentionLayer` (or a
:class:`LinearAttentionLayer`, see :func:`linear_attention_layers`) with its geometry read off the module;
anything else is kept as *unrecognised* and refused later, never passed through (detect, don't assume: a
transformers release that renames a class or a seam must fail loudly, not run untouched attention).
Modules that merely contain recognised layers (``Mamba2Block``, ``Mamba2Model`` ...) are containers, not
layers; of nested unrecognised modules the innermost is reported.

Capability resolution
---------------------
Each backend declares what it supports for verify and for draft lanes (:class:`TreeSupport`: each side
supported, or refused with a reason). :func:`resolve_tree_support` composes the declarations over the
target's layers (verify), the drafter's layers (lanes) and the sampler once, and raises ONE
``ValueError`` listing every blocker, e.g.::

    tree speculation is not supported here (3 blockers):
      - target layer 0 (model.layers.0.self_attn, MistralAttention): sliding window 16 < max_seq_len 256 ...
      - target layer model.layers.3.self_attn (KimiLinearDeltaAttention): linear attention ... has no tree kernel
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
    "LINEAR_ATTENTION_CLASSES",
    "LinearAttentionLayer",
    "attention_layers",
    "linear_attention_layers",
    "resolve_tree_support",
    "GreedySampler",
    "PagedTreeAttentionBackend",
    "TreeLinearAttentionBackend",
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


def _heads_from_config(module: torch.nn.Module) -> int:
    # Gated attention (Qwen3-Next, Qwen3.5): q_proj also emits the output gate, so it is 2x the heads.
    return int(module.config.num_attention_heads)


@dataclasses.dataclass(frozen=True)
class _Entry:
    family: str
    sliding_window: Callable[[torch.nn.Module], int | None]
    num_heads: Callable[[torch.nn.Module], int] | None = None  # default: q_proj.out_features // head_dim


#: Supported HF attention classes, by class name (matched with the module's class and its defining
#: transformers module, so a same-named class from elsewhere is not mistaken for HF's).
ATTENTION_CLASSES: dict[str, _Entry] = {
    "LlamaAttention": _Entry("llama", lambda m: None),
    "Qwen2Attention": _Entry("qwen2", _window_from_attr),
    "Qwen3Attention": _Entry("qwen3", _window_from_attr),
    "MistralAttention": _Entry("mistral", _window_from_config),
    "Qwen3NextAttention": _Entry("qwen3_next", lambda m: None, _heads_from_config),
    "Qwen3_5Attention": _Entry("qwen3_5", lambda m: None, _heads_from_config),
    "BambaAttention": _Entry("bamba", lambda m: None),
}


@dataclasses.dataclass(frozen=True)
class _LinearEntry:
    """A supported linear-attention class: its family and the HF seams its forward calls.

    ``conv`` and ``recurrence`` are the module-level functions (in the class's own modeling module) the FX
    pass replaces; ``refused`` are seams that only appear when the layer runs with an HF cache or in
    training (the pass names them in its error instead of leaving them in the graph).
    """

    family: str  # "gdn" or "mamba2"
    conv: str
    recurrence: str
    refused: tuple[str, ...]


_GDN = _LinearEntry("gdn", "causal_conv1d_fn", "torch_chunk_gated_delta_rule",
                    ("causal_conv1d_update", "torch_recurrent_gated_delta_rule"))  # fmt: skip
_MAMBA2 = _LinearEntry(
    "mamba2", "causal_conv1d_fn", "mamba2_chunk_scan",
    ("causal_conv1d_update", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined"),
)  # fmt: skip

#: Supported HF linear-attention classes, by class name (same matching rule as ATTENTION_CLASSES).
LINEAR_ATTENTION_CLASSES: dict[str, _LinearEntry] = {
    "Qwen3NextGatedDeltaNet": _GDN,
    "Qwen3_5GatedDeltaNet": _GDN,
    "Mamba2Mixer": _MAMBA2,
    "BambaMixer": _MAMBA2,
}

#: Linear-attention / recurrent classes known to have no tree kernel, with what they are (the refusal says so).
_NO_TREE_KERNEL: dict[str, str] = {
    "KimiLinearDeltaAttention": "KDA, Kimi delta attention",
    "MiniMaxLightningAttention": "Lightning attention",
    "MambaMixer": "Mamba1 selective scan",
    "FalconMambaMixer": "Mamba1 selective scan",
    "JambaMambaMixer": "Mamba1 selective scan",
    "Lfm2ShortConv": "a gated short conv",
    "Lfm2MoeShortConv": "a gated short conv",
    "BailingHybridDeltaAttention": "a delta-rule linear attention",
}

# Anything whose class name says it mixes tokens: attention of any flavour, linear attention (GDN), SSMs,
# short convs with a conv state.
_ATTENTION_LIKE = re.compile(
    r"(Attention|Attn|DeltaNet|Mamba|Mixer|SSM|Recurrent|RetNet|RWKV|ShortConv|Lightning)", re.IGNORECASE
)
# Names that say "this layer keeps a recurrent state" (a refusal then says: no tree kernel for it).
_RECURRENT_LIKE = re.compile(r"(Delta|Mamba|Lightning|ShortConv|SSM|Recurrent|RetNet|RWKV)", re.IGNORECASE)
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


def _linear_entry(module: torch.nn.Module) -> _LinearEntry | None:
    cls = type(module)
    entry = LINEAR_ATTENTION_CLASSES.get(cls.__name__)
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

    @property
    def recurrent(self) -> bool:
        """Whether the class looks like linear attention / an SSM (keeps a state across tokens)."""
        module = self.module
        return (
            self.class_name in _NO_TREE_KERNEL
            or bool(_RECURRENT_LIKE.search(self.class_name))
            or any(hasattr(module, attr) for attr in ("A_log", "conv1d", "dt_bias"))
        )

    def describe(self) -> str:
        return f"{self.name} ({self.class_name})"


@dataclasses.dataclass(frozen=True)
class LinearAttentionLayer:
    """A recognised linear-attention layer (GDN or Mamba2) with the geometry its state pools need.

    index is the layer's state-pool index (order of appearance among the model's linear layers).
    Geometry, per family:

    ========== ============================= ================================
    field      GDN (gated delta net)          Mamba2
    ========== ============================= ================================
    num_heads  value heads Hv                 heads H
    head_dim   value head dim Dv              head dim P
    num_groups key heads Hk                   groups G
    key_dim    key head dim Dk                state size S_n
    state      ``[Hv, Dk, Dv]``               ``[H, P, S_n]``
    ========== ============================= ================================

    The short conv runs over ``conv_dim`` channels with ``conv_kernel`` taps. ``seams`` maps the names of
    the HF functions the forward calls (conv, recurrence, and the cache/training-only ones) to the function
    objects of the layer's modeling module; ``problems`` lists what could not be read (refused at startup).
    """

    index: int
    name: str
    module: torch.nn.Module
    family: str
    conv_dim: int
    conv_kernel: int
    conv_bias: bool
    activation: str | None
    num_heads: int
    head_dim: int
    num_groups: int
    key_dim: int
    dt_limit: tuple[float, float] | None
    conv_seam: str
    recurrence_seam: str
    seams: dict = dataclasses.field(compare=False, repr=False)
    problems: tuple[str, ...] = ()

    @property
    def class_name(self) -> str:
        return type(self.module).__name__

    def describe(self) -> str:
        return f"layer {self.index} ({self.name}, {self.class_name})"

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """Per-request recurrent state: GDN ``[Hv, Dk, Dv]``, Mamba2 ``[H, P, S_n]``."""
        if self.family == "gdn":
            return (self.num_heads, self.key_dim, self.head_dim)
        return (self.num_heads, self.head_dim, self.key_dim)

    @property
    def payload_width(self) -> int:
        """Elements of one replay payload row (``[k | v | g | beta]`` or ``[x | dt | a | B]``)."""
        if self.family == "gdn":
            from treecompile.ops.gdn_tree import gdn_payload_width

            return gdn_payload_width(self.num_groups, self.key_dim, self.num_heads, self.head_dim)
        from treecompile.ops.mamba2_tree import mamba2_payload_width

        return mamba2_payload_width(self.num_heads, self.head_dim, self.num_groups, self.key_dim)


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
        num_heads=entry.num_heads(module) if entry.num_heads is not None else q_out // head_dim,
        num_kv_heads=k_out // head_dim,
        head_dim=head_dim,
        scaling=float(getattr(module, "scaling", head_dim**-0.5)),
        sliding_window=entry.sliding_window(module),
        has_sinks=getattr(module, "sinks", None) is not None,
        softcap=getattr(config, "attn_logit_softcapping", None),
        attn_implementation=getattr(config, "_attn_implementation", None),
    )


# Module attributes each family's geometry is read from (HF's own names).
_LINEAR_ATTRS = {
    "gdn": ("num_v_heads", "head_v_dim", "num_k_heads", "head_k_dim"),
    "mamba2": ("num_heads", "head_dim", "n_groups", "ssm_state_size"),
}


def _kernel_func_target(fn):
    """The plain function behind an HF seam. With the ``kernels`` package (a dependency of transformers
    5.25) a hub-replaceable function such as ``causal_conv1d_fn`` is an ``nn.Module`` ("Func") whose
    ``forward`` calls the original function, kept in its closure as ``func``, unless a model was kernelized.
    Dynamo inlines the module call either way, so the seam the FX pass must see as one call node is that
    function; anything else is returned as is."""
    if not isinstance(fn, torch.nn.Module):
        return fn
    forward = getattr(type(fn), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None) or ()
    if code is None:
        return fn
    inner = dict(zip(code.co_freevars, (c.cell_contents for c in cells))).get("func")
    return inner if callable(inner) and not isinstance(inner, torch.nn.Module) else fn


def _classify_linear(index: int, name: str, module: torch.nn.Module, entry: _LinearEntry) -> LinearAttentionLayer:
    import sys

    problems = []
    geometry = []
    for attr in _LINEAR_ATTRS[entry.family]:
        value = getattr(module, attr, None)
        if not isinstance(value, int):
            problems.append(f"cannot read {attr} off the module (a transformers change?)")
            value = 0
        geometry.append(int(value))
    conv = getattr(module, "conv1d", None)
    if not isinstance(conv, torch.nn.Conv1d):
        problems.append("has no conv1d (nn.Conv1d) short conv")
        conv_dim, conv_kernel, conv_bias = 0, 0, False
    else:
        conv_dim, conv_kernel, conv_bias = conv.out_channels, conv.kernel_size[0], conv.bias is not None
        if conv.groups != conv.in_channels or conv.in_channels != conv.out_channels:
            problems.append(f"conv1d is not depthwise (groups {conv.groups}, channels {conv.in_channels})")
    modeling = sys.modules.get(type(module).__module__)
    seams = {}
    for seam in (entry.conv, entry.recurrence) + entry.refused:
        fn = _kernel_func_target(getattr(modeling, seam, None))
        if callable(fn):
            seams[seam] = fn
        elif seam in (entry.conv, entry.recurrence):
            problems.append(
                f"{type(module).__module__} has no {seam}() (the HF seam the FX pass replaces; renamed in this "
                "transformers release?)"
            )
    limit = getattr(module, "time_step_limit", None) if entry.family == "mamba2" else None
    return LinearAttentionLayer(
        index=index,
        name=name,
        module=module,
        family=entry.family,
        conv_dim=conv_dim,
        conv_kernel=conv_kernel,
        conv_bias=conv_bias,
        activation=getattr(module, "activation", None),
        num_heads=geometry[0],
        head_dim=geometry[1],
        num_groups=geometry[2],
        key_dim=geometry[3],
        dt_limit=tuple(float(x) for x in limit) if limit is not None else None,
        conv_seam=entry.conv,
        recurrence_seam=entry.recurrence,
        seams=seams,
        problems=tuple(problems),
    )


def _walk(model: torch.nn.Module):
    """(attention layers, linear-attention layers, unrecognised modules) of ``model``, in module order."""
    recognised: list[AttentionLayer] = []
    linear: list[LinearAttentionLayer] = []
    candidates: list[tuple[str, torch.nn.Module]] = []
    claimed: list[str] = []  # prefixes of classified modules: their children are parts, not layers
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in claimed):
            continue
        entry = _registry_entry(module)
        if entry is not None:
            recognised.append(_classify(len(recognised), name, module, entry))
            claimed.append(name)
            continue
        linear_entry = _linear_entry(module)
        if linear_entry is not None:
            linear.append(_classify_linear(len(linear), name, module, linear_entry))
            claimed.append(name)
            continue
        if getattr(module, "treespec_attention", False):  # treecompile's own layers (the drafter's)
            claimed.append(name)
            continue
        if is_attention_like(type(module)):
            candidates.append((name, module))

    def contains(outer: str, inner: str) -> bool:
        return outer != inner and (outer == "" or inner.startswith(outer + "."))

    # A candidate holding a recognised layer or another candidate is a container (Mamba2Block,
    # Mamba2Model, ...): the innermost unrecognised module is the layer to name.
    inner_names = [layer.name for layer in recognised + linear] + [name for name, _ in candidates]
    unrecognised = [
        UnrecognisedLayer(name, module)
        for name, module in candidates
        if not any(contains(name, other) for other in inner_names)
    ]
    return recognised, linear, unrecognised


def attention_layers(model: torch.nn.Module) -> tuple[list[AttentionLayer], list[UnrecognisedLayer]]:
    """Classify every attention-like module of ``model``.

    Returns
    -------
    (recognised, unrecognised): recognised attention layers in ``named_modules`` order, indexed 0.. (their
    cache index); unrecognised attention-like modules (innermost ones; containers of recognised layers are
    not layers). Recognised linear-attention layers are in neither list: see
    :func:`linear_attention_layers`.
    """
    recognised, _, unrecognised = _walk(model)
    return recognised, unrecognised


def linear_attention_layers(model: torch.nn.Module) -> list[LinearAttentionLayer]:
    """The recognised linear-attention layers (GDN, Mamba2) of ``model``, indexed 0.. (their state-pool
    index) in ``named_modules`` order."""
    return _walk(model)[1]


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


class TreeLinearAttentionBackend:
    """The target-side backend of a recognised GDN / Mamba2 layer: the FX pass replaces HF's conv and
    recurrence seams with ``treespec::causal_conv1d_tree_update`` + ``gdn_tree_verify`` /
    ``mamba2_tree_verify`` (``gdn_tree_verify_staged`` / ``mamba2_tree_verify_staged`` without replay)
    over binding-owned state pools. Verify only; target layers run no lanes."""

    name = "tree_linear_attention"

    def tree_support(
        self,
        layer: LinearAttentionLayer,
        *,
        replay_ssm: bool = True,
        state_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **_: object,
    ) -> TreeSupport:
        from treecompile.ops.conv_tree import SUPPORTED_CONV_WIDTHS
        from treecompile.ops.gdn_tree import MAX_HEAD_K_DIM
        from treecompile.ops.mamba2_tree import MAX_STATE_SIZE

        reasons = list(layer.problems)
        if layer.conv_kernel and layer.conv_kernel not in SUPPORTED_CONV_WIDTHS:
            reasons.append(
                f"conv kernel size {layer.conv_kernel} has no tree conv kernel (supported: {SUPPORTED_CONV_WIDTHS})"
            )
        if layer.activation not in (None, "silu", "swish"):
            reasons.append(f"conv activation {layer.activation!r} is not supported (silu or none)")
        if layer.num_groups <= 0 or layer.num_heads % max(layer.num_groups, 1) != 0:
            what = "key heads" if layer.family == "gdn" else "groups"
            reasons.append(f"{layer.num_heads} heads are not a multiple of {layer.num_groups} {what}")
        if layer.family == "gdn":
            if layer.key_dim > MAX_HEAD_K_DIM:
                reasons.append(f"key head dim {layer.key_dim} exceeds the GDN kernel's {MAX_HEAD_K_DIM}")
        elif layer.key_dim > MAX_STATE_SIZE:
            reasons.append(f"state size {layer.key_dim} exceeds the Mamba2 kernel's {MAX_STATE_SIZE}")
        if state_dtype is not None:
            on_cpu = device is None or torch.device(device).type == "cpu"
            allowed = (torch.float32, torch.float64) if on_cpu else (torch.float32,)
            if state_dtype not in allowed:
                reasons.append(
                    f"recurrent state dtype {state_dtype} is not supported (float32; float64 on CPU only)"
                )
        verify = Support.no("; ".join(reasons)) if reasons else Support.yes()
        return TreeSupport(verify=verify, lanes=Support.no("target layers run no draft lanes"))


class UnrecognisedBackend:
    """Stands for every attention-like class the registry does not know: refuses both sides."""

    name = "unrecognised"

    def tree_support(self, layer: UnrecognisedLayer, **_: object) -> TreeSupport:
        if layer.recurrent:
            what = _NO_TREE_KERNEL.get(layer.class_name, "a linear-attention / recurrent-state layer")
            known = ", ".join(sorted(LINEAR_ATTENTION_CLASSES))
            reason = (
                f"linear attention {layer.class_name} ({what}) has no tree kernel (supported linear "
                f"attention: {known})"
            )
        else:
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
    linear_layers: list[LinearAttentionLayer] = dataclasses.field(default_factory=list)


def resolve_tree_support(
    target: torch.nn.Module,
    drafter: object | None = None,
    *,
    sampler: object | None = None,
    do_sample: bool = False,
    max_seq_len: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    replay_ssm: bool = True,
    state_dtype: torch.dtype | None = None,
) -> ResolvedSupport:
    """Compose every backend's declaration over the target's and the drafter's layers, once.

    The drafter (optional) declares its own layers through ``drafter.tree_layers()``: an iterable of
    ``(description, TreeSupport)``; only their lane side is asked. ``replay_ssm`` and ``state_dtype`` are
    asked of the target's linear-attention layers (replay commit or the staged path; the recurrent state
    pools' dtype). Raises one ``ValueError`` listing every blocker; returns the recognised target layers
    otherwise.
    """
    blockers: list[str] = []
    recognised, linear_layers, unrecognised = _walk(target)
    paged = PagedTreeAttentionBackend()
    linear = TreeLinearAttentionBackend()
    unknown = UnrecognisedBackend()
    for layer in recognised:
        support = paged.tree_support(layer, max_seq_len=max_seq_len, device=device, dtype=dtype).verify
        if not support.ok:
            blockers.append(f"target {layer.describe()}: {support.reason}")
    for layer in linear_layers:
        support = linear.tree_support(layer, replay_ssm=replay_ssm, state_dtype=state_dtype, device=device).verify
        if not support.ok:
            blockers.append(f"target linear-attention {layer.describe()}: {support.reason}")
    for layer in unrecognised:
        blockers.append(f"target layer {layer.describe()}: {unknown.tree_support(layer).verify.reason}")
    if not recognised and not unrecognised and not linear_layers:
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
        "tree support resolved: %d target attention layers, %d linear-attention layers, %d draft layers, "
        "sampler %s", len(recognised), len(linear_layers), len(draft_layers), getattr(sampler, "name", sampler),
    )  # fmt: skip
    return ResolvedSupport(
        target_layers=recognised, draft_layers=draft_layers, sampler=sampler, linear_layers=linear_layers
    )


def _drafter_layers(drafter: object) -> Iterable[tuple[str, TreeSupport]]:
    layers = getattr(drafter, "tree_layers", None)
    if layers is None:
        return [(type(drafter).__name__, TreeSupport(Support.no("n/a"), Support.no(
            "drafter declares no tree_layers(); its lane support is unknown")))]
    return list(layers())
