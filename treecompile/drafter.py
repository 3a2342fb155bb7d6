"""EagleDrafter: an EAGLE-3 draft head that drafts chains and tree lanes over its own paged cache.

Architecture (EAGLE-3, the public checkpoint layout)
----------------------------------------------------
- ``fc``: ``Linear(3 * H_target, H)`` fuses the target's low / mid / high hidden states (HF
  ``hidden_states`` indices ``aux_layers``; EAGLE's default ``(2, L // 2, L - 3)``).
- ``midlayer``: one decoder layer whose attention input is ``[input_layernorm(embed(token)) ;
  hidden_norm(hidden)]`` (2H wide); the residual is the hidden input. Its attention writes and reads the
  draft cache through ``treespec::kv_write`` / ``treespec::tree_attention_paged`` (our own module, no FX).
- ``norm`` + ``lm_head`` over a draft vocabulary; ``d2t`` maps draft ids to target ids
  (``target_id = draft_id + d2t[draft_id]``), ``t2d`` marks target ids in the draft vocabulary.
- The token embedding is the target's (EAGLE-3 checkpoints do not ship one) unless the checkpoint has
  ``embed_tokens.weight``.

Pairs and positions: draft position p holds the pair (target hidden at p, token at p + 1); its output
predicts the token at p + 2. Step 0 is the chain forward over the pairs the last verify accepted; the last
one sits at ``vc - 1`` and scores the depth-1 candidates. Lane step s (1 .. S-1) runs K rows at position
``vc - 1 + s``, writing draft slot ``vc + (s-1) * K + r``, over the cascade with R = K rows, the prefix
``[0, vc)`` and the ``(S-1) * K``-key lane window (each row sees its ancestors only).

:meth:`score_candidates` is the one place the drafter decides how to score (log-probs of the top-k over
the draft vocabulary, mapped to target ids); the tree machinery does not care who scored.

Shapes: B requests, T chain rows, K lanes, H hidden, Vd draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import types

import torch
from torch import nn

from treecompile.kv_cache import PagedKVCache
from treecompile.ops._common import env_switch
from treecompile.ops.draft_topk import MAX_K as MAX_TOPK
from treecompile.ops.fused_mlp import fold_norm_wanted, mlp_applies
from treecompile.registry import Support, TreeSupport

logger = logging.getLogger(__name__)

__all__ = ["EagleDrafter", "DraftContext", "default_aux_layers"]


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high taps as HF ``hidden_states`` indices (input of layers 2, L//2, L-3), clamped
    to real layer outputs for tiny models (index L would be the final-normed state)."""
    taps = (2, num_layers // 2, num_layers - 3)
    return tuple(min(max(t, 1), num_layers - 1) if num_layers > 1 else 0 for t in taps)


@dataclasses.dataclass
class DraftContext:
    """What a round knows that a scoring hook might want (the EAGLE head reads none of it; a test oracle
    that scores with the target reads the token history).

    history : int64 [B, capacity]  committed tokens; ``history[b, vc[b]]`` is the root (current token)
    vc : int64 [B]                 committed target length (the root's position)
    lane_tokens : int64 [B, (S-1)*K]  tokens of the lanes run so far this round, at their lane slots
    step : int                     the draft step being scored (0 for the chain step)
    """

    history: torch.Tensor
    vc: torch.Tensor
    lane_tokens: torch.Tensor
    step: int = 0


def _rows_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through ``linear_rows`` (installed by :meth:`EagleDrafter.skinny_linears`)."""
    from treecompile.ops.skinny_linear import linear_rows

    return linear_rows(x, self.weight, self.bias, constant_weight=True)  # a module's own parameters


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


DRAFT_FOLD_ENV = "TREECOMPILE_DRAFT_FOLD"


class EagleAttention(nn.Module):
    """The midlayer's attention: 2H-wide input, GQA, RoPE, paged tree attention over the draft cache."""

    treespec_attention = True  # treecompile's own layer: the registry does not treat it as unrecognised

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = getattr(config, "sliding_window", None)
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by EagleDrafter.fuse_projections (not a parameter)
        self.linear = nn.functional.linear  # the fused GEMM's function (EagleDrafter.skinny_linears swaps it)

    def forward(self, x, cos, sin, cache, slots, prefix_len, ancestor_mask, window, window_offset=None):
        B, T, _ = x.shape
        if self.qkv_weight is not None:  # one GEMM over the q/k/v rows the three parameters view
            sizes = (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features)
            q, k, v = self.linear(x, self.qkv_weight).split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if window_offset is not None:  # the rows are window keys [offset, offset + T): one op writes and attends
            out = cache.write_attention(0, q.contiguous(), k, v, slots, ancestor_mask, window, self.scaling,
                                        prefix_len, window_offset)  # fmt: skip
        else:
            cache.write(0, k, v, slots)
            out = cache.attention(0, q.contiguous(), ancestor_mask, window, self.scaling, prefix_len)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class EagleMLP(nn.Module):
    """The midlayer's gated MLP (HF LlamaMLP's parameters and names), with a fused gate/up path."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act in ("silu", "swish")  # the fused op's activation
        self.gate_up_weight: torch.Tensor | None = None  # set by EagleDrafter.fuse_projections
        self.linear = nn.functional.linear  # the fused GEMM's function (EagleDrafter.skinny_linears swaps it)
        self.fused_mlp = False  # EagleDrafter.skinny_linears: treespec::fused_mlp where it applies and pays

    def fused(self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None):
        """``treespec::fused_mlp`` of ``x`` (with ``norm``: of ``norm(x + residual)``, the RMSNorm inside the op)
        when :meth:`EagleDrafter.skinny_linears` turned it on and ``mlp_applies`` holds for these tensors
        (static metadata: 16-bit CUDA, <= 16 rows, a measured win or ``TREECOMPILE_FUSED_MLP=1``), else None."""
        if not (self.fused_mlp and self.silu):
            return None
        if self.gate_up_weight is not None:
            gate, up = self.gate_up_weight.chunk(2, dim=0)  # views of the fused [2I, H] weight
        else:
            gate, up = self.gate_proj.weight, self.up_proj.weight
        if not mlp_applies(x, gate, up, self.down_proj.weight):
            return None
        H = x.shape[-1]
        rows = x.reshape(-1, H)
        if norm is None:
            out = torch.ops.treespec.fused_mlp(rows, gate, up, self.down_proj.weight, True)
        else:
            res = residual.reshape(-1, H) if residual is not None else None
            out = torch.ops.treespec.fused_mlp(rows, gate, up, self.down_proj.weight, True, norm.weight, res,
                                               float(norm.variance_epsilon))  # fmt: skip
        return out.reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fused(x)
        if out is not None:
            return out
        if self.gate_up_weight is not None:
            gate, up = self.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class EagleDecoderLayer(nn.Module):
    """EAGLE-3's midlayer: attention over [embedding ; hidden], residual on the hidden input, then MLP."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = EagleAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = EagleMLP(config)

    def forward(self, embeds, hidden, cos, sin, cache, slots, prefix_len, ancestor_mask, window, window_offset=None):
        residual = hidden
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        attn = self.self_attn(x, cos, sin, cache, slots, prefix_len, ancestor_mask, window, window_offset)
        if fold_norm_wanted():  # the residual add and post-attention norm inside treespec::fused_mlp, where it runs
            out = self.mlp.fused(residual, self.post_attention_layernorm, attn)
            if out is not None:
                return (residual + attn) + out
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _attention_shape(tcfg) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) of the head's decoder layer: the target's attention shape, or, for a
    target without attention (pure Mamba2: its head_dim is the SSM's), heads of 64 channels."""
    heads = getattr(tcfg, "num_attention_heads", None)
    if heads:
        head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads
        return heads, getattr(tcfg, "num_key_value_heads", None) or heads, head_dim
    head_dim = 64 if tcfg.hidden_size % 64 == 0 else tcfg.hidden_size
    heads = tcfg.hidden_size // head_dim
    return heads, heads, head_dim


class EagleDrafter(nn.Module):
    """EAGLE-3 draft head (see the module docstring).

    Parameters
    ----------
    config : a ``LlamaConfig`` of the head (hidden_size, heads, head_dim, intermediate_size, rms_norm_eps,
        rope parameters, ``draft_vocab_size``, ``vocab_size`` = the target's vocabulary).
    target_hidden_size : H_target, the width of each fused target hidden state.
    aux_layers : the three HF ``hidden_states`` indices of the target that ``fc`` fuses.
    embed_tokens : the target's token embedding (shared, not owned) when the head has none of its own.
    """

    def __init__(
        self,
        config,
        target_hidden_size: int,
        aux_layers: tuple[int, ...],
        embed_tokens: nn.Embedding | None = None,
        own_embedding: bool = False,
    ) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.config = config
        self.hidden_size = config.hidden_size
        self.target_hidden_size = target_hidden_size
        self.aux_layers = tuple(int(i) for i in aux_layers)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = nn.Linear(len(self.aux_layers) * target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = EagleDecoderLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, self.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        # The draft cache's write inside the attention op (one launch fewer a step). Off by default until
        # the GPU has run it (TREECOMPILE_DRAFT_FOLD=1 turns it on for A/B runs); the CPU path is the same two ops.
        self.fold_cache_write = env_switch(DRAFT_FOLD_ENV, False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            if embed_tokens is None:
                raise ValueError("embed_tokens: a head without its own embedding needs the target's")
            if embed_tokens.embedding_dim != config.hidden_size:
                raise ValueError(
                    f"drafter hidden size {config.hidden_size} does not match the target's embedding width "
                    f"{embed_tokens.embedding_dim}: an EAGLE-3 head shares the target's token embedding"
                )
            object.__setattr__(self, "_target_embed", embed_tokens)  # shared, so not a registered child

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def for_target(
        cls,
        model: nn.Module,
        seed: int = 0,
        draft_vocab_size: int | None = None,
        aux_layers: tuple[int, ...] | None = None,
    ) -> "EagleDrafter":
        """A randomly initialised head sized for ``model`` (tests, and the start of training).

        The draft vocabulary is the target's first ``draft_vocab_size`` ids (all of them by default).
        """
        from transformers import LlamaConfig

        tcfg = model.config
        vocab = tcfg.vocab_size
        draft_vocab_size = vocab if draft_vocab_size is None else int(draft_vocab_size)
        if not 1 <= draft_vocab_size <= vocab:
            raise ValueError(f"draft_vocab_size: must be in 1..{vocab} (the target's vocabulary), got {draft_vocab_size}")
        heads, kv_heads, head_dim = _attention_shape(tcfg)
        intermediate = getattr(tcfg, "intermediate_size", None) or 4 * tcfg.hidden_size
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=tcfg.hidden_size, intermediate_size=intermediate,
            num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6), hidden_act=getattr(tcfg, "hidden_act", "silu"),
            max_position_embeddings=getattr(tcfg, "max_position_embeddings", 4096),
            rope_parameters=dict(getattr(tcfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
            draft_vocab_size=draft_vocab_size,
        )  # fmt: skip
        layers = aux_layers or default_aux_layers(tcfg.num_hidden_layers)
        param = next(model.parameters())
        generator = torch.Generator().manual_seed(seed)
        head = cls(config, tcfg.hidden_size, layers, embed_tokens=model.get_input_embeddings())
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    continue  # RMSNorm weights stay 1
                p.copy_(torch.randn(p.shape, generator=generator) * (p.shape[-1] ** -0.5))
            head.t2d[:draft_vocab_size] = True
        return head.to(device=param.device, dtype=param.dtype)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        target: nn.Module,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> "EagleDrafter":
        """Load a public EAGLE-3 checkpoint directory (``config.json`` + ``model.safetensors`` or
        ``pytorch_model.bin`` with ``midlayer.*``, ``fc.*``, ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d``)."""
        from transformers import LlamaConfig

        path = os.fspath(path)
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"path: {path!r} has no config.json (expected an EAGLE-3 checkpoint directory)")
        with open(config_path) as f:
            raw = json.load(f)
        raw.pop("architectures", None)
        config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        state = _load_state_dict(path)
        tcfg = target.config
        target_hidden = int(raw.get("target_hidden_size") or tcfg.hidden_size)
        if target_hidden != tcfg.hidden_size:
            raise ValueError(
                f"drafter target_hidden_size {target_hidden} does not match the target's hidden size "
                f"{tcfg.hidden_size}"
            )
        eagle = raw.get("eagle_config") or {}
        if eagle.get("eagle_aux_hidden_state_layer_ids"):  # layer outputs -> hidden_states indices
            aux = tuple(int(i) + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"])
        else:
            aux = default_aux_layers(tcfg.num_hidden_layers)
        fc = state.get("fc.weight")
        if fc is not None and fc.shape[1] != len(aux) * tcfg.hidden_size:
            raise ValueError(
                f"drafter fc.weight takes {fc.shape[1]} features but the target's {len(aux)} fused hidden "
                f"states are {len(aux)} x {tcfg.hidden_size} = {len(aux) * tcfg.hidden_size}: hidden size mismatch"
            )
        if config.vocab_size != tcfg.vocab_size:
            raise ValueError(f"drafter vocab_size {config.vocab_size} does not match the target's {tcfg.vocab_size}")
        own = "embed_tokens.weight" in state
        from_target = bool(raw.get("lm_head_from_target", False))
        if from_target and "lm_head.weight" in state:
            raise ValueError(f"EAGLE-3 checkpoint {path!r}: config says lm_head_from_target but the file holds "
                             "lm_head.weight; drop one of them")  # fmt: skip
        if raw.get("lm_head_int8", False):
            state = dict(state)
            state["lm_head.weight"] = _dequantize_lm_head(path, state, from_target)
        elif "lm_head.weight_scale" in state:
            raise ValueError(f"EAGLE-3 checkpoint {path!r}: the file holds lm_head.weight_scale but the config does "
                             "not say lm_head_int8")  # fmt: skip
        head = cls(config, tcfg.hidden_size, aux, embed_tokens=None if own else target.get_input_embeddings(),
                   own_embedding=own)  # fmt: skip
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("rotary_emb.")]
        if from_target and "d2t" not in missing:  # the target's own output rows over the draft vocabulary
            missing.remove("lm_head.weight")
            with torch.no_grad():
                head.lm_head.weight.copy_(target_lm_head_rows(target, head.d2t, head.hidden_size))
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 checkpoint {path!r}: missing weights {missing}, unexpected weights {unexpected}")
        param = next(target.parameters())
        return head.to(device=device or param.device, dtype=dtype or param.dtype)

    # -- capability ----------------------------------------------------------------------------------------

    def tree_layers(self):
        """This head's layers with their tree support (lanes only: a drafter is never verified)."""
        attn = self.midlayer.self_attn
        lanes = Support.yes()
        if attn.sliding_window is not None:
            lanes = Support.no(f"sliding window {attn.sliding_window} in a draft layer (frozen-window lanes are not implemented)")
        return [("layer 0 (midlayer.self_attn, EagleAttention)", TreeSupport(Support.no("draft layers are not verified"), lanes))]

    # -- pieces --------------------------------------------------------------------------------------------

    @property
    def embed(self) -> nn.Embedding:
        return self.embed_tokens if "embed_tokens" in self._modules else self._target_embed

    def fuse_projections(self) -> None:
        """Lay the midlayer's q/k/v and gate/up weights out as one tensor each (the parameters become views
        of it: same values and state dict, no extra memory; :mod:`treecompile.projections`) and run each
        group as one GEMM. Idempotent; ``model.to(...)`` afterwards drops back to the separate GEMMs."""
        from treecompile.projections import fuse_projection_weights

        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        groups = {g.module: g for g in fuse_projection_weights(self.midlayer)}
        qkv, gate_up = groups.get("self_attn"), groups.get("mlp")
        attn.qkv_weight = qkv.weight if qkv is not None and qkv.bias is None else None
        mlp.gate_up_weight = gate_up.weight if gate_up is not None and gate_up.bias is None else None

    def pack_linears(self) -> None:
        """Run the head's ``nn.Linear`` modules (fc, the midlayer's projections, lm_head) on oneDNN-packed
        weights when they are float32 on the CPU (:mod:`treecompile.packed_linear`); on any other device or
        dtype they keep running ``F.linear``. Idempotent. The fused q/k/v and gate/up weights of
        :meth:`fuse_projections` stay plain GEMMs."""
        from treecompile.packed_linear import pack_module_linears

        pack_module_linears(self)

    def skinny_linears(self) -> None:
        """Run the head's GEMMs (its ``nn.Linear`` modules and the fused q/k/v and gate/up weights) through
        :func:`treecompile.ops.skinny_linear.linear_rows`: Triton tiles for 16-bit CUDA inputs of <= 256 rows
        (a draft step's K lanes), ``F.linear`` otherwise; and the gated MLP through ``treespec::fused_mlp``
        where :func:`treecompile.ops.fused_mlp.mlp_applies` holds (16-bit CUDA, <= 16 rows, a measured win or
        ``TREECOMPILE_FUSED_MLP=1``). Idempotent."""
        from treecompile.ops.skinny_linear import linear_rows

        rows = functools.partial(linear_rows, constant_weight=True)  # the fused weights are constants
        self.midlayer.self_attn.linear = rows
        self.midlayer.mlp.linear = rows
        self.midlayer.mlp.fused_mlp = True  # the gated MLP as one treespec::fused_mlp call where it was measured faster
        count = 0
        for sub in self.modules():
            if type(sub) is nn.Linear:
                sub.forward = types.MethodType(_rows_forward, sub)
                count += 1
        logger.info("skinny_linears: the head's %d linear(s) and fused projections run linear_rows", count)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .half() give every parameter new storage: the fused views would be stale, so drop them.
        self.midlayer.self_attn.qkv_weight = None
        self.midlayer.mlp.gate_up_weight = None
        return super()._apply(fn, *args, **kwargs)

    def new_cache(self, max_batch: int, max_seq_len: int, page_size: int = 64, device=None) -> PagedKVCache:
        """A draft cache for this head (one layer)."""
        attn = self.midlayer.self_attn
        param = self.lm_head.weight
        return PagedKVCache(
            1, attn.num_kv_heads, attn.head_dim, max_batch, max_seq_len, page_size=page_size,
            dtype=param.dtype, device=device or param.device,
        )  # fmt: skip

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """``[.., len(aux_layers) * H_target] -> [.., H]``: fuse the target's hidden states."""
        return self.fc(features)

    def forward_rows(
        self, cache, hidden, tokens, positions, slots, prefix_len, ancestor_mask, window, window_offset: int | None = 0
    ):  # fmt: skip
        """One midlayer forward over rows: ``hidden [B, T, H]`` (fused target states or the head's own
        previous output), ``tokens/positions/slots [B, T]``, ``prefix_len [B]``, ``ancestor_mask [B, T]``
        -> ``[B, T, H]`` (pre-norm output, fed back as the next step's hidden). The rows' keys are window
        keys ``[window_offset, window_offset + T)``: with :attr:`fold_cache_write` (and an offset, not None) the
        cache write rides in the attention's window programs (``tree_attention_paged_write``), one launch fewer
        a step."""
        embeds = self.embed(tokens).to(hidden.dtype)
        cos, sin = self.rope(hidden, positions)
        offset = window_offset if self.fold_cache_write else None  # None: a separate write, then the attention
        return self.midlayer(embeds, hidden, cos, sin, cache, slots, prefix_len, ancestor_mask, window, offset)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, T]`` -> ``(cos, sin) [B, T, D]`` in ``x.dtype``: HF's rotary embedding, with the
        frequencies as an elementwise product. transformers 5.17 forms ``inv_freq @ positions`` as a float32
        matmul with K = 1, a GEMM launch of ~2.8 us per draft step on the H200 (6 a round); one float32 product
        per element is the same value (one rounding either way) and fuses into the step's kernels. RoPE types
        that change their frequencies with the sequence length (dynamic, longrope) keep HF's module."""
        rot = self.rotary_emb
        rope_type = str(getattr(rot, "rope_type", "default"))
        if "dynamic" in rope_type or rope_type == "longrope":
            return rot(x, positions)
        freqs = positions[..., None].float() * rot.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = rot.attention_scaling
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[.., H] -> [.., Vd]`` draft-vocabulary logits."""
        return self.lm_head(self.norm(hidden))

    def score_candidates(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The one scoring method: ``logits [.., Vd] -> (logp [.., k], target token ids [.., k])``, the
        log-probs of the top-k over the draft vocabulary (float32 at least), best first."""
        if logits.is_cuda and logits.dtype != torch.float64 and k <= MAX_TOPK:
            # One pass over the vocabulary for the local top-k and the log-sum-exp, a tiny merge: ~10 us
            # where log_softmax + torch.topk took ~65 us on a 32k draft vocabulary (ops/draft_topk.py).
            # The kernel maps draft ids to target ids (d2t) in its store: no gather kernel after it.
            logp, index = torch.ops.treespec.draft_topk(logits.reshape(-1, logits.shape[-1]), k, self.d2t)
            shape = (*logits.shape[:-1], k)
            return logp.view(shape), index.view(shape)
        work = torch.promote_types(logits.dtype, torch.float32)
        logp, index = torch.topk(torch.log_softmax(logits.to(work), dim=-1), k, dim=-1)
        return logp, index + self.d2t[index]

    # -- the hooks a round calls (a scoring oracle may override them) -----------------------------------

    @property
    def reads_draft_context(self) -> bool:
        """Whether the round must fill :class:`DraftContext` (``lane_tokens``, a copy kernel a lane step): the
        EAGLE head reads none of it, a subclass that overrides a hook (a scoring oracle) may."""
        cls = type(self)
        return any(getattr(cls, name) is not getattr(EagleDrafter, name) for name in ("draft_step0", "draft_lanes"))

    @property
    def gathers_parents(self) -> bool:
        """Whether :meth:`draft_lanes` may be handed ``parent_lane`` (this class's own hook, not an override
        with the older signature)."""
        return type(self).draft_lanes is EagleDrafter.draft_lanes

    def draft_step0(self, cache, features, tokens, positions, slots, prefix_len, ancestor_mask, last_row, context):
        """Step 0, the chain forward over the pending pairs: ``features [B, T, 3H]`` -> the last valid row's
        ``(hidden [B, H], logits [B, Vd])``; ``last_row [B]`` indexes it."""
        T = tokens.shape[1]
        hidden = self.forward_rows(cache, self.project(features), tokens, positions, slots, prefix_len, ancestor_mask, T)
        idx = last_row.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        last = hidden.gather(1, idx).squeeze(1)
        return last, self.logits(last)

    def draft_lanes(self, cache, hidden, tokens, positions, slots, prefix_len, ancestor_mask, window, context,
                    parent_lane=None):  # fmt: skip
        """One lane step: ``hidden/tokens [B, K, ..]`` -> ``(hidden [B, K, H], logits [B, K, Vd])``. With
        ``parent_lane int64 [B, K]``, ``hidden`` is the previous step's rows ``[B, K', H]`` and lane k continues
        row ``parent_lane[:, k]``: the gather then fuses into the step's first kernels (no launch of its own)."""
        if parent_lane is not None:
            hidden = hidden.gather(1, parent_lane[:, :, None].expand(*parent_lane.shape, hidden.shape[-1]))
        # Step s writes lane columns [(s - 1) K, s K); without a context the columns are unknown: no fold.
        offset = None if context is None else (context.step - 1) * tokens.shape[1]
        out = self.forward_rows(cache, hidden, tokens, positions, slots, prefix_len, ancestor_mask, window, offset)
        return out, self.logits(out)

    def draft_prefill(self, cache, features, tokens, positions, slots, prefix_len, ancestor_mask) -> None:
        """Write the draft cache for a chunk of prompt pairs (outputs unused)."""
        T = tokens.shape[1]
        self.forward_rows(cache, self.project(features), tokens, positions, slots, prefix_len, ancestor_mask, T)


def _dequantize_lm_head(path: str, state: dict, from_target: bool) -> torch.Tensor:
    """``lm_head.weight`` int8 ``[V, H]`` x ``lm_head.weight_scale`` ``[V]`` -> float32 ``[V, H]`` (a head
    exported with ``lm_head_int8``; ``treecompile.train.quantize_rows_int8`` wrote them). Pops the scale."""
    if from_target:
        raise ValueError(f"EAGLE-3 checkpoint {path!r}: config says both lm_head_int8 and lm_head_from_target; "
                         "drop one of them")  # fmt: skip
    weight, scale = state.get("lm_head.weight"), state.pop("lm_head.weight_scale", None)
    if weight is None or scale is None or weight.dtype != torch.int8:
        raise ValueError(f"EAGLE-3 checkpoint {path!r}: config says lm_head_int8 but the file holds "
                         f"lm_head.weight {None if weight is None else weight.dtype} and "
                         f"lm_head.weight_scale {None if scale is None else tuple(scale.shape)}; expected int8 rows "
                         "and one scale a row")  # fmt: skip
    if weight.dim() != 2 or tuple(scale.shape) != (weight.shape[0],):
        raise ValueError(f"EAGLE-3 checkpoint {path!r}: lm_head.weight_scale has shape {tuple(scale.shape)}, "
                         f"expected ({weight.shape[0]},) for lm_head.weight {tuple(weight.shape)}")  # fmt: skip
    return weight.float() * scale.float()[:, None]


def target_lm_head_rows(target: nn.Module, d2t: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """``[Vd, H]``: the target's output-embedding rows of the draft vocabulary (``arange(Vd) + d2t``), for a
    head whose lm_head is the target's own (``"lm_head_from_target"`` in its config). A target without an
    output embedding of width H is refused by name."""
    out = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    if weight is None or weight.dim() != 2 or weight.shape[1] != hidden_size:
        shape = None if weight is None else tuple(weight.shape)
        raise ValueError(f"target: a head with lm_head_from_target needs the target's output embedding [V, {hidden_size}], "
                         f"got {shape}")  # fmt: skip
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]:
        raise ValueError(f"d2t: draft ids must lie in the target's vocabulary 0..{weight.shape[0] - 1}")
    return weight.detach()[ids.to(weight.device)]


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    names = sorted(os.listdir(path))
    tensors = [n for n in names if n.endswith(".safetensors")]
    if tensors:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for name in tensors:
            state.update(load_file(os.path.join(path, name)))
        return state
    bins = [n for n in names if n.endswith(".bin") and n.startswith("pytorch_model")]
    if bins:
        state = {}
        for name in bins:
            state.update(torch.load(os.path.join(path, name), map_location="cpu", weights_only=True))
        return state
    raise ValueError(f"path: {path!r} holds no model.safetensors or pytorch_model.bin")
