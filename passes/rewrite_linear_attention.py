"""Pass: replace each HF linear-attention layer's conv and recurrence with treecompile's tree ops.

Input: the Dynamo graph of an HF causal LM called with ``use_cache=False`` whose GDN (Qwen3-Next,
Qwen3.5) or Mamba2 (``Mamba2Mixer``, Bamba's ``BambaMixer``) layers call HF's module-level seams. Without a
cache those layers run the prefill form:

===========  ================================================  ==========================================
family       conv seam                                          recurrence seam
===========  ================================================  ==========================================
GDN          ``causal_conv1d_fn(x [B, C, T], w [C, Kw], b)``    ``torch_chunk_gated_delta_rule(q, k, v,
                                                                g=, beta=, initial_state=None, ...)``
Mamba2       ``causal_conv1d_fn(x [B, C, T], w, b)``            ``mamba2_chunk_scan(x, dt, A, B, C, ...,
                                                                D=, dt_bias=, initial_states=None)``
===========  ================================================  ==========================================

(transformers 5.17 to 5.25 call these; 5.17 repeats GDN's q/k to the value heads before the call, which the
pass undoes; from 5.25, with its ``kernels`` dependency, each is an ``nn.Module`` wrapping the function, which
the registry unwraps.) Dynamo would inline them into hundreds of nodes, so
:class:`treecompile.target.TargetBinding` registers them with ``torch._dynamo.allow_in_graph`` when it is
created (:func:`allow_seams_in_graph`) and each arrives here as ONE call node. For every seam call the pass

1. locates the layer from ``nn_module_stack`` (the innermost recognised linear-attention module) and looks
   it up among the binding's linear layers; a seam outside a recognised layer, a cache-only or
   training-only seam (``causal_conv1d_update``, ``torch_recurrent_gated_delta_rule``,
   ``mamba2_selective_state_update``, ``mamba2_split_conv1d_scan_combined``) or an HF initial state is
   refused;
2. conv: copies the pre-conv inputs ``x [B, T, C]`` into the binding's ``conv_x[i]`` (the conv commit reads
   them after acceptance) and emits ``treespec::causal_conv1d_tree_update(x, conv_state[i][:B], w, b,
   parents[:B, :T], activation)``, transposed back to HF's ``[B, C, T]``;
3. recurrence: GDN -> ``treespec::gdn_tree_verify(q, k, v, g, beta, ssm_state[i][:B], parents, workspace
   [:B], payload[i][:B])`` (``gdn_tree_verify_chunked`` without the workspace for forwards of 8..16 rows
   when the binding says ``gdn_chunked=True``) or, with ``replay_ssm=False``, ``gdn_tree_verify_staged(q, k, v, g, beta,
   ssm_state[i][:B], parents, scratch[i][:B])``; Mamba2 -> ``treespec::mamba2_tree_verify(x, dt, A, B, C,
   D, dt_bias, ssm_state[i][:B], parents, payload[i][:B], ...)`` (``mamba2_tree_verify_chunked``, same
   arguments, for forwards of >= 4 rows when the binding says ``mamba2_chunked``, the default on CUDA) or,
   with ``replay_ssm=False``,
   ``mamba2_tree_verify_staged(..., scratch[i][:B], ...)``; the result is cast to the dtype HF's seam
   returned (Mamba2's chunked scan returns float32).

Verify never writes the committed pools (``conv_state``, ``ssm_state``): the runtime commits after the
accept with :meth:`TargetBinding.commit_linear_state`. Finally the pass proves the rewrite complete: every
bound linear layer rewritten once (conv and recurrence), no HF linear seam left. ``(gm, settings) -> gm``;
logs how many layers it rewrote. A graph without linear attention passes through.
"""

from __future__ import annotations

import inspect
import logging
import operator

import torch
import torch.fx

from treecompile.ops.gdn_chunk_tree import CHUNKED_MAX_NODES
from treecompile.registry import LINEAR_ATTENTION_CLASSES

from ._graph import check_each_layer_once, example_dtype, example_shape, module_stack, static_size

# With ``TargetBinding(gdn_chunked=True)``, forwards of CHUNKED_MIN_ROWS..CHUNKED_MAX_NODES rows run GDN in
# the chunked tree form (issue #6: trees of 8..16 nodes); shorter ones (a decode step, small trees) and longer
# ones run the sequential tree kernel. Off by default: on the H200 the chunked kernel takes 71 us/layer at
# Qwen3-Next shapes against the sequential kernel's 17 us (N=8) / 32 us (N=16) (BENCHMARKS.md, "Linear").
CHUNKED_MIN_ROWS = 8
# With ``mamba2_chunked`` (the default on CUDA), Mamba2 forwards of at least MAMBA2_CHUNKED_MIN_ROWS rows run the
# chunked form. H200, Mamba2-2.7B shapes (tests/gpu/m2_sweep.py, bench linear): the chunked kernel costs 7.6-8.2 us
# at N = 1, 8 and 16 (23.6 us at N = 64); the sequential one 3.6 us at N = 1, 7.6 (chain) at N = 4, 13.4 at N = 8.
MAMBA2_CHUNKED_MIN_ROWS = 4

logger = logging.getLogger(__name__)

__all__ = ["rewrite_linear_attention", "allow_seams_in_graph", "LINEAR_SEAMS"]

_PREFIX = "_treespec_"

#: Every HF linear-attention seam name (the torch fallbacks' names; HF wraps them with functools.wraps).
#: None may remain in a rewritten graph.
LINEAR_SEAMS = frozenset({
    "causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule", "mamba2_chunk_scan", "mamba2_selective_state_update",
    "mamba2_split_conv1d_scan_combined",
})  # fmt: skip


def allow_seams_in_graph(layers) -> None:
    """Make each layer's HF seams single graph calls (``torch._dynamo.allow_in_graph``), so the pass sees
    the conv and the recurrence whole instead of their inlined bodies.

    Registration is global and permanent for those function objects (Dynamo's allow-list is not scoped);
    eager HF code is unaffected, and another backend compiling the model traces through the call with
    the same math (AOT autograd inlines it)."""
    for layer in layers:
        for fn in layer.seams.values():
            torch._dynamo.allow_in_graph(fn)


def _seam_name(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", None)
    return name if name in LINEAR_SEAMS else None


def _linear_scope(node: torch.fx.Node) -> tuple[str, type] | None:
    """Innermost module on the node's stack whose class is a registered linear-attention class."""
    for path, cls in reversed(module_stack(node)):
        if cls.__name__ in LINEAR_ATTENTION_CLASSES:
            return path, cls
    return None


def _layer_for(binding, scope: str):
    for layer in binding.linear_layers:
        if scope == layer.name or scope.endswith("." + layer.name):
            return layer
    return None


def _bind(node: torch.fx.Node) -> dict:
    """The seam call's arguments by parameter name (HF's signature, through functools.wraps)."""
    signature = inspect.signature(node.target)
    bound = signature.bind_partial(*node.args, **node.kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            args.update(args.pop(name, {}) or {})
    return args


def _register_binding_tensors(gm: torch.fx.GraphModule, binding) -> None:
    """Register the binding's tensors on the GraphModule as buffers (the same storage, no copies)."""
    sources = getattr(gm, "_param_name_to_source", None)
    for name, tensor in binding.graph_tensors().items():
        attr = _PREFIX + name
        if getattr(gm, attr, None) is tensor:
            continue  # the attention pass registered it already
        if hasattr(gm, attr):
            delattr(gm, attr)
        gm.register_buffer(attr, tensor, persistent=False)
        if sources is not None:
            # AOT autograd wants a source for each lifted buffer (guard dedup): a named constant source,
            # as the attention pass does.
            from torch._dynamo.source import ConstantSource

            sources[attr] = ConstantSource(attr)


def _unrepeat_heads(node, heads: int, what: str, scope: str):
    """Undo a ``repeat_interleave(r, dim=2)`` of q/k to the value heads (transformers 5.17 does it before
    the GDN seam): the payload stores one row per key head."""
    shape = example_shape(node)
    if shape is not None and len(shape) == 4 and shape[2] == heads:
        return node
    if isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == "repeat_interleave":
        src = node.args[0]
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if dim in (2, -2) and example_shape(src) is not None and example_shape(src)[2] == heads:
            return src
    raise ValueError(
        f"treespec pass: layer {scope}: GDN {what} has shape {shape}, expected [B, T, Hk={heads}, Dk] "
        "(an unexpected head expansion before the seam?)"
    )


def _check_shape(scope: str, what: str, node, expected: tuple) -> None:
    shape = example_shape(node)
    if shape != expected:
        raise ValueError(f"treespec pass: layer {scope}: {what} has shape {shape}, expected {list(expected)}")


def _collect_sites(graph: torch.fx.Graph, binding) -> dict:
    """``{layer: {"conv": node, "recurrence": node}}`` over the graph's seam calls; refuses strays."""
    sites: dict = {}
    for node in graph.nodes:
        name = _seam_name(node)
        if name is None:
            continue
        scope = _linear_scope(node)
        if scope is None:
            raise ValueError(
                f"treespec pass: HF linear-attention seam {name} ({node.name}) called outside any recognised "
                f"linear-attention layer (supported: {', '.join(sorted(LINEAR_ATTENTION_CLASSES))}); refused"
            )
        layer = _layer_for(binding, scope[0])
        if layer is None:
            raise ValueError(
                f"treespec pass: linear-attention layer {scope[0]} is not one the binding holds "
                f"({[l.name for l in binding.linear_layers][:4]} ...): the binding was made for another model"
            )
        if name == layer.conv_seam:
            role = "conv"
        elif name == layer.recurrence_seam:
            role = "recurrence"
        else:
            raise ValueError(
                f"treespec pass: layer {layer.name} calls {name}, HF's cache / training path; call the model "
                "with use_cache=False in eval mode (treecompile owns the recurrent state)"
            )
        entry = sites.setdefault(layer.index, {"layer": layer})
        if role in entry:
            raise ValueError(f"treespec pass: layer {layer.name} calls its {role} seam {name} twice")
        entry[role] = node
    return sites


def rewrite_linear_attention(gm: torch.fx.GraphModule, settings) -> torch.fx.GraphModule:
    graph = gm.graph
    binding = getattr(settings, "binding", None)
    has_seams = any(_seam_name(n) is not None for n in graph.nodes)
    scopes = sorted({s[0] for n in graph.nodes if (s := _linear_scope(n)) is not None})
    if not has_seams:
        if scopes:
            raise ValueError(
                f"treespec pass: linear-attention layer(s) {scopes[:3]} were traced without their HF seams "
                "(the conv and recurrence were inlined): create the TargetBinding before compiling (it registers "
                "the seams with Dynamo), or transformers renamed them"
            )
        _check_complete(gm, binding, [])
        return gm
    if binding is None:
        raise ValueError(
            "treespec backend: this graph has linear-attention layers but no TargetBinding to read state pools "
            "and tree metadata from. Use treecompile.TreeSpeculator, or compile with options={'binding': "
            "TargetBinding(model, ...)}; refusing to leave HF's recurrence untouched"
        )
    sites = _collect_sites(graph, binding)
    for entry in sites.values():
        missing = [role for role in ("conv", "recurrence") if role not in entry]
        if missing:
            raise ValueError(f"treespec pass: layer {entry['layer'].name} has no {' / '.join(missing)} seam call")

    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min((entry["conv"] for entry in sites.values()), key=order.__getitem__)
    x_shape = example_shape(_bind(first)["hidden_states"])
    if x_shape is None or len(x_shape) != 3:
        raise ValueError(f"treespec pass: conv input of {first.name} has no static [B, C, T] shape metadata")
    B, T = static_size("batch size", x_shape[0]), static_size("rows per forward", x_shape[2])
    if B > binding.max_batch or T > binding.max_rows:
        raise ValueError(
            f"treespec pass: the forward has B={B} requests x T={T} rows but the binding holds "
            f"max_batch={binding.max_batch} x max_rows={binding.max_rows}"
        )
    attention_shape = getattr(gm, "treespec_shape", None)
    if attention_shape is not None and attention_shape != (B, T):
        raise ValueError(f"treespec pass: attention runs [B, T] = {attention_shape}, linear attention {(B, T)}")

    _register_binding_tensors(gm, binding)
    with graph.inserting_before(first):
        parents = graph.get_attr(_PREFIX + "parents")
        parents = graph.call_function(operator.getitem, (parents, (slice(None, B), slice(None, T))))

    done = []
    for index in sorted(sites):
        entry = sites[index]
        layer = entry["layer"]
        _rewrite_conv(graph, binding, layer, entry["conv"], parents, B, T)
        if layer.family == "gdn":
            _rewrite_gdn(graph, binding, layer, entry["recurrence"], parents, B, T)
        else:
            _rewrite_mamba2(graph, binding, layer, entry["recurrence"], parents, B, T)
        done.append(layer.name)

    _check_complete(gm, binding, done)
    gm.treespec_linear_layers = done
    if not getattr(gm, "treespec_rewritten", False):
        gm.treespec_layers = []  # no attention in this graph: the attention check finds nothing missing
        gm.treespec_shape = (B, T)
    gm.treespec_rewritten = True
    logger.info("rewrite_linear_attention: %d linear-attention layer(s) -> treespec::causal_conv1d_tree_update "
                "+ tree verify (B=%d, T=%d, %s)", len(done), B, T,
                "replay" if binding.replay_ssm else "staged")  # fmt: skip
    return gm


def _check_complete(gm: torch.fx.GraphModule, binding, done: list[str]) -> None:
    left = [n.name for n in gm.graph.nodes if _seam_name(n) is not None]
    if left:
        raise ValueError(f"treespec pass: HF linear-attention seams left after the rewrite: {left}")
    if binding is None or not getattr(binding, "linear_layers", None):
        return
    if not done and not getattr(gm, "treespec_rewritten", False):
        return  # a graph of something else (no model layers at all)
    check_each_layer_once("linear-attention", done, [layer.name for layer in binding.linear_layers])


def _slice_batch(graph, name: str, B: int, rows: int | None = None):
    t = graph.get_attr(_PREFIX + name)
    index = slice(None, B) if rows is None else (slice(None, B), slice(None, rows))
    return graph.call_function(operator.getitem, (t, index))


def _finish(graph, node, first_new, last_new) -> None:
    """Give the new nodes the seam's module stack (later passes and tests locate layers by it)."""
    cur = first_new
    while True:
        cur.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
        cur.meta["stack_trace"] = node.meta.get("stack_trace")
        if cur is last_new:
            break
        cur = cur.next


def _rewrite_conv(graph, binding, layer, node, parents, B: int, T: int) -> None:
    args = _bind(node)
    x, weight, bias = args["hidden_states"], args["weight"], args.get("bias")
    activation = args.get("activation")
    _check_shape(layer.name, "conv input", x, (B, layer.conv_dim, T))
    _check_shape(layer.name, "conv weight", weight, (layer.conv_dim, layer.conv_kernel))
    if (bias is not None) != layer.conv_bias:
        raise ValueError(f"treespec pass: layer {layer.name}: conv bias {'given' if bias is not None else 'missing'}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"treespec pass: layer {layer.name}: conv activation {activation!r} (silu or none)")
    i = layer.index
    with graph.inserting_before(node):
        rows = graph.call_method("transpose", (x, 1, 2))  # [B, T, C], a view
        keep = _slice_batch(graph, f"conv_x{i}", B, T)
        graph.call_method("copy_", (keep, rows))
        state = _slice_batch(graph, f"conv_state{i}", B)
        out = graph.call_function(
            torch.ops.treespec.causal_conv1d_tree_update.default, (rows, state, weight, bias, parents, activation)
        )
        out = graph.call_method("transpose", (out, 1, 2))  # back to HF's [B, C, T]
    _finish(graph, node, rows, out)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _rewrite_gdn(graph, binding, layer, node, parents, B: int, T: int) -> None:
    args = _bind(node)
    if args.get("initial_state") is not None or args.get("output_final_state"):
        raise ValueError(
            f"treespec pass: layer {layer.name} runs the gated delta rule with an HF cache state; call the model "
            "with use_cache=False (treecompile owns the recurrent state)"
        )
    if args.get("cu_seqlens") is not None:
        raise ValueError(f"treespec pass: layer {layer.name}: packed sequences (cu_seqlens) are not supported")
    Hk, Dk, Hv, Dv = layer.num_groups, layer.key_dim, layer.num_heads, layer.head_dim
    q = _unrepeat_heads(args["query"], Hk, "query", layer.name)
    k = _unrepeat_heads(args["key"], Hk, "key", layer.name)
    v, g, beta = args["value"], args["g"], args["beta"]
    _check_shape(layer.name, "query", q, (B, T, Hk, Dk))
    _check_shape(layer.name, "key", k, (B, T, Hk, Dk))
    _check_shape(layer.name, "value", v, (B, T, Hv, Dv))
    _check_shape(layer.name, "g", g, (B, T, Hv))
    _check_shape(layer.name, "beta", beta, (B, T, Hv))
    use_l2norm = bool(args.get("use_qk_l2norm_in_kernel", False))
    i = layer.index
    with graph.inserting_before(node):
        state = _slice_batch(graph, f"ssm_state{i}", B)
        if binding.replay_ssm and binding.gdn_chunked and CHUNKED_MIN_ROWS <= T <= CHUNKED_MAX_NODES:
            # One 16-row tile holds the whole tree: the chunked form does the tree with a few small matmuls
            # and keeps no node state (no workspace traffic); same payload rows, same commit.
            payload = _slice_batch(graph, f"payload{i}", B)
            op, bufs = torch.ops.treespec.gdn_tree_verify_chunked.default, (payload,)
        elif binding.replay_ssm:
            workspace = _slice_batch(graph, binding.workspace_name(layer.state_shape), B)
            payload = _slice_batch(graph, f"payload{i}", B)
            op, bufs = torch.ops.treespec.gdn_tree_verify.default, (workspace, payload)
        else:
            op, bufs = torch.ops.treespec.gdn_tree_verify_staged.default, (_slice_batch(graph, f"scratch{i}", B),)
        out = graph.call_function(op, (q, k, v, g, beta, state, parents, *bufs, None, use_l2norm))
        last = out
        want = _output_dtype(node, 0)
        if want is not None and want != example_dtype(q):
            last = graph.call_method("to", (out, want))
    _finish(graph, node, state, last)
    for user in list(node.users):
        index = user.args[1] if user.op == "call_function" and user.target is operator.getitem else None
        if index == 0:
            user.replace_all_uses_with(last)
            graph.erase_node(user)
        elif index == 1 and not user.users:
            graph.erase_node(user)  # the (None) final state nobody reads
        else:
            raise ValueError(f"treespec pass: layer {layer.name}: unexpected use {user.name} of the GDN seam output")
    graph.erase_node(node)


def _rewrite_mamba2(graph, binding, layer, node, parents, B: int, T: int) -> None:
    args = _bind(node)
    if args.get("initial_states") is not None or args.get("return_final_states"):
        raise ValueError(
            f"treespec pass: layer {layer.name} runs the Mamba2 scan with an HF cache state; call the model with "
            "use_cache=False (treecompile owns the recurrent state)"
        )
    if args.get("seq_idx") is not None or args.get("cu_seqlens") is not None:
        raise ValueError(f"treespec pass: layer {layer.name}: packed sequences are not supported")
    H, P, G, N = layer.num_heads, layer.head_dim, layer.num_groups, layer.key_dim
    x, dt, A, Bm, Cm = (args[name] for name in ("hidden_states", "dt", "A", "B", "C"))
    D, dt_bias = args.get("D"), args.get("dt_bias")
    _check_shape(layer.name, "x", x, (B, T, H, P))
    _check_shape(layer.name, "dt", dt, (B, T, H))
    _check_shape(layer.name, "A", A, (H,))
    _check_shape(layer.name, "B", Bm, (B, T, G, N))
    _check_shape(layer.name, "C", Cm, (B, T, G, N))
    softplus = bool(args.get("dt_softplus", False))
    dt_min, dt_max = _dt_limits(args.get("dt_limit"), softplus)
    i = layer.index
    with graph.inserting_before(node):
        state = _slice_batch(graph, f"ssm_state{i}", B)
        if binding.replay_ssm and binding.mamba2_chunked and T >= MAMBA2_CHUNKED_MIN_ROWS:
            # Every node at once with a few small matmuls (no node-by-node walk, no ancestor replays): a tree
            # costs what a chain of equal size costs; same payload rows, same commit.
            buf, op = _slice_batch(graph, f"payload{i}", B), torch.ops.treespec.mamba2_tree_verify_chunked.default
        elif binding.replay_ssm:
            buf, op = _slice_batch(graph, f"payload{i}", B), torch.ops.treespec.mamba2_tree_verify.default
        else:
            buf, op = _slice_batch(graph, f"scratch{i}", B), torch.ops.treespec.mamba2_tree_verify_staged.default
        out = graph.call_function(op, (x, dt, A, Bm, Cm, D, dt_bias, state, parents, buf, softplus, dt_min, dt_max))
        last = out
        want = _output_dtype(node, None)
        if want is not None and want != example_dtype(x):
            last = graph.call_method("to", (out, want))  # HF's chunked scan returns float32
    _finish(graph, node, state, last)
    node.replace_all_uses_with(last)
    graph.erase_node(node)


def _output_dtype(node: torch.fx.Node, index: int | None) -> torch.dtype | None:
    value = node.meta.get("example_value")
    if index is not None and isinstance(value, (tuple, list)):
        value = value[index]
    return value.dtype if isinstance(value, torch.Tensor) else None


def _dt_limits(limit, softplus: bool) -> tuple[float | None, float | None]:
    """HF's ``dt_limit`` as the op's optional clamps; the default ``(0, inf)`` after a softplus clamps
    nothing, so it is dropped (HF's one-token decode applies no clamp either)."""
    if limit is None:
        return None, None
    lo, hi = (float(v) for v in limit)
    dt_min = None if lo == float("-inf") or (softplus and lo <= 0.0) else lo
    dt_max = None if hi == float("inf") else hi
    return dt_min, dt_max
