"""Fused sibling projections: the weight layout (treecompile.projections) and the pass (fuse_projections).

The layout keeps the model's values and names and adds no memory (members become views of one tensor); the
rewritten graph runs one linear per q/k/v and gate/up group; its tree logits equal the per-path reference,
and speculative generate with fused projections equals HF greedy (float64, every supported family).
"""

import pytest
import torch

from treecompile.drafter import EagleDrafter
from treecompile.projections import fuse_projection_weights
from treecompile.speculator import TreeSpeculator
from treecompile.target import chain_mask

from test_rewrite_attention import FAMILIES, path_to, random_tree, rewrite_and_capture, tiny_model, tree_metadata

pytestmark = pytest.mark.usefixtures("one_thread")


def test_layout_keeps_values_names_and_views_one_tensor():
    model = tiny_model("qwen2")  # q/k/v carry biases
    before = {k: v.clone() for k, v in model.state_dict().items()}
    groups = fuse_projection_weights(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    layers = model.config.num_hidden_layers
    assert [g.module for g in groups] == [f"model.layers.{i}.{m}" for i in range(layers) for m in ("self_attn", "mlp")]
    attn, mlp = groups[0], groups[1]
    q, k, v = (getattr(model.model.layers[0].self_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    assert attn.sizes == (q.out_features, k.out_features, v.out_features)
    assert q.weight.data_ptr() == attn.weight.data_ptr()
    assert v.weight.data_ptr() == attn.weight[q.out_features + k.out_features :].data_ptr()
    assert k.bias.data_ptr() == attn.bias[q.out_features :].data_ptr()
    assert mlp.bias is None and mlp.members == ("gate_proj", "up_proj")
    # Loading a state dict copies into the views: still fused, new values visible through the fused tensor.
    model.load_state_dict({k: v + 1 for k, v in before.items()})
    assert all(g.intact() for g in groups)
    torch.testing.assert_close(attn.weight[: q.out_features], before["model.layers.0.self_attn.q_proj.weight"] + 1)
    # Fusing again reuses the intact storage.
    again = fuse_projection_weights(model)
    assert [g.weight.data_ptr() for g in again] == [g.weight.data_ptr() for g in groups]


def test_unfusable_groups_are_left_alone():
    model = tiny_model("llama", layers=1)
    model.model.layers[0].self_attn.k_proj.to(torch.float32)  # dtype differs from q and v
    groups = fuse_projection_weights(model)
    assert [g.module for g in groups] == ["model.layers.0.mlp"]


@pytest.mark.parametrize(
    "break_view",
    ["clone", "shifted rows", "narrowed", "bias clone", "dtype view", "unregistered"],
)
def test_intact_detects_every_kind_of_broken_view(break_view):
    """``intact`` compares precomputed (pointer, shape, stride, dtype, device) keys: each way a member can
    stop being its rows of the fused storage, even one that keeps a pointer into it, is caught."""
    model = tiny_model("qwen2", layers=1)  # q/k/v carry biases
    attn = fuse_projection_weights(model)[0]
    assert attn.intact() and attn.intact()  # the second call reads the cached keys
    q, k = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj
    rows = q.out_features
    if break_view == "clone":
        k.weight.data = k.weight.data.clone()
    elif break_view == "shifted rows":  # still inside the fused storage, one row off
        k.weight.data = attn.weight[rows + 1 : rows + 1 + k.out_features]
    elif break_view == "narrowed":  # the right pointer, one row short
        k.weight.data = attn.weight[rows : rows + k.out_features - 1]
    elif break_view == "bias clone":
        k.bias.data = k.bias.data.clone()
    elif break_view == "dtype view":  # same bytes read as another dtype
        same_size = {torch.float64: torch.complex64, torch.float32: torch.complex32, torch.float16: torch.bfloat16,
                     torch.bfloat16: torch.float16}  # fmt: skip
        q.weight.data = attn.weight[:rows].view(same_size[attn.weight.dtype])
        assert q.weight.data_ptr() == attn.weight.data_ptr() and q.weight.shape == (rows, attn.weight.shape[1])
    else:  # a plain tensor attribute in place of the parameter: found through getattr
        w = k.weight.detach()
        del k.weight
        k.weight = w.clone()
    assert not attn.intact()


def test_replaced_storage_is_refused_at_generate():
    model = tiny_model("llama", layers=2)
    model.generation_config.eos_token_id = None
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=2, steps=2, num_nodes=3,
                          max_batch_size=1, max_seq_len=32, page_size=8, fuse_projections=True)  # fmt: skip
    up = model.model.layers[1].mlp.up_proj
    up.weight.data = up.weight.data.clone()  # what model.to(...) / .half() do to every parameter
    with pytest.raises(ValueError, match=r"model: the weights of model.layers.1.mlp \(gate_proj, up_proj\) no longer"):
        spec.generate(torch.ones(1, 3, dtype=torch.int64), max_new_tokens=2)


@pytest.fixture(scope="module", params=FAMILIES)
def fused(request):
    """(family, model, binding, runner, rewritten GraphModule), fused projections, B=2 x T=9 rows."""
    family = request.param
    model = tiny_model(family)
    return (family, model, *rewrite_and_capture(model, fuse_projections=True))


def test_graph_runs_one_linear_per_group_over_the_fused_storage(fused):
    family, model, binding, runner, gm = fused
    layers = model.config.num_hidden_layers
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    # per layer: qkv, o, gate_up, down; plus the LM head
    assert len(linears) == 4 * layers + 1
    for j, group in enumerate(binding.projection_groups):
        assert getattr(gm, f"_treespec_fused_w{j}").data_ptr() == group.weight.data_ptr()


def test_fused_tree_logits_equal_per_path_reference(fused):
    family, model, binding, runner, gm = fused
    g = torch.Generator().manual_seed(3)
    B, T, P = 2, 9, 5
    prompt = torch.randint(0, 96, (B, P), generator=g)
    binding.load(torch.zeros(B, dtype=torch.int64), torch.where(torch.arange(9) < P, chain_mask(9), 0).expand(B, 9))
    with torch.no_grad():
        runner(torch.cat([prompt, torch.zeros(B, T - P, dtype=torch.int64)], 1),
               torch.arange(T).expand(B, T).contiguous())  # fmt: skip
    trees = [random_tree(T, g) for _ in range(B)]
    meta = [tree_metadata(t) for t in trees]
    tokens = torch.randint(0, 96, (B, T), generator=g)
    binding.load(torch.full((B,), P, dtype=torch.int64), torch.stack([m[1] for m in meta]))
    positions = torch.stack([P + m[0] for m in meta])
    with torch.no_grad():
        logits, _ = runner(tokens, positions)
    for b in range(B):
        for i in range(T):
            seq = torch.cat([prompt[b], tokens[b, path_to(trees[b], i)]])[None]
            with torch.no_grad():
                ref = model(input_ids=seq, use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits[b, i], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_fused_projections_equals_hf_greedy(family):
    model = tiny_model(family, seed=2, vocab_size=24)  # a small vocabulary: drafts get accepted
    model.generation_config.eos_token_id = None
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=3, steps=3, num_nodes=8,
                          max_batch_size=2, max_seq_len=64, page_size=8, fuse_projections=True)  # fmt: skip
    ids = torch.randint(1, 24, (2, 6), generator=torch.Generator().manual_seed(4))
    got = spec.generate(ids, max_new_tokens=12)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got.sequences, want)


def test_default_fuses_on_cuda_only():
    """fuse_projections=None: on for CUDA models (measured faster on the H200), off on CPU, where the model's
    parameters keep their own storage; an explicit bool always wins."""
    from treecompile.speculator import fuse_projections_default

    assert fuse_projections_default(None, torch.device("cuda")) is True
    assert fuse_projections_default(None, torch.device("cpu")) is False
    assert fuse_projections_default(True, torch.device("cpu")) is True
    assert fuse_projections_default(False, torch.device("cuda")) is False
    model = tiny_model("llama", layers=1)
    q_ptr = model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=2, steps=2, num_nodes=3,
                          max_batch_size=1, max_seq_len=32, page_size=8)  # fmt: skip
    assert spec.fuse_projections is False and spec.binding.projection_groups == []
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == q_ptr
