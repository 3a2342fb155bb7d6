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

Linear-attention layers (GDN, Mamba2)
-------------------------------------
For each recognised linear-attention layer the binding also owns (DESIGN.md, "Recurrent state follows the
parent"): the committed conv window ``conv_state[i] [max_B, C, Kw - 1]`` and recurrent state
``ssm_state[i] [max_B, *state_shape]`` (the pools verify only reads), the forward's pre-conv inputs
``conv_x[i] [max_B, max_rows, C]`` (kept for the conv commit), and either the replay payload rows
``payload[i] [max_B, max_rows, W]`` (replay, the default) or, with ``replay_ssm=False`` (GDN and Mamba2),
every node's state ``scratch[i] [max_B, max_rows, *state_shape]``. Under replay, GDN branch-point states
go to ONE workspace per state geometry shared by all layers (``[max_B, max_rows, Hv, Dk, Dv]``); the
staged path needs none (a branch reloads its parent from the layer's scratch). Each forward's tree arrives as
``parents [max_B, max_rows]`` (written by :meth:`TargetBinding.load`); after acceptance
:meth:`TargetBinding.commit_linear_state` advances the pools along the accepted path. Creating such a
binding registers the layers' HF seams with Dynamo (``allow_in_graph``) so they reach the FX pass as single
calls (see :mod:`treecompile.passes.rewrite_linear_attention`).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from treecompile.compiling import private_copy
from treecompile.kv_cache import PagedKVCache
from treecompile.ops._common import MAX_NODES
from treecompile.registry import AttentionLayer, LinearAttentionLayer, attention_layers, linear_attention_layers

logger = logging.getLogger(__name__)

__all__ = ["TargetBinding", "TargetRunner", "bound", "active_binding", "chain_mask", "parents_from_ancestor_mask"]

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


def parents_from_ancestor_mask(ancestor_mask: torch.Tensor) -> torch.Tensor:
    """``int64 [B, T]`` parents of the trees ``ancestor_mask [B, T]`` describes (row i's parent is its
    highest ancestor bit below i; -1 when it has none, e.g. a root or a padded row). No host sync."""
    T = ancestor_mask.shape[-1]
    bit = torch.arange(T, device=ancestor_mask.device)
    # [B, T, T]: bit j of row i, kept only for j < i (the row itself and later rows are not parents).
    bits = ((ancestor_mask.unsqueeze(-1) >> bit) & 1).bool() & (bit[None, :] < bit[:, None])
    highest = (T - 1) - bits.flip(-1).to(torch.int64).argmax(-1)
    return torch.where(bits.any(-1), highest, torch.full_like(highest, -1))


def _default_state_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    # Kernels keep fp32 states; the float64 CPU path (tests, the oracle) keeps fp64 ones.
    return torch.float64 if (dtype == torch.float64 and device.type == "cpu") else torch.float32


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
    linear_layers : the recognised linear-attention layers (default:
        :func:`treecompile.registry.linear_attention_layers`).
    replay_ssm : commit recurrent state by replaying the accepted path's payload rows (default); False
        stages every node's state in a per-layer scratch and commits the last accepted node's.
    state_dtype : recurrent state pools' dtype; default float32 (float64 for a float64 model on CPU).
    gdn_chunked : run GDN forwards of 8..16 rows with ``gdn_tree_verify_chunked`` (the chunked tree form, no
        workspace) instead of the sequential tree kernel. Off by default: slower on the H200 so far.
    mamba2_chunked : run Mamba2 forwards of >= 4 rows with ``mamba2_tree_verify_chunked`` (every node at
        once) instead of the sequential tree kernel (replay). Default: on CUDA yes (faster on the H200,
        BENCHMARKS.md "Linear"); on CPU no, where the sequential op's fp32 path is HF's decode bit for bit.
    fuse_projections : lay each decoder layer's q/k/v and gate/up weights out as one tensor (the members'
        parameters become views of it: same values, no extra memory; :mod:`treecompile.projections`) and
        let the pass run each group as one linear. Off here; ``TreeSpeculator`` turns it on for CUDA models.
    packed_linears : let the pass run the graph's float32 CPU linears on oneDNN-packed weights
        (:mod:`treecompile.packed_linear`; eager graphs only). Off here; ``TreeSpeculator`` turns it on for
        float32 CPU models.
    skinny_linears : let the pass run the graph's 16-bit CUDA linears of <= 64 rows through
        ``treespec::skinny_linear`` (Triton tiles; :mod:`treecompile.passes.skinny_linears`). Off here;
        ``TreeSpeculator(skinny_linears=True)`` turns it on.

    Attributes
    ----------
    cache : PagedKVCache, one layer per recognised attention layer, indexed by ``AttentionLayer.index``;
        None for a model without attention layers (pure Mamba2).
    prefix_len : int64 [max_batch], the committed keys every row of a request sees.
    ancestor_mask : int64 [max_batch, max_rows], row r sees window key j iff bit j is set.
    slots : int64 [max_batch, max_rows], the cache slot row r's K/V is written to.
    parents : int64 [max_batch, max_rows], row r's parent row (-1: the committed frontier).
    conv_state, ssm_state, conv_x, payload, scratch : per linear layer (module docstring).
    gdn_workspace : {state_shape: [max_batch, max_rows, Hv, Dk, Dv]}, shared by the GDN layers (replay
        only; empty with ``replay_ssm=False``).
    calls : number of forwards the rewritten graphs ran with this binding.
    projection_groups : list of :class:`treecompile.projections.ProjectionGroup` (empty unless
        ``fuse_projections``).
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
        linear_layers: list[LinearAttentionLayer] | None = None,
        replay_ssm: bool = True,
        state_dtype: torch.dtype | None = None,
        gdn_chunked: bool = False,
        mamba2_chunked: bool | None = None,
        fuse_projections: bool = False,
        packed_linears: bool = False,
        skinny_linears: bool = False,
    ) -> None:
        if not isinstance(max_rows, int) or not 1 <= max_rows <= MAX_NODES:
            raise ValueError(f"max_rows: must be an int in 1..{MAX_NODES}, got {max_rows!r}")
        if layers is None:
            layers, unrecognised = attention_layers(model)
            if unrecognised:
                names = ", ".join(u.describe() for u in unrecognised)
                raise ValueError(f"model: unrecognised attention layers {names}; see resolve_tree_support")
        if linear_layers is None:
            linear_layers = linear_attention_layers(model)
        if not layers and not linear_layers:
            raise ValueError(f"model: {type(model).__name__} has no recognised attention layer to bind")
        param = next(model.parameters())
        dtype = dtype or param.dtype
        device = torch.device(device) if device is not None else param.device
        self.layers = list(layers)
        self.linear_layers = list(linear_layers)
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.cache = None
        self.capacity = max_seq_len
        self._page_size = page_size
        if self.layers:
            geometry = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
            if len(geometry) != 1:
                raise ValueError(f"model: attention layers differ in (num_kv_heads, head_dim): {sorted(geometry)}")
            ((num_kv_heads, head_dim),) = geometry
            self.cache = PagedKVCache(
                len(layers), num_kv_heads, head_dim, max_batch, max_seq_len,
                page_size=page_size, dtype=dtype, device=device,
            )  # fmt: skip
            self.capacity = self.cache.capacity
        self.prefix_len = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.ancestor_mask = torch.zeros(max_batch, max_rows, dtype=torch.int64, device=device)
        self.slots = torch.zeros(max_batch, max_rows, dtype=torch.int64, device=device)
        self._rows = torch.arange(max_rows, dtype=torch.int64, device=device)
        self.parents = (self._rows - 1).expand(max_batch, max_rows).clone()  # a fresh binding holds the chain
        self.replay_ssm = bool(replay_ssm)
        self.gdn_chunked = bool(gdn_chunked)
        self.mamba2_chunked = device.type == "cuda" if mamba2_chunked is None else bool(mamba2_chunked)
        self.state_dtype = state_dtype or _default_state_dtype(dtype, device)
        self._bind_linear_state(dtype, device)
        self.projection_groups = []
        if fuse_projections:
            from treecompile.projections import fuse_projection_weights

            self.projection_groups = fuse_projection_weights(model)
        self.packed_linears = bool(packed_linears)
        self.skinny_linears = bool(skinny_linears)
        self.calls = 0

    def check_projections(self) -> None:
        """Raise if a fused group's parameters stopped being views of its storage (host-side, no sync)."""
        for group in self.projection_groups:
            group.check()

    def _bind_linear_state(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the linear-attention pools (module docstring) and expose the layers' HF seams to Dynamo."""
        B, N = self.max_batch, self.max_rows
        if self.linear_layers and self.state_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"state_dtype: recurrent state pools must be float32 (or float64 on CPU), got {self.state_dtype}"
            )
        if self.linear_layers and self.state_dtype == torch.float64 and device.type != "cpu":
            raise ValueError(f"state_dtype: float64 recurrent state is the CPU reference path only (device {device})")
        self.conv_state, self.ssm_state, self.conv_x, self.payload, self.scratch = [], [], [], [], []
        self.gdn_workspace: dict[tuple[int, ...], torch.Tensor] = {}
        for layer in self.linear_layers:
            state = layer.state_shape
            self.conv_state.append(torch.zeros(B, layer.conv_dim, layer.conv_kernel - 1, dtype=dtype, device=device))
            self.ssm_state.append(torch.zeros((B,) + state, dtype=self.state_dtype, device=device))
            self.conv_x.append(torch.zeros(B, N, layer.conv_dim, dtype=dtype, device=device))
            if self.replay_ssm:
                self.payload.append(torch.zeros(B, N, layer.payload_width, dtype=self.state_dtype, device=device))
            else:
                self.scratch.append(torch.zeros((B, N) + state, dtype=self.state_dtype, device=device))
            if self.replay_ssm and layer.family == "gdn" and state not in self.gdn_workspace:
                self.gdn_workspace[state] = torch.zeros((B, N) + state, dtype=self.state_dtype, device=device)
        if self.linear_layers:
            from treecompile.passes.rewrite_linear_attention import allow_seams_in_graph

            allow_seams_in_graph(self.linear_layers)

    @property
    def device(self) -> torch.device:
        return self.prefix_len.device

    @property
    def page_size(self) -> int:
        return self.cache.page_size if self.cache is not None else self._page_size

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
            "prefix_len": self.prefix_len,
            "ancestor_mask": self.ancestor_mask,
            "slots": self.slots,
            "parents": self.parents,
        }
        if self.cache is not None:
            tensors["page_table"] = self.cache.page_table
        for layer in self.layers:
            tensors[f"k{layer.index}"] = self.cache.k[layer.index]
            tensors[f"v{layer.index}"] = self.cache.v[layer.index]
        for layer in self.linear_layers:
            i = layer.index
            tensors[f"conv_state{i}"] = self.conv_state[i]
            tensors[f"ssm_state{i}"] = self.ssm_state[i]
            tensors[f"conv_x{i}"] = self.conv_x[i]
            if self.replay_ssm:
                tensors[f"payload{i}"] = self.payload[i]
            else:
                tensors[f"scratch{i}"] = self.scratch[i]
        for shape, workspace in self.gdn_workspace.items():
            tensors[self.workspace_name(shape)] = workspace
        return tensors

    @staticmethod
    def workspace_name(state_shape: tuple[int, ...]) -> str:
        """Graph-tensor name of the GDN workspace shared by the layers of one state geometry."""
        return "gdn_workspace_" + "x".join(str(d) for d in state_shape)

    def load(
        self,
        prefix_len: torch.Tensor,
        ancestor_mask: torch.Tensor,
        valid: torch.Tensor | None = None,
        parents: torch.Tensor | None = None,
    ) -> None:
        """Write the next forward's metadata in place (no host sync).

        prefix_len : int64 [B]; ancestor_mask : int64 [B, T]; valid : bool [B, T] or None (all rows valid);
        parents : int64 [B, T] or None (derived from ``ancestor_mask``), what linear-attention layers read.
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
        if parents is not None and parents.shape != (B, T):
            raise ValueError(f"parents: expected [{B}, {T}], got {tuple(parents.shape)}")
        if self.cache is not None:
            keys = prefix_len.unsqueeze(1) + self._rows[:T]
            slots = self.cache.slots(keys)
            if valid is not None:
                slots = torch.where(valid, slots, torch.full_like(slots, self.cache.dummy_slot))
            self.slots[:B, :T].copy_(slots)
        self.prefix_len[:B].copy_(prefix_len)
        self.ancestor_mask[:B, :T].copy_(ancestor_mask)
        if self.linear_layers:
            self.parents[:B, :T].copy_(parents if parents is not None else parents_from_ancestor_mask(ancestor_mask))

    def window_slots(self, batch: int, rows: int) -> torch.Tensor:
        """The slots the last :meth:`load` assigned, ``int64 [batch, rows]`` (a view)."""
        return self.slots[:batch, :rows]

    def kv_buffers(self) -> list[torch.Tensor]:
        """Every attention layer's K and V storage (what KV compaction moves; empty without attention)."""
        return [t for layer in self.layers for t in (self.cache.k[layer.index], self.cache.v[layer.index])]

    def commit_linear_state(self, accepted_path: torch.Tensor, accept_len: torch.Tensor) -> None:
        """Advance every linear layer's committed conv window and recurrent state along the accepted path
        of the last forward (no host sync; a request with ``accept_len == 0`` keeps its state).

        accepted_path : int64 [B, N] node indices root first, padded with -1 (a prefill chunk's is
        ``arange(N)``); accept_len : int64 [B]. N is the last forward's row count.
        """
        B, N = accepted_path.shape
        if accept_len.shape != (B,):
            raise ValueError(f"accept_len: expected [{B}], got {tuple(accept_len.shape)}")
        if B > self.max_batch or N > self.max_rows:
            raise ValueError(f"accepted_path: [{B}, {N}] exceeds the binding's [{self.max_batch}, {self.max_rows}]")
        ops = torch.ops.treespec
        for layer in self.linear_layers:
            i = layer.index
            ops.causal_conv1d_tree_commit(self.conv_state[i][:B], self.conv_x[i][:B, :N], accepted_path, accept_len)
            if not self.replay_ssm:
                ops.ssm_commit_staged(self.ssm_state[i][:B], self.scratch[i][:B], accepted_path, accept_len)
            elif layer.family == "gdn":
                ops.gdn_replay_commit(self.ssm_state[i][:B], self.payload[i][:B], accepted_path, accept_len)
            else:
                ops.mamba2_replay_commit(self.ssm_state[i][:B], self.payload[i][:B], accepted_path, accept_len)

    def reset_linear_state(self) -> None:
        """Zero every committed conv window and recurrent state (a new generate call: nothing of an earlier
        request may leak into the next)."""
        for t in self.conv_state + self.ssm_state:
            t.zero_()

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
            compiled = self._compiled[shape] = torch.compile(
                private_copy(_target_forward, name), backend="treespec", fullgraph=True, dynamic=False,
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
