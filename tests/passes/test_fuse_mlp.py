"""fuse_mlp: a few-row gated MLP (separate or fused gate/up projections) becomes one treespec::fused_mlp call;
everything the pass must not touch stays as it was.

The op's Triton path is CUDA-only; here the pass is told CPU counts too (its CPU path is the reference), so
the rewrite, the cases it leaves alone and the values are checked on this machine. The kernels are checked in
tests/ops/test_fused_mlp.py; on the GPU, tests/gpu/mlp_sweep.py checks and times them against the unfused
chain before any shape enters the measured table.
"""

import importlib
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from treecompile.ops import fused_mlp as mlp_op
from treecompile.ops.fused_mlp import fused_mlp_reference
from treecompile.passes import PASSES, fuse_mlp, skinny_linears

from test_outer_products import capture

fuse_module = importlib.import_module("treecompile.passes.fuse_mlp")  # the package attribute is the pass
pytestmark = pytest.mark.usefixtures("one_thread")

ON = SimpleNamespace(binding=SimpleNamespace(skinny_linears=True))
OFF = SimpleNamespace(binding=SimpleNamespace(skinny_linears=False))
FUSED = torch.ops.treespec.fused_mlp.default
H, I = 32, 48


def calls(gm, target=FUSED):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def separate(x, gate, up, down):  # HF LlamaMLP, as Dynamo records it
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def fused_layout(x, gate_up, down):  # fuse_projections' layout: one linear, split in halves
    g, u = torch.split(F.linear(x, gate_up), [I, I], dim=-1)
    return F.linear(F.silu(g) * u, down)


def weights(dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(I, H, generator=gen) / H**0.5).to(dtype)
    up = (torch.randn(I, H, generator=gen) / H**0.5).to(dtype)
    down = (torch.randn(H, I, generator=gen) / I**0.5).to(dtype)
    return gate, up, down


def rows(n, dtype=torch.float16, seed=1):
    return torch.randn(1, n, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def cpu_counts(monkeypatch):
    """The pass runs on CPU graphs, and (M, 32, 48) counts as a measured win for every M <= 16."""
    monkeypatch.setattr(fuse_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(mlp_op, "_MEASURED", {})
    monkeypatch.delenv(mlp_op.FUSED_MLP_ENV, raising=False)
    for M in (1, 16):
        mlp_op._MEASURED[(M, H, I)] = (16, 16, 16, 4, 2, 16, 4, 8.0, 10.0, False)


def test_the_pass_runs_before_skinny_linears():
    assert PASSES.index(fuse_mlp) < PASSES.index(skinny_linears)


@pytest.mark.parametrize("n", [1, 4, 16])
def test_separate_projections_become_one_call(cpu_counts, n):
    gate, up, down = weights()
    x = rows(n)
    gm = capture(separate, x, gate, up, down)
    (want,) = gm(x, gate, up, down)
    gm = fuse_mlp(gm, ON)
    (call,) = calls(gm)
    assert not calls(gm, torch._C._nn.linear) and not calls(gm, F.silu) and not calls(gm, operator.mul)
    assert call.args[4] is True  # graph-input weights: parameters
    (got,) = gm(x, gate, up, down)
    assert got.shape == want.shape
    assert torch.equal(got, fused_mlp_reference(x.reshape(n, H), gate, up, down).reshape(1, n, H))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # the unfused path rounds silu and mul apart


def test_fused_gate_up_is_passed_as_two_views(cpu_counts):
    gate, up, down = weights(seed=2)
    gate_up = torch.cat([gate, up])
    x = rows(4)
    gm = capture(fused_layout, x, gate_up, down)
    gm = fuse_mlp(gm, ON)
    (call,) = calls(gm)
    assert [n.target for n in call.args[1:3]] == [torch.narrow, torch.narrow]
    assert [n.args[1:] for n in call.args[1:3]] == [(0, 0, I), (0, I, I)]
    assert not calls(gm, torch.split) and not calls(gm, torch._C._nn.linear)
    (got,) = gm(x, gate_up, down)
    assert torch.equal(got, fused_mlp_reference(x.reshape(4, H), gate, up, down).reshape(1, 4, H))


def _gelu(x, gate, up, down):
    return F.linear(F.gelu(F.linear(x, gate)) * F.linear(x, up), down)


def _gate_bias(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate, torch.ones(I, dtype=x.dtype))) * F.linear(x, up), down)


def _silu_reused(x, gate, up, down):
    a = F.silu(F.linear(x, gate))
    return F.linear(a * F.linear(x, up), down), a


def _two_inputs(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x * 2, up), down)


def _unequal_split(x, gate_up, down):
    g, u = torch.split(F.linear(x, gate_up), [I - 8, I + 8], dim=-1)
    return F.linear(F.silu(g[..., : I - 8]) * u[..., : I - 8], down[:, : I - 8])


@pytest.mark.parametrize("fn", [_gelu, _gate_bias, _silu_reused, _two_inputs], ids=lambda f: f.__name__)
def test_other_patterns_are_left_alone(cpu_counts, fn):
    gate, up, down = weights()
    x = rows(4)
    gm = capture(fn, x, gate, up, down)
    before = [n.target for n in gm.graph.nodes]
    gm = fuse_mlp(gm, ON)
    assert not calls(gm) and [n.target for n in gm.graph.nodes] == before


def test_unequal_split_is_left_alone(cpu_counts):
    gate, up, down = weights()
    gm = fuse_mlp(capture(_unequal_split, rows(4), torch.cat([gate, up]), down), ON)
    assert not calls(gm)


def test_rows_dtype_device_and_binding_rules(cpu_counts, monkeypatch):
    gate, up, down = weights()
    assert not calls(fuse_mlp(capture(separate, rows(17), gate, up, down), ON))  # past 16 rows
    w32 = [w.float() for w in (gate, up, down)]
    assert not calls(fuse_mlp(capture(separate, rows(4, torch.float32), *w32), ON))  # float32: HF's own GEMMs
    assert not calls(fuse_mlp(capture(separate, rows(4), gate, up, down), OFF))
    assert not calls(fuse_mlp(capture(separate, rows(4), gate, up, down), SimpleNamespace()))
    monkeypatch.setattr(fuse_module, "_DEVICE_TYPES", ("cuda",))
    assert not calls(fuse_mlp(capture(separate, rows(4), gate, up, down), ON))  # CPU tensors: the op's reference


def test_unmeasured_shapes_wait_for_the_table_or_the_switch(cpu_counts, monkeypatch):
    gate, up, down = weights()
    mlp_op._MEASURED.clear()
    assert not calls(fuse_mlp(capture(separate, rows(4), gate, up, down), ON))
    mlp_op._MEASURED[(16, H, I)] = (16, 16, 16, 4, 2, 16, 4, 9.9, 10.0, False)  # within 2% of the chain: unfused
    assert not calls(fuse_mlp(capture(separate, rows(4), gate, up, down), ON))
    monkeypatch.setenv(mlp_op.FUSED_MLP_ENV, "1")
    assert len(calls(fuse_mlp(capture(separate, rows(4), gate, up, down), ON))) == 1


def test_a_weight_computed_in_the_graph_is_not_marked_constant(cpu_counts):
    gate, up, down = weights()

    def scaled(x, gate, up, down):
        h = F.silu(F.linear(x, gate)) * F.linear(x, up)  # inputs used in order: the graph keeps (x, gate, up, down)
        return F.linear(h, down * 2)

    x = rows(1)
    gm = fuse_mlp(capture(scaled, x, gate, up, down), ON)
    (call,) = calls(gm)
    assert call.args[4] is False
    assert torch.equal(gm(x, gate, up, down)[0], fused_mlp_reference(x.reshape(1, H), gate, up, down * 2).reshape(1, 1, H))


def test_every_layer_of_a_tiny_llama_is_fused_and_logits_hold(monkeypatch):
    """Through the treespec backend (eager graph, float16 on CPU, fused projections, 4 rows a forward): each
    decoder layer's MLP is one fused_mlp call, and the logits match the unfused graph's to float16 rounding."""
    from test_rewrite_attention import Captured, tiny_model

    import treecompile.passes as passes_pkg
    from treecompile.target import TargetBinding, TargetRunner, chain_mask

    monkeypatch.setattr(fuse_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    model = tiny_model("llama", layers=2).to(torch.float16)
    ids = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(3))
    logits = {}
    for mode in ("0", "1", "1+inductor"):  # Inductor lowers the op with the weight halves as views (no copy)
        monkeypatch.setenv(mlp_op.FUSED_MLP_ENV, mode[0])
        binding = TargetBinding(model, max_batch=1, max_seq_len=32, max_rows=4, page_size=8, skinny_linears=True,
                                fuse_projections=True)  # fmt: skip
        runner = TargetRunner(model, binding, aux_layers=(0, 1), inductor=mode.endswith("inductor"))
        captured = Captured()
        monkeypatch.setattr(passes_pkg, "PASSES", passes_pkg.PASSES + [captured])
        torch._dynamo.reset()
        binding.load(torch.zeros(1, dtype=torch.int64), chain_mask(4).expand(1, 4))
        with torch.no_grad():
            out = runner(ids, torch.arange(4).expand(1, 4).contiguous())
        logits[mode] = (out[0] if isinstance(out, tuple) else out).float()
        monkeypatch.setattr(passes_pkg, "PASSES", [p for p in passes_pkg.PASSES if p is not captured])
        fused = calls(captured.graphs[0])
        assert len(fused) == (0 if mode == "0" else 2)
        assert all(len(c.args) == 8 and c.args[6] is not None for c in fused)  # the post-attention norm and add in
    assert torch.isfinite(logits["1"]).all()
    torch.testing.assert_close(logits["1"], logits["0"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logits["1+inductor"], logits["1"], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fused_projections", [False, True], ids=["separate", "fused"])
def test_drafter_mlp_takes_the_op_where_it_applies(monkeypatch, fused_projections):
    """EagleDrafter.skinny_linears() lets the head's MLP call treespec::fused_mlp where mlp_applies holds (on
    the GPU: 16-bit CUDA, <= 16 rows, a measured win); gate and up are the halves of the fused weight when the
    projections are fused. Here mlp_applies is told yes on the CPU, where the op is its reference."""
    from test_rewrite_attention import tiny_model

    from treecompile import drafter as drafter_module
    from treecompile.drafter import EagleDrafter

    head = EagleDrafter.for_target(tiny_model("llama"), seed=0).float()
    if fused_projections:
        head.fuse_projections()
    mlp = head.midlayer.mlp
    assert (mlp.gate_up_weight is not None) == fused_projections
    x = torch.randn(1, 4, mlp.gate_proj.in_features)
    want = mlp(x)
    head.skinny_linears()
    assert mlp.fused_mlp and mlp.silu
    assert torch.equal(mlp(x), want)  # on the CPU mlp_applies is False: the unfused path, unchanged
    seen = []
    monkeypatch.setattr(drafter_module, "mlp_applies", lambda *a: seen.append(a) or True)
    got = mlp(x)
    (args,) = seen
    assert torch.equal(args[1], mlp.gate_proj.weight) and torch.equal(args[2], mlp.up_proj.weight)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    assert torch.equal(got, fused_mlp_reference(x.reshape(4, -1), *w).reshape(x.shape))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _hf_layer_tail():
    """The tail of an HF decoder layer: residual add, post-attention LlamaRMSNorm, LlamaMLP, residual add."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I)).half()
    norm = LlamaRMSNorm(H, eps=1e-5).half()
    with torch.no_grad():
        norm.weight.add_(0.2 * torch.randn(H).half())
    return mlp, norm


def test_rms_norm_and_residual_add_go_into_the_op(cpu_counts):
    mlp, norm = _hf_layer_tail()

    def tail(residual, attn):
        h = residual + attn
        return h + mlp(norm(h))

    residual, attn = rows(4, seed=5), rows(4, seed=6)
    inputs = []  # the graph's placeholders: the two rows, then the modules' lifted parameters
    gm = capture(tail, residual, attn, inputs=inputs)
    (want,) = gm(*inputs)
    gm = fuse_mlp(gm, ON)
    (call,) = calls(gm)
    assert not calls(gm, torch.rsqrt) and not calls(gm, torch._C._nn.linear)
    assert len(calls(gm, operator.add)) == 2  # the residual add stays for the closing add; eps's add is gone
    x_node, residual_node = call.args[0], call.args[6]
    assert x_node.args[0].name == "l_residual_" and residual_node.args[0].name == "l_attn_"
    assert call.args[5].op == "placeholder" and call.args[7] == 1e-5
    (got,) = gm(*inputs)
    h = residual + attn
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    mlp_out = fused_mlp_reference(residual.reshape(4, H), *w, norm.weight, attn.reshape(4, H), 1e-5)
    assert torch.equal(got, h + mlp_out.reshape(1, 4, H))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_a_norm_used_elsewhere_stays_and_the_switch_turns_the_fold_off(cpu_counts, monkeypatch):
    mlp, norm = _hf_layer_tail()

    def tail_reused(residual, attn):
        x = norm(residual + attn)
        return mlp(x), x  # the normed input has another user: the norm stays a graph kernel

    def plain_norm(s):
        return mlp(norm(s))  # no residual add before the norm: the op normalises s itself

    args = (rows(2, seed=1), rows(2, seed=2))
    gm = fuse_mlp(capture(tail_reused, *args), ON)
    (call,) = calls(gm)
    assert len(call.args) == 5 and len(calls(gm, torch.rsqrt)) == 1
    s = rows(2, seed=3)
    inputs = []
    gm = fuse_mlp(capture(plain_norm, s, inputs=inputs), ON)
    (call,) = calls(gm)
    assert call.args[6] is None and not calls(gm, torch.rsqrt)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    want = fused_mlp_reference(s.reshape(2, H), *w, norm.weight, None, 1e-5).reshape(1, 2, H)
    assert torch.equal(gm(*inputs)[0], want)
    monkeypatch.setenv(fuse_module.NORM_ENV, "0")
    (call,) = calls(fuse_mlp(capture(plain_norm, s), ON))
    assert len(call.args) == 5
    monkeypatch.setenv(fuse_module.NORM_ENV, "off")
    with pytest.raises(ValueError, match="TREECOMPILE_FUSED_MLP_NORM: expected 0 or 1, got 'off'"):
        fuse_mlp(capture(plain_norm, s), ON)


@pytest.mark.parametrize("fold", ["1", "0"])
def test_drafter_layer_folds_its_residual_add_and_norm(monkeypatch, fold):
    """With the fused MLP on, the head's decoder layer hands the residual add and the post-attention RMSNorm to
    the op (unless TREECOMPILE_FUSED_MLP_NORM=0): the layer's output is residual + attn + the op's MLP of
    norm(residual + attn), close to the unfused layer's. mlp_applies is told yes on the CPU (the op's
    reference); the attention is replaced by a fixed tensor."""
    from test_rewrite_attention import tiny_model

    from treecompile import drafter as drafter_module
    from treecompile.drafter import EagleDrafter

    monkeypatch.setenv(mlp_op.FUSED_MLP_NORM_ENV, fold)
    head = EagleDrafter.for_target(tiny_model("llama"), seed=0).float()
    layer = head.midlayer
    width = layer.mlp.gate_proj.in_features
    gen = torch.Generator().manual_seed(4)
    embeds, hidden, attn = (torch.randn(1, 3, width, generator=gen) for _ in range(3))
    monkeypatch.setattr(layer.self_attn, "forward", lambda *a, **k: attn)
    want = layer(embeds, hidden, *[None] * 7)
    head.skinny_linears()
    calls_seen = []
    real = torch.ops.treespec.fused_mlp

    def spy(*args):
        calls_seen.append(args)
        return real(*args)

    monkeypatch.setattr(drafter_module, "mlp_applies", lambda *a: True)
    monkeypatch.setattr(torch.ops.treespec, "fused_mlp", spy)
    got = layer(embeds, hidden, *[None] * 7)
    (args,) = calls_seen
    norm = layer.post_attention_layernorm
    w = (layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight)
    if fold == "1":
        assert args[5] is norm.weight and torch.equal(args[0], hidden.reshape(3, width))
        mlp_out = fused_mlp_reference(hidden.reshape(3, width), *w, norm.weight, attn.reshape(3, width), norm.variance_epsilon)
    else:
        assert len(args) == 5
        mlp_out = fused_mlp_reference(norm(hidden + attn).reshape(3, width), *w)
    assert torch.equal(got, (hidden + attn) + mlp_out.reshape(1, 3, width))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_generate_with_the_head_on_the_fused_op_equals_hf_greedy(monkeypatch):
    """Lossless end to end with the head's MLP (and its post-attention norm) on treespec::fused_mlp: float32 on
    the CPU, mlp_applies told yes (the op's reference), the head's other linears through linear_rows. The head
    only changes what is drafted, so the output must equal HF greedy token for token; the op must have run
    for the lanes (B x K rows) and the chain steps (the head's prefill and each round's accepted tokens)."""
    from test_rewrite_attention import tiny_model

    from treecompile import drafter as drafter_module
    from treecompile.drafter import EagleDrafter
    from treecompile.speculator import TreeSpeculator

    model = tiny_model("llama", seed=2, vocab_size=24).float()
    model.generation_config.eos_token_id = None
    head = EagleDrafter.for_target(model, seed=1).float()
    head.skinny_linears()
    rows_seen = []
    real = torch.ops.treespec.fused_mlp

    def spy(x, *args):
        rows_seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(drafter_module, "mlp_applies", lambda *a: True)
    monkeypatch.setattr(torch.ops.treespec, "fused_mlp", spy)
    spec = TreeSpeculator(model, head, topk=3, steps=3, num_nodes=8, max_batch_size=2, max_seq_len=64, page_size=8)
    ids = torch.randint(1, 24, (2, 6), generator=torch.Generator().manual_seed(4))
    got = spec.generate(ids, max_new_tokens=12)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got.sequences, want)
    assert 2 * 3 in rows_seen and len(set(rows_seen)) > 1, rows_seen  # the lanes' 2 x 3 rows, and chain steps


def generate_equals_hf_greedy(model, topk: int, num_nodes: int, **speculator_kwargs) -> None:
    """A random head's speculator (3 steps, CPU) with the passes' few-row switch on, so the target's rewritten
    ops run their CPU path: 2 prompts of 6 tokens, 12 new tokens each, equal to HF greedy token for token."""
    from treecompile.drafter import EagleDrafter
    from treecompile.speculator import TreeSpeculator

    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=topk, steps=3, num_nodes=num_nodes,
                          max_batch_size=2, max_seq_len=64, page_size=8, **speculator_kwargs)  # fmt: skip
    spec.binding.skinny_linears = True  # the passes' few-row switch (the speculator refuses it on the CPU)
    ids = torch.randint(1, 24, (2, 6), generator=torch.Generator().manual_seed(4))
    got = spec.generate(ids, max_new_tokens=12)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got.sequences, want)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_generate_with_the_target_on_the_fused_op_equals_hf_greedy(monkeypatch, family):
    """Lossless end to end with the target's MLPs rewritten by the pass (post-attention norm and residual add
    folded in), float64 on the CPU (the op's reference; the pass told CPU and float64 count): generate equals
    HF greedy token for token, and every layer's MLP ran as the op (verify rows B x N <= 16)."""
    from test_rewrite_attention import tiny_model

    monkeypatch.setattr(fuse_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fuse_module, "_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    monkeypatch.setenv(mlp_op.FUSED_MLP_ENV, "1")
    model = tiny_model(family, seed=2, vocab_size=24)
    model.generation_config.eos_token_id = None
    with torch.no_grad():  # at HF's init scale the MLPs barely move the tokens: make them matter (a zeroed op fails)
        for layer in model.model.layers:
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                proj.weight.mul_(6.0)
    rows_seen = []
    real = mlp_op.fused_mlp_reference

    def spy(x, gate, up, down, norm_weight=None, residual=None, eps=0.0):  # the op's CPU path
        rows_seen.append((x.shape[0], norm_weight is not None and residual is not None))
        return real(x, gate, up, down, norm_weight, residual, eps)

    monkeypatch.setattr(mlp_op, "fused_mlp_reference", spy)
    generate_equals_hf_greedy(model, topk=2, num_nodes=6)
    assert (12, True) in rows_seen, rows_seen  # the verify's 2 x 6 rows, norm folded in
