"""The linear-attention pass on tiny random hybrid HF models: Qwen3-Next and Qwen3.5 (GDN + gated
attention), Mamba2, and Bamba (Mamba2 + attention).

The rewritten graph holds ``treespec::causal_conv1d_tree_update`` and ``gdn_tree_verify`` /
``mamba2_tree_verify`` per linear layer, and none of HF's conv / recurrence; a tree forward's logits (and
the aux hidden states EAGLE-3 reads) equal the per-path reference: each root-to-node path run as a plain
sequence through the untouched HF model. HF computes the delta rule and the SSM scan in float32 even in a
float64 model, so those comparisons hold to ~1e-7, not 1e-10. Committing the accepted path must leave the
conv window and recurrent state HF's own cache holds after the same tokens.
"""

import pytest
import torch
from test_rewrite_attention import Captured, path_to, random_tree, tree_metadata

import treecompile.passes as passes_pkg
from treecompile.passes.rewrite_linear_attention import LINEAR_SEAMS
from treecompile.registry import linear_attention_layers, resolve_tree_support
from treecompile.target import TargetBinding, TargetRunner, chain_mask, parents_from_ancestor_mask

VOCAB = 96
B, T = 2, 9
TOL = dict(rtol=2e-6, atol=2e-6)  # HF's float32 recurrences inside the float64 model


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def tiny_model(family: str, seed: int = 0, conv_kernel: int = 4):
    """Tiny float64 models; Qwen3-Next runs dense MLPs (grouped_mm, its MoE kernel, has no float64)."""
    import transformers as tf

    torch.manual_seed(seed)
    gdn = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=conv_kernel,
               full_attention_interval=4, max_position_embeddings=512)  # fmt: skip
    if family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            **gdn, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
            num_experts_per_tok=1, mlp_only_layers=[0, 1, 2, 3]))  # fmt: skip
    elif family in ("qwen3_5", "qwen3_5-staged", "qwen3_5-sequential"):
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**gdn))
    elif family in ("mamba2", "mamba2-staged", "mamba2-chunked"):
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, head_dim=8, num_heads=8,
            n_groups=2, conv_kernel=conv_kernel, chunk_size=4))  # fmt: skip
    elif family == "bamba":
        model = tf.BambaForCausalLM(tf.BambaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=8, mamba_d_conv=conv_kernel, mamba_expand=2, mamba_chunk_size=4,
            max_position_embeddings=512))  # fmt: skip
    else:
        raise KeyError(family)
    return model.to(torch.float64).eval()


FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5-sequential", "qwen3_5-staged", "mamba2", "mamba2-staged",
            "mamba2-chunked", "bamba")
# T = 9 rows: GDN runs the chunked tree form (8..16 rows) unless the binding turns it off; Mamba2 the chunked
# form where the binding asks for it (Bamba and "mamba2-chunked"; on CPU the default is the sequential op).
RECURRENCE_OP = {"qwen3_next": "gdn_tree_verify_chunked", "qwen3_5": "gdn_tree_verify_chunked",
                 "qwen3_5-sequential": "gdn_tree_verify", "qwen3_5-staged": "gdn_tree_verify_staged",
                 "mamba2": "mamba2_tree_verify", "mamba2-staged": "mamba2_tree_verify_staged",
                 "mamba2-chunked": "mamba2_tree_verify_chunked", "bamba": "mamba2_tree_verify_chunked"}  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def rewritten(request):
    """(family, model, binding, runner, rewritten GraphModule) for B=2 requests x T=9 rows."""
    family = request.param
    model = tiny_model(family)
    binding = TargetBinding(model, max_batch=B, max_seq_len=48, max_rows=T, page_size=8,
                            replay_ssm=not family.endswith("-staged"),
                            gdn_chunked=not family.endswith("-sequential"),
                            mamba2_chunked=family in ("mamba2-chunked", "bamba"))  # fmt: skip
    runner = TargetRunner(model, binding, aux_layers=(1, 2), inductor=False)
    capture = Captured()
    mp = pytest.MonkeyPatch()
    mp.setattr(passes_pkg, "PASSES", passes_pkg.PASSES + [capture])
    breaks = torch._dynamo.utils.counters["graph_break"].copy()
    try:
        binding.load(torch.zeros(B, dtype=torch.int64), chain_mask(T).expand(B, T))
        with torch.no_grad():
            runner(torch.zeros(B, T, dtype=torch.int64), torch.arange(T).expand(B, T).contiguous())
    finally:
        mp.undo()
    assert torch._dynamo.utils.counters["graph_break"] == breaks  # fullgraph: no graph break anywhere
    assert len(capture.graphs) == 1
    return family, model, binding, runner, capture.graphs[0]


def _calls(gm) -> list:
    """Call targets, each eager-CPU direct call (passes/direct_cpu_ops.py) read as the op it stands for."""
    from treecompile.passes.direct_cpu_ops import DIRECT

    op_of = {impl: op for op, impl in DIRECT.items()}
    return [op_of.get(n.target, n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_rewritten_graph_has_tree_ops_and_no_hf_recurrence(rewritten):
    family, model, binding, runner, gm = rewritten
    targets = _calls(gm)
    names = [getattr(t, "__name__", str(t)) for t in targets]
    linear = binding.linear_layers
    assert linear and gm.treespec_linear_layers == [layer.name for layer in linear]
    ops = torch.ops.treespec
    assert targets.count(ops.causal_conv1d_tree_update.default) == len(linear)
    assert targets.count(getattr(ops, RECURRENCE_OP[family]).default) == len(linear)
    assert targets.count(ops.kv_write.default) == len(binding.layers)  # the attention layers, if any
    assert targets.count(ops.tree_attention_paged.default) == len(binding.layers)
    assert not LINEAR_SEAMS & set(names)  # HF's conv and recurrence are gone ...
    assert not {"conv1d", "linalg_solve_triangular", "einsum", "scaled_dot_product_attention"} & set(names)
    # ... and verify writes no committed pool: only the payload / scratch, workspace and conv_x buffers.
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "copy_":
            assert node.args[0].args[0].target.startswith("_treespec_conv_x")


def test_graph_reads_the_bindings_own_state_pools(rewritten):
    """Fixed addresses: the graph's buffers are the binding's storage, not copies."""
    family, model, binding, runner, gm = rewritten
    last = binding.linear_layers[-1].index
    assert gm._treespec_parents.data_ptr() == binding.parents.data_ptr()
    assert getattr(gm, f"_treespec_conv_state{last}").data_ptr() == binding.conv_state[last].data_ptr()
    assert getattr(gm, f"_treespec_ssm_state{last}").data_ptr() == binding.ssm_state[last].data_ptr()
    assert getattr(gm, f"_treespec_conv_x{last}").data_ptr() == binding.conv_x[last].data_ptr()
    pool = binding.payload if binding.replay_ssm else binding.scratch
    name = "payload" if binding.replay_ssm else "scratch"
    assert getattr(gm, f"_treespec_{name}{last}").data_ptr() == pool[last].data_ptr()
    for shape, workspace in binding.gdn_workspace.items():
        assert getattr(gm, "_treespec_" + binding.workspace_name(shape)).data_ptr() == workspace.data_ptr()


def _prefill(binding, runner, prompt, lengths):
    """Ragged prompts as one padded chain forward, then commit each request's valid rows."""
    valid = torch.arange(T)[None, :] < lengths[:, None]
    binding.load(torch.zeros(B, dtype=torch.int64), torch.where(valid, chain_mask(T), 0), valid)
    logits, _ = runner(torch.where(valid, prompt, 0), torch.where(valid, torch.arange(T), 0))
    binding.commit_linear_state(torch.arange(T).expand(B, T), lengths.clone())
    return logits


def test_tree_logits_equal_per_path_reference(rewritten):
    """B=2 ragged prefixes (5 and 9 tokens), then a random 9-node tree per request: every node's logits and
    aux hidden states equal HF's on the root-to-node path; the verify forward leaves the committed pools
    untouched."""
    family, model, binding, runner, gm = rewritten
    g = torch.Generator().manual_seed(sum(map(ord, family)))
    lengths = torch.tensor([5, 9])
    prompt = torch.randint(1, VOCAB, (B, T), generator=g)
    binding.reset_linear_state()
    with torch.no_grad():
        prefill_logits = _prefill(binding, runner, prompt, lengths)
        trees = [random_tree(T, g) for _ in range(B)]
        meta = [tree_metadata(p) for p in trees]
        depth = torch.stack([d for d, _ in meta])
        mask = torch.stack([m for _, m in meta])
        tokens = torch.randint(1, VOCAB, (B, T), generator=g)
        committed = [t.clone() for t in binding.conv_state + binding.ssm_state]
        binding.load(lengths, mask, parents=torch.tensor(trees))
        logits, aux = runner(tokens, lengths[:, None] + depth)
    for before, after in zip(committed, binding.conv_state + binding.ssm_state):
        assert torch.equal(before, after)  # verify reads the pools only
    for b in range(B):
        L = int(lengths[b])
        with torch.no_grad():
            ref = model(input_ids=prompt[b : b + 1, :L], use_cache=False).logits[0]
        torch.testing.assert_close(prefill_logits[b, :L], ref, **TOL)
        for i in range(T):
            seq = torch.cat([prompt[b, :L], tokens[b, path_to(trees[b], i)]])[None]
            with torch.no_grad():
                out = model(input_ids=seq, use_cache=False, output_hidden_states=True)
            torch.testing.assert_close(logits[b, i], out.logits[0, -1], **TOL)
            ref_aux = torch.cat([out.hidden_states[1][0, -1], out.hidden_states[2][0, -1]])
            torch.testing.assert_close(aux[b, i], ref_aux, **TOL)


def _hf_step(model, ids, cache, start: int = 0):
    """One HF forward with its cache (the cache keyword differs across models and transformers versions);
    explicit positions, since some hybrids (Bamba) restart at 0 without them."""
    import inspect

    params = inspect.signature(model.forward).parameters
    key = next(k for k in ("cache", "cache_params", "past_key_values") if k in params)
    kwargs = {} if cache is None else {key: cache}
    if "position_ids" in params:
        kwargs["position_ids"] = start + torch.arange(ids.shape[1])[None]
    out = model(input_ids=ids, use_cache=True, **kwargs)
    returned = (getattr(out, k, None) for k in ("cache", "cache_params", "past_key_values"))
    return out, next(c for c in returned if c is not None)


def _hf_states(cache, layer_idx: int):
    """(conv window [B, C, Kw], recurrent state) of HF's cache for one layer (transformers 5.24 and 5.17)."""
    if hasattr(cache, "get_conv_state"):
        return cache.get_conv_state(layer_idx, state_idx=0), cache.get_recurrent_state(layer_idx, state_idx=0)
    layer = cache.layers[layer_idx]
    return layer.conv_states[0], layer.recurrent_states[0]


def test_commit_of_an_accepted_path_equals_hf_decode_state(rewritten):
    """Prefill, verify a tree, accept a root-to-leaf path: the committed conv window and recurrent state
    equal those HF's cache holds after the prompt plus that path (HF: chunked prefill, then one-token
    decode steps)."""
    family, model, binding, runner, gm = rewritten
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([4, 7])
    prompt = torch.randint(1, VOCAB, (B, T), generator=g)
    binding.reset_linear_state()
    trees = [random_tree(T, g) for _ in range(B)]
    tokens = torch.randint(1, VOCAB, (B, T), generator=g)
    with torch.no_grad():
        _prefill(binding, runner, prompt, lengths)
        depth = torch.stack([tree_metadata(p)[0] for p in trees])
        mask = torch.stack([tree_metadata(p)[1] for p in trees])
        binding.load(lengths, mask)  # parents derived from the mask this time
        assert torch.equal(binding.parents[:B, :T], torch.tensor(trees))
        runner(tokens, lengths[:, None] + depth)
    paths = [path_to(trees[b], max(range(T), key=lambda i: (len(path_to(trees[b], i)), -i))) for b in range(B)]
    accepted = torch.full((B, T), -1, dtype=torch.int64)
    for b, p in enumerate(paths):
        accepted[b, : len(p)] = torch.tensor(p)
    binding.commit_linear_state(accepted, torch.tensor([len(p) for p in paths]))
    layer_idx = {layer.name: int(layer.name.split(".layers.")[1].split(".")[0]) for layer in binding.linear_layers}
    for b in range(B):
        L = int(lengths[b])
        with torch.no_grad():
            _, cache = _hf_step(model, prompt[b : b + 1, :L], None)
            for step, node in enumerate(paths[b]):
                _, cache = _hf_step(model, tokens[b : b + 1, node : node + 1], cache, start=L + step)
        for layer in binding.linear_layers:
            conv, state = _hf_states(cache, layer_idx[layer.name])
            width = layer.conv_kernel - 1
            torch.testing.assert_close(binding.conv_state[layer.index][b], conv[0, :, -width:].to(torch.float64), **TOL)
            torch.testing.assert_close(binding.ssm_state[layer.index][b], state[0].to(torch.float64), **TOL)


def test_parents_from_ancestor_mask_covers_all_64_rows():
    g = torch.Generator().manual_seed(0)
    trees = [random_tree(64, g), list(range(-1, 63)), [-1] * 64]
    masks = torch.stack([tree_metadata(p)[1] for p in trees])
    assert torch.equal(parents_from_ancestor_mask(masks), torch.tensor(trees))
    assert torch.equal(parents_from_ancestor_mask(torch.zeros(1, 5, dtype=torch.int64)), torch.full((1, 5), -1))


# -------------------------------------------------------------------------------------------------------------
# Refusals: at startup (capability resolution), and in the pass
# -------------------------------------------------------------------------------------------------------------


def blockers(excinfo) -> list[str]:
    return [line[4:] for line in str(excinfo.value).splitlines() if line.startswith("  - ")]


def test_hybrid_models_resolve():
    for family in ("qwen3_next", "mamba2"):
        resolved = resolve_tree_support(tiny_model(family), max_seq_len=64)
        expected = ["gdn"] * 3 if family == "qwen3_next" else ["mamba2"] * 2
        assert [layer.family for layer in resolved.linear_layers] == expected
        assert len(resolved.target_layers) == (1 if family == "qwen3_next" else 0)


def test_unsupported_conv_kernel_and_state_dtype_are_refused_in_one_message():
    model = tiny_model("qwen3_next", conv_kernel=5)
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(model, max_seq_len=64, state_dtype=torch.bfloat16, replay_ssm=False)
    found = blockers(excinfo)
    assert len(found) == 3  # one line per GDN layer, every reason on it
    for line in found:
        assert line.startswith("target linear-attention layer")
        assert "conv kernel size 5 has no tree conv kernel" in line
        assert "recurrent state dtype torch.bfloat16 is not supported" in line
        assert "replay_ssm" not in line  # the staged GDN path has a kernel (gdn_tree_verify_staged)


def test_staged_gdn_path_resolves_and_binds_no_workspace():
    """replay_ssm=False is no blocker for GDN: a per-layer scratch, and no shared branch-point workspace."""
    model = tiny_model("qwen3_next")
    resolved = resolve_tree_support(model, max_seq_len=64, replay_ssm=False)
    binding = TargetBinding(model, max_batch=2, max_seq_len=32, max_rows=5, page_size=8,
                            linear_layers=resolved.linear_layers, replay_ssm=False)  # fmt: skip
    assert not binding.payload and not binding.gdn_workspace
    assert [tuple(s.shape) for s in binding.scratch] == [(2, 5, 4, 8, 8)] * 3  # [B, N, Hv, Dk, Dv] per layer
    assert not any(name.startswith("gdn_workspace") for name in binding.graph_tensors())


def test_linear_attention_without_a_tree_kernel_is_refused():
    """Kimi Linear's KDA and Mamba1 keep recurrent state but have no tree kernel; Kimi's MLA attention class
    is merely unrecognised. Containers (MambaBlock, MambaModel) are not reported, their mixers are."""
    import transformers as tf

    kimi = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(
        vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_experts=2, num_experts_per_token=1, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, linear_head_dim=16, linear_num_heads=2,
        layer_types=["linear_attention", "full_attention"]))  # fmt: skip
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(kimi, max_seq_len=64)
    found = blockers(excinfo)
    assert len(found) == 2
    assert found[0].endswith(
        "(KimiLinearDeltaAttention): linear attention KimiLinearDeltaAttention (KDA, Kimi delta attention) has "
        "no tree kernel (supported linear attention: BambaMixer, Mamba2Mixer, Qwen3NextGatedDeltaNet, "
        "Qwen3_5GatedDeltaNet)"
    )
    assert "KimiLinearAttention): unrecognised attention class" in found[1]

    mamba1 = tf.MambaForCausalLM(tf.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8))
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(mamba1, max_seq_len=64)
    assert blockers(excinfo) == [
        f"target layer backbone.layers.{i}.mixer (MambaMixer): linear attention MambaMixer (Mamba1 selective "
        "scan) has no tree kernel (supported linear attention: BambaMixer, Mamba2Mixer, Qwen3NextGatedDeltaNet, "
        "Qwen3_5GatedDeltaNet)" for i in range(2)
    ]


def test_a_renamed_seam_is_refused_not_passed_through(monkeypatch):
    """Detect, don't assume: a transformers release without the seam the pass replaces fails at startup."""
    import transformers.models.mamba2.modeling_mamba2 as modeling

    monkeypatch.delattr(modeling, "mamba2_chunk_scan")
    (layer, _) = linear_attention_layers(tiny_model("mamba2"))
    assert any("has no mamba2_chunk_scan()" in p for p in layer.problems)
    with pytest.raises(ValueError, match="has no mamba2_chunk_scan"):
        resolve_tree_support(tiny_model("mamba2"), max_seq_len=64)


def test_a_seam_wrapped_in_a_kernels_module_binds_the_function_inside():
    """transformers 5.25's ``kernels`` dependency turns hub-replaceable seams into ``nn.Module`` wrappers whose
    forward calls the function in its closure; the layer's seam must be that function (Dynamo then keeps it as
    one call node), not the module. A module without such a closure, and a plain function, stay as they are."""
    from treecompile.registry import _kernel_func_target

    def causal_conv1d_fn(x):
        return x

    def wrap(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    wrapped = wrap(causal_conv1d_fn)
    assert _kernel_func_target(wrapped) is causal_conv1d_fn
    assert _kernel_func_target(causal_conv1d_fn) is causal_conv1d_fn
    plain = torch.nn.Identity()
    assert _kernel_func_target(plain) is plain
    assert _kernel_func_target(None) is None
    # Whatever this transformers release exports, the bound seams are plain functions under their HF names.
    for family in ("qwen3_next", "mamba2"):
        (layer, *_) = linear_attention_layers(tiny_model(family))
        for name, fn in layer.seams.items():
            assert not isinstance(fn, torch.nn.Module) and fn.__name__ == name, (family, name, fn)


def test_hf_cache_path_is_refused_by_the_pass():
    model = tiny_model("mamba2")
    binding = TargetBinding(model, max_batch=1, max_seq_len=16, max_rows=4, page_size=4)
    compiled = torch.compile(model, backend="treespec", fullgraph=True, dynamic=False,
                             options={"binding": binding, "inductor": False})  # fmt: skip
    binding.load(torch.zeros(1, dtype=torch.int64), chain_mask(4)[None])
    with pytest.raises(Exception, match="HF cache state"):
        with torch.no_grad():
            compiled(input_ids=torch.ones(1, 4, dtype=torch.int64), use_cache=True)


def test_binding_for_another_model_is_refused():
    small = tiny_model("mamba2")
    small.backbone.layers = small.backbone.layers[:1]
    binding = TargetBinding(small, max_batch=1, max_seq_len=16, max_rows=4, page_size=4)
    runner = TargetRunner(tiny_model("mamba2"), binding, inductor=False)
    binding.load(torch.zeros(1, dtype=torch.int64), chain_mask(4)[None])
    with pytest.raises(Exception, match="not one the binding holds"):
        with torch.no_grad():
            runner(torch.zeros(1, 4, dtype=torch.int64), torch.arange(4)[None])


def test_inductor_mutates_the_bindings_pools_in_place():
    """Inductor once on CPU (Mamba2, the quickest to compile): the payload and conv_x rows the forward
    writes land in the binding's own buffers, so a prefill commit followed by a chain continuation
    reproduces HF (Inductor may fuse HF's float32 round trips differently, hence 1e-6)."""
    model = tiny_model("mamba2")
    binding = TargetBinding(model, max_batch=1, max_seq_len=16, max_rows=4, page_size=4)
    runner = TargetRunner(model, binding, inductor=True)
    ids = torch.tensor([[5, 7, 11, 13, 17, 19, 23, 29]])
    with torch.no_grad():
        for start in (0, 4):
            binding.load(torch.tensor([start]), chain_mask(4)[None])
            logits, _ = runner(ids[:, start : start + 4], start + torch.arange(4)[None])
            binding.commit_linear_state(torch.arange(4)[None], torch.tensor([4]))
        ref = model(input_ids=ids, use_cache=False).logits[:, 4:]
    torch.testing.assert_close(logits, ref, rtol=1e-6, atol=1e-6)
    assert binding.calls == 2


@pytest.mark.parametrize("rows,op", [(3, "mamba2_tree_verify"), (4, "mamba2_tree_verify_chunked")])
def test_mamba2_chunked_form_starts_at_four_rows(rows, op):
    """With mamba2_chunked, forwards of fewer than MAMBA2_CHUNKED_MIN_ROWS rows keep the sequential kernel
    (cheaper there on the H200); from four rows on the chunked form runs."""
    from treecompile.passes.rewrite_linear_attention import MAMBA2_CHUNKED_MIN_ROWS

    assert MAMBA2_CHUNKED_MIN_ROWS == 4
    model = tiny_model("mamba2")
    binding = TargetBinding(model, max_batch=1, max_seq_len=32, max_rows=rows, page_size=8, mamba2_chunked=True)
    runner = TargetRunner(model, binding, aux_layers=(1, 2), inductor=False)
    capture = Captured()
    mp = pytest.MonkeyPatch()
    mp.setattr(passes_pkg, "PASSES", passes_pkg.PASSES + [capture])
    try:
        binding.load(torch.zeros(1, dtype=torch.int64), chain_mask(rows)[None])
        with torch.no_grad():
            runner(torch.ones(1, rows, dtype=torch.int64), torch.arange(rows)[None])
    finally:
        mp.undo()
    targets = _calls(capture.graphs[0])
    assert targets.count(getattr(torch.ops.treespec, op).default) == len(binding.linear_layers)
