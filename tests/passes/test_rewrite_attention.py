"""The attention pass on tiny random HF models of every supported family.

The rewritten graph holds ``treespec::kv_write`` + ``treespec::tree_attention_paged`` per layer and no
SDPA; a tree forward's logits (and the aux hidden states EAGLE-3 reads) equal the per-path reference:
each root-to-node path run as a plain causal sequence through the untouched HF model, in float64.
"""

import pytest
import torch
import torch.fx

import treecompile.passes as passes_pkg
from treecompile.target import TargetBinding, TargetRunner, bound, chain_mask
from treecompile.passes._graph import is_pure

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def tiny_model(family: str, seed: int = 0, layers: int = 3, **overrides):
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
        Qwen3Config, Qwen3ForCausalLM,
    )  # fmt: skip

    kinds = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    config_cls, model_cls = kinds[family]
    kwargs = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
    )  # fmt: skip
    if family == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).to(torch.float64).eval()


def random_tree(n: int, generator: torch.Generator) -> list[int]:
    """Parents of a random tree: node i > 0 hangs under a random earlier node."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


def tree_metadata(parents: list[int]):
    """(depth [N], ancestor mask [N] as two's-complement int64 words) of a parents list."""
    depth, mask = [], []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        mask.append((1 << i) | (mask[p] if p >= 0 else 0))
    return torch.tensor(depth), torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in mask])


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


class Captured:
    """A pass appended to the list that keeps the rewritten graph for inspection."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, settings):
        self.graphs.append(gm)
        return gm


def rewrite_and_capture(model, **binding_kwargs):
    """(binding, runner, rewritten GraphModule) after one eager forward of B=2 requests x T=9 rows."""
    binding = TargetBinding(model, max_batch=2, max_seq_len=48, max_rows=9, page_size=8, **binding_kwargs)
    runner = TargetRunner(model, binding, aux_layers=(1, 2), inductor=False)
    capture = Captured()
    mp = pytest.MonkeyPatch()
    mp.setattr(passes_pkg, "PASSES", passes_pkg.PASSES + [capture])
    try:
        torch.manual_seed(1)
        ids = torch.randint(0, 96, (2, 9))
        binding.load(torch.zeros(2, dtype=torch.int64), chain_mask(9).expand(2, 9))
        with torch.no_grad():
            runner(ids, torch.arange(9).expand(2, 9).contiguous())  # same strides as later calls: no recompile
    finally:
        mp.undo()
    assert len(capture.graphs) == 1
    return binding, runner, capture.graphs[0]


@pytest.fixture(scope="module", params=FAMILIES)
def rewritten(request):
    """(family, model, binding, runner, rewritten GraphModule) with B=2 requests x T=9 rows."""
    family = request.param
    model = tiny_model(family)
    return (family, model, *rewrite_and_capture(model))


def _targets(gm):
    """Call targets, each eager-CPU direct call (passes/direct_cpu_ops.py) read as the op it stands for."""
    from treecompile.passes.direct_cpu_ops import DIRECT

    op_of = {impl: op for op, impl in DIRECT.items()}
    return [op_of.get(n.target, n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_rewritten_graph_has_treespec_ops_and_no_sdpa(rewritten):
    family, model, binding, runner, gm = rewritten
    targets = _targets(gm)
    layers = model.config.num_hidden_layers
    assert targets.count(torch.ops.treespec.kv_write.default) == layers
    assert targets.count(torch.ops.treespec.tree_attention_paged.default) == layers
    assert torch._C._nn.scaled_dot_product_attention not in targets
    assert torch.nn.functional.scaled_dot_product_attention not in targets
    assert gm.treespec_layers == [f"model.layers.{i}.self_attn" for i in range(layers)]


def test_eager_cpu_graph_calls_the_attention_ops_directly(rewritten):
    """On an eager CPU graph the attention ops run their CPU implementations without the dispatcher; a
    graph handed to Inductor, or one on another device, keeps the ops."""
    from treecompile.passes.direct_cpu_ops import DIRECT, direct_cpu_ops
    from treecompile.backend import TreespecOptions

    family, model, binding, runner, gm = rewritten
    raw = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not set(DIRECT) & set(raw)
    assert sum(t in DIRECT.values() for t in raw) == 2 * model.config.num_hidden_layers

    def fresh():
        g = torch.fx.Graph()
        k, v, x, slots = (g.placeholder(n) for n in "kvxs")
        g.call_function(torch.ops.treespec.kv_write.default, (k, v, x, x, slots))
        g.output(None)
        return torch.fx.GraphModule(torch.nn.Module(), g)

    for inductor, device in ((True, "cpu"), (False, "meta")):
        other = type("B", (), {"device": torch.device(device)})()
        kept = direct_cpu_ops(fresh(), TreespecOptions(inductor=inductor, binding=other))
        assert torch.ops.treespec.kv_write.default in [n.target for n in kept.graph.nodes]
    done = direct_cpu_ops(fresh(), TreespecOptions(inductor=False, binding=binding))
    assert torch.ops.treespec.kv_write.default not in [n.target for n in done.graph.nodes]


def test_graph_reads_the_bindings_own_tensors(rewritten):
    """Fixed addresses: the graph's buffers are the binding's storage, not copies."""
    family, model, binding, runner, gm = rewritten
    assert gm._treespec_k0.data_ptr() == binding.cache.k[0].data_ptr()
    assert gm._treespec_v2.data_ptr() == binding.cache.v[2].data_ptr()
    assert gm._treespec_ancestor_mask.data_ptr() == binding.ancestor_mask.data_ptr()
    assert gm._treespec_slots.data_ptr() == binding.slots.data_ptr()


@pytest.mark.parametrize("prefix", [(5, 9)], ids=["prefix5+9"])
def test_tree_logits_equal_per_path_reference(rewritten, prefix):
    """B=2 ragged prefixes (prefilled as a padded chain), then a random N=9 tree per request."""
    family, model, binding, runner, gm = rewritten
    B, T = 2, 9
    g = torch.Generator().manual_seed(hash(family) % 1000)
    lengths = torch.tensor(prefix)
    prompt = torch.randint(0, 96, (B, T), generator=g)
    valid = torch.arange(T)[None, :] < lengths[:, None]
    binding.load(torch.zeros(B, dtype=torch.int64), torch.where(valid, chain_mask(T), 0), valid)
    calls = binding.calls
    with torch.no_grad():
        prefill_logits, _ = runner(torch.where(valid, prompt, 0), torch.where(valid, torch.arange(T), 0))
        trees = [random_tree(T, g) for _ in range(B)]
        meta = [tree_metadata(p) for p in trees]
        depth = torch.stack([d for d, _ in meta])
        mask = torch.stack([m for _, m in meta])
        tokens = torch.randint(0, 96, (B, T), generator=g)
        binding.load(lengths, mask)
        logits, aux = runner(tokens, lengths[:, None] + depth)
    assert binding.calls == calls + 2
    for b in range(B):
        L = int(lengths[b])
        with torch.no_grad():
            ref = model(input_ids=prompt[b : b + 1, :L], use_cache=False).logits[0]
        torch.testing.assert_close(prefill_logits[b, :L], ref, rtol=1e-10, atol=1e-10)
        for i in range(T):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = trees[b][j]
            seq = torch.cat([prompt[b, :L], tokens[b, path[::-1]]])[None]
            with torch.no_grad():
                out = model(input_ids=seq, use_cache=False, output_hidden_states=True)
            torch.testing.assert_close(logits[b, i], out.logits[0, -1], rtol=1e-10, atol=1e-10)
            ref_aux = torch.cat([out.hidden_states[1][0, -1], out.hidden_states[2][0, -1]])
            torch.testing.assert_close(aux[b, i], ref_aux, rtol=1e-10, atol=1e-10)


def test_compiling_without_a_binding_is_refused():
    model = tiny_model("llama", layers=1)
    compiled = torch.compile(model, backend="treespec", options={"inductor": False}, fullgraph=True, dynamic=False)
    with pytest.raises(Exception, match="no TargetBinding"):
        with torch.no_grad():
            compiled(input_ids=torch.zeros(1, 3, dtype=torch.int64), use_cache=False)


def test_active_binding_context_and_plain_torch_compile():
    """``torch.compile(model, backend="treespec")`` with the binding made active while it compiles."""
    model = tiny_model("qwen3", layers=1)
    binding = TargetBinding(model, max_batch=1, max_seq_len=16, max_rows=4, page_size=4)
    compiled = torch.compile(model, backend="treespec", options={"inductor": False}, fullgraph=True, dynamic=False)
    ids = torch.tensor([[3, 1, 4, 1]])
    binding.load(torch.zeros(1, dtype=torch.int64), chain_mask(4)[None])
    with bound(binding), torch.no_grad():
        out = compiled(input_ids=ids, position_ids=torch.arange(4)[None], use_cache=False).logits
        ref = model(input_ids=ids, use_cache=False).logits
    assert binding.calls == 1
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_eager_attention_is_refused():
    model = tiny_model("llama", layers=1, attn_implementation="eager")
    binding = TargetBinding(model, max_batch=1, max_seq_len=16, max_rows=4, page_size=4)
    runner = TargetRunner(model, binding, inductor=False)
    binding.load(torch.zeros(1, dtype=torch.int64), chain_mask(4)[None])
    with pytest.raises(Exception, match="no SDPA call found"):
        with torch.no_grad():
            runner(torch.zeros(1, 4, dtype=torch.int64), torch.arange(4)[None])


class MyAttention(torch.nn.Module):
    """An attention class the registry does not know."""

    def forward(self, x):
        q = x.view(1, 1, x.shape[0], x.shape[1])
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).view_as(x)


def test_unrecognised_attention_class_is_refused():
    module = MyAttention()
    compiled = torch.compile(module, backend="treespec", options={"inductor": False}, fullgraph=True)
    with pytest.raises(Exception, match="unrecognised attention class"):
        compiled(torch.randn(5, 8))


def test_binding_for_another_model_is_refused():
    small = tiny_model("llama", layers=1)
    big = tiny_model("llama", layers=2)
    binding = TargetBinding(small, max_batch=1, max_seq_len=16, max_rows=4, page_size=4)
    runner = TargetRunner(big, binding, inductor=False)
    binding.load(torch.zeros(1, dtype=torch.int64), chain_mask(4)[None])
    with pytest.raises(Exception, match="not one the binding holds"):
        with torch.no_grad():
            runner(torch.zeros(1, 4, dtype=torch.int64), torch.arange(4)[None])


def test_inductor_compiles_the_rewritten_graph_and_mutates_the_cache_in_place():
    """Inductor once on CPU: the cache buffers are written in place, logits match (Inductor may keep
    HF's float32 RMSNorm round trip in float64, hence the 1e-6 tolerance)."""
    model = tiny_model("llama", layers=2)
    binding = TargetBinding(model, max_batch=1, max_seq_len=16, max_rows=4, page_size=4)
    runner = TargetRunner(model, binding, inductor=True)
    ids = torch.tensor([[5, 7, 11, 13, 17, 19, 23, 29]])
    with torch.no_grad():
        for start in (0, 4):
            binding.load(torch.tensor([start]), chain_mask(4)[None])
            logits, _ = runner(ids[:, start : start + 4], start + torch.arange(4)[None])
        ref = model(input_ids=ids, use_cache=False).logits[:, 4:]
    torch.testing.assert_close(logits, ref, rtol=1e-6, atol=1e-6)
    slots = binding.cache.slots(torch.arange(8)[None])[0]
    assert binding.cache.k[0][slots].abs().sum() > 0  # every key landed in the binding's own storage
    assert binding.calls == 2


def _graph(*ops):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for kind, target in ops:
        if kind == "method":
            g.call_method(target, (x, x, 0.0))
        else:
            g.call_function(target, (x, x))
    g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_dead_code_elimination_keeps_in_place_ops():
    """FX deems call_method pure; the clean-up must not drop an in-place method nobody reads."""
    import operator

    gm = _graph(("method", "masked_fill_"), ("function", operator.and_), ("function", operator.iadd))
    nodes = {n.target: n for n in gm.graph.nodes if n.op in ("call_method", "call_function")}
    assert not is_pure(nodes["masked_fill_"])
    assert is_pure(nodes[operator.and_])
    assert not is_pure(nodes[operator.iadd])
