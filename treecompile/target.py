"""The target side of a round: the binding the rewritten graph reads, and the runner that calls it.

How the rewritten graph reaches treecompile's caches and per-round metadata
---------------------------------------------------------------------------
A :class:`TargetBinding` owns the target's paged KV cache and the per-forward metadata tensors
(``prefix_len [max_B]``, ``ancestor_mask [max_B, max_rows]``, ``slots [max_B, max_rows]``, the cache's
``page_table``). The FX pass registers those very tensors on the Dynamo GraphModule as buffers and reads
them through ``get_attr`` nodes, so the compiled graph holds them at fixed addresses (what CUDA graphs need);
before every forward the runtime writes the next metadata into them in place (:meth:`TargetBinding.load`).
Under Inductor, the buffers are lifted as module state and ``kv_write``'s declared mutation is written
back into the same cache storage.

The binding reaches the backend at compile time either as ``options={"binding": binding}`` or as the
binding active in :func:`bound` (a context manager). The first form is preferred: each ``torch.compile``
call makes its own backend callable and Dynamo guards cache entries on the backend's identity, so a
compiled graph can never serve a different binding's tensors. (Passing the metadata as HF forward kwargs
does not work: Dynamo drops graph inputs nothing reads, and nothing reads them before the pass runs.)
Without a binding the pass raises a clear error on any graph with attention; it never leaves attention
untouched.

Every call of a rewritten graph bumps :attr:`TargetBinding.calls`; :class:`TargetRunner` checks it so a
Dynamo fallback to eager (recompile limit, a disabled stance) cannot silently run HF's own attention.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types

import torch

from treecompile.kv_cache import PagedKVCache
from treecompile.ops._common import MAX_NODES
from treecompile.registry import AttentionLayer, attention_layers

logger = logging.getLogger(__name__)

__all__ = ["TargetBinding", "TargetRunner", "bound", "active_binding", "chain_mask"]

_state = threading.local()


@contextlib.contextmanager
def bound(binding: "TargetBinding"):
    """Make ``binding`` the one the treespec backend uses for graphs compiled inside this block."""
    previous = getattr(_state, "binding", None)
    _state.binding = binding
    try:
        yield binding
    finally:
        _state.binding = previous


def active_binding() -> "TargetBinding | None":
    """The binding made active by :func:`bound`, if any."""
    return getattr(_state, "binding", None)


def chain_mask(rows: int, device=None) -> torch.Tensor:
    """``[rows]`` int64 causal masks within a window: row i sees window keys 0..i (two's complement)."""
    words = [((1 << (i + 1)) - 1) for i in range(rows)]
    words = [w - (1 << 64) if w >= 1 << 63 else w for w in words]
    return torch.tensor(words, dtype=torch.int64, device=device)


class TargetBinding:
    """Caches and per-forward metadata of one rewritten target model.

    Parameters
    ----------
    model : the HF causal LM whose attention layers the pass rewrites.
    max_batch : requests per forward (B <= max_batch).
    max_seq_len : keys per request the cache holds (prompt + generated + one verify window).
    max_rows : rows per forward (T <= max_rows <= 64: one 64-bit mask word per row).
    page_size : keys per cache page.
    dtype, device : cache storage; default the model's parameter dtype and device.
    layers : the recognised attention layers (default: :func:`treecompile.registry.attention_layers`).

    Attributes
    ----------
    cache : PagedKVCache, one layer per recognised attention layer, indexed by ``AttentionLayer.index``.
    prefix_len : int64 [max_batch], the committed keys every row of a request sees.
    ancestor_mask : int64 [max_batch, max_rows], row r sees window key j iff bit j is set.
    slots : int64 [max_batch, max_rows], the cache slot row r's K/V is written to.
    calls : number of forwards the rewritten graphs ran with this binding.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int,
        max_seq_len: int,
        max_rows: int = MAX_NODES,
        page_size: int = 64,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        layers: list[AttentionLayer] | None = None,
    ) -> None:
        if not isinstance(max_rows, int) or not 1 <= max_rows <= MAX_NODES:
            raise ValueError(f"max_rows: must be an int in 1..{MAX_NODES}, got {max_rows!r}")
        if layers is None:
            layers, unrecognised = attention_layers(model)
            if unrecognised:
                names = ", ".join(u.describe() for u in unrecognised)
                raise ValueError(f"model: unrecognised attention layers {names}; see resolve_tree_support")
        if not layers:
            raise ValueError(f"model: {type(model).__name__} has no recognised attention layer to bind")
        geometry = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
        if len(geometry) != 1:
            raise ValueError(f"model: attention layers differ in (num_kv_heads, head_dim): {sorted(geometry)}")
        ((num_kv_heads, head_dim),) = geometry
        param = next(model.parameters())
        dtype = dtype or param.dtype
        device = torch.device(device) if device is not None else param.device
        self.layers = list(layers)
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.cache = PagedKVCache(
            len(layers), num_kv_heads, head_dim, max_batch, max_seq_len,
            page_size=page_size, dtype=dtype, device=device,
        )  # fmt: skip
        self.capacity = self.cache.capacity
        self.prefix_len = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.ancestor_mask = torch.zeros(max_batch, max_rows, dtype=torch.int64, device=device)
        self.slots = torch.zeros(max_batch, max_rows, dtype=torch.int64, device=device)
        self._rows = torch.arange(max_rows, dtype=torch.int64, device=device)
        self.calls = 0

    @property
    def device(self) -> torch.device:
        return self.prefix_len.device

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def layer_for(self, scope: str) -> AttentionLayer | None:
        """The bound layer a graph's ``nn_module_stack`` path names (``L['self'].model.layers.0.self_attn``
        ends with the qualified name ``model.layers.0.self_attn``)."""
        for layer in self.layers:
            if scope == layer.name or scope.endswith("." + layer.name):
                return layer
        return None

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the pass registers on a GraphModule (name -> tensor, no copies)."""
        tensors = {
            "page_table": self.cache.page_table,
            "prefix_len": self.prefix_len,
            "ancestor_mask": self.ancestor_mask,
            "slots": self.slots,
        }
        for layer in self.layers:
            tensors[f"k{layer.index}"] = self.cache.k[layer.index]
            tensors[f"v{layer.index}"] = self.cache.v[layer.index]
        return tensors

    def load(
        self, prefix_len: torch.Tensor, ancestor_mask: torch.Tensor, valid: torch.Tensor | None = None
    ) -> None:
        """Write the next forward's metadata in place (no host sync).

        prefix_len : int64 [B]; ancestor_mask : int64 [B, T]; valid : bool [B, T] or None (all rows valid).
        Row i of request b writes K/V to the slot of key ``prefix_len[b] + i``; an invalid row (padding)
        writes the cache's dummy slot instead.
        """
        B, T = ancestor_mask.shape
        if B > self.max_batch or T > self.max_rows:
            raise ValueError(
                f"ancestor_mask: [B={B}, T={T}] exceeds the binding's [max_batch={self.max_batch}, "
                f"max_rows={self.max_rows}]"
            )
        if prefix_len.shape != (B,):
            raise ValueError(f"prefix_len: expected [{B}], got {tuple(prefix_len.shape)}")
        keys = prefix_len.unsqueeze(1) + self._rows[:T]
        slots = self.cache.slots(keys)
        if valid is not None:
            slots = torch.where(valid, slots, torch.full_like(slots, self.cache.dummy_slot))
        self.prefix_len[:B].copy_(prefix_len)
        self.ancestor_mask[:B, :T].copy_(ancestor_mask)
        self.slots[:B, :T].copy_(slots)

    def window_slots(self, batch: int, rows: int) -> torch.Tensor:
        """The slots the last :meth:`load` assigned, ``int64 [batch, rows]`` (a view)."""
        return self.slots[:batch, :rows]

    def kv_buffers(self) -> list[torch.Tensor]:
        """Every attention layer's K and V storage (what KV compaction moves)."""
        return [t for layer in self.layers for t in (self.cache.k[layer.index], self.cache.v[layer.index])]

    def note_call(self) -> None:
        self.calls += 1


def _target_forward(model, input_ids, position_ids, aux_layers):
    """The function TargetRunner compiles: logits and the aux hidden states EAGLE-3 fuses."""
    out = model(
        input_ids=input_ids, position_ids=position_ids, use_cache=False,
        output_hidden_states=bool(aux_layers), return_dict=True,
    )  # fmt: skip
    if not aux_layers:
        return out.logits, None
    return out.logits, torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)


def _install_output_hooks(model) -> None:
    """HF installs its output-capturing hooks on first use under a lock Dynamo cannot enter; install them
    eagerly once so ``output_hidden_states=True`` traces without a graph break."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks

        maybe_install_capturing_hooks(model.base_model if hasattr(model, "base_model") else model)
        return
    except Exception:  # older/newer layouts: one tiny eager forward installs them as a side effect
        pass
    param = next(model.parameters())
    with torch.no_grad():
        model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=param.device), use_cache=False,
            output_hidden_states=True,
        )  # fmt: skip


class TargetRunner:
    """Runs the target through the treespec backend with one binding.

    ``runner(input_ids [B, T], position_ids [B, T]) -> (logits [B, T, V], aux [B, T, len(aux_layers) * H])``
    after :meth:`TargetBinding.load` wrote the forward's metadata. ``aux_layers`` index HF's
    ``hidden_states`` tuple (0 = embeddings, i = output of layer i - 1).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        binding: TargetBinding,
        aux_layers: tuple[int, ...] = (),
        inductor: bool | None = None,
        mode: str | None = None,
    ) -> None:
        self.model = model
        self.binding = binding
        self.aux_layers = tuple(int(i) for i in aux_layers)
        if inductor is None:
            inductor = binding.device.type == "cuda"
        if self.aux_layers:
            _install_output_hooks(model)
        self._inductor = inductor
        self._mode = mode
        self._compiled: dict[tuple[int, int], object] = {}

    def _for_shape(self, shape: tuple[int, int]):
        """One compiled function per (B, T), each on a private code object: Dynamo keeps cache entries per
        code object, so shapes never queue behind each other's guards or share a recompile limit, and a
        dead runner's entries (another binding's tensors) go away with its code."""
        compiled = self._compiled.get(shape)
        if compiled is None:
            name = f"_target_forward_{id(self):x}_b{shape[0]}_t{shape[1]}"
            code = _target_forward.__code__.replace(co_name=name)
            fn = types.FunctionType(code, _target_forward.__globals__, name)
            compiled = self._compiled[shape] = torch.compile(
                fn, backend="treespec", fullgraph=True, dynamic=False,
                options={"binding": self.binding, "inductor": self._inductor, "mode": self._mode},
            )  # fmt: skip
        return compiled

    @torch.no_grad()  # inference only: with grad on, Inductor builds a joint graph the ops can't serve
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        before = self.binding.calls
        compiled = self._for_shape(tuple(input_ids.shape))
        logits, aux = compiled(self.model, input_ids, position_ids, self.aux_layers)
        if self.binding.calls == before:
            raise RuntimeError(
                "treespec: the target forward did not run the rewritten graph (Dynamo fell back to eager?); "
                "refusing to continue with HF's untouched attention"
            )
        return logits, aux
