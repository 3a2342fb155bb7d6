"""fuse_residual_norm: a verify's residual add and RMSNorm go into the epilogue of the skinny_linear that produced
the norm's input (skinny_linear_norm_out: s, norm_weight * s, partial sums of s^2) and the GEMM after it (skinny_glu,
skinny_qkv_rope) scales its sums by the row's rsqrt; everything the pass must not touch stays as it was.

The ops' Triton paths are CUDA-only; here the pass (and the passes before it) are told CPU counts too, so the
rewrite, the cases it leaves alone and the values are checked on this machine: on a graph of the ops themselves,
on HF's own decoder layers (float32: the ops' CPU paths compute what the unfused graph computes), and a float64
generate runs through it losslessly. The kernels are checked in tests/ops.
"""

import importlib
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from treecompile.ops import skinny_linear as skinny_op
from treecompile.passes import PASSES, clean_up_graph, fuse_residual_norm, skinny_linears

from test_outer_products import capture

norm_module = importlib.import_module("treecompile.passes.fuse_residual_norm")
pytestmark = pytest.mark.usefixtures("one_thread")

ON = SimpleNamespace(binding=SimpleNamespace(skinny_linears=True))
OFF = SimpleNamespace(binding=SimpleNamespace(skinny_linears=False))
GLU = torch.ops.treespec.skinny_glu.default
ROPE = torch.ops.treespec.skinny_qkv_rope.default
LINEAR = torch.ops.treespec.skinny_linear.default
NORM_OUT = torch.ops.treespec.skinny_linear_norm_out.default
B, T, H, I = 2, 12, 32, 48


def rms_norm(s, weight, eps=1e-6):  # HF's LlamaRMSNorm, as Dynamo records it
    h = s.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(var + eps)).to(s.dtype)


def layer(r, xo, wo, g, wgu):  # o_proj on Triton tiles, the residual add, the norm, the gate/up GEMM
    y = torch.ops.treespec.skinny_linear.default(xo.reshape(B * T, H), wo, None, True).reshape(B, T, H)
    s = r + y
    return torch.ops.treespec.skinny_glu.default(rms_norm(s, g).reshape(B * T, H), wgu), s


def layer_y_read_twice(r, xo, wo, g, wgu):  # the GEMM's own output has another user: left alone
    y = torch.ops.treespec.skinny_linear.default(xo.reshape(B * T, H), wo, None, True).reshape(B, T, H)
    s = y + r
    return torch.ops.treespec.skinny_glu.default(rms_norm(s, g).reshape(B * T, H), wgu), s, y.sum()


def layer_norm_read_twice(r, xo, wo, g, wgu):  # the normed rows have another user: left alone
    y = torch.ops.treespec.skinny_linear.default(xo.reshape(B * T, H), wo, None, True).reshape(B, T, H)
    x = rms_norm(r + y, g)
    return torch.ops.treespec.skinny_glu.default(x.reshape(B * T, H), wgu), x.sum()


def layer_cublas(r, xo, wo, g, wgu):  # o_proj left on cuBLAS: left alone
    s = r + F.linear(xo, wo)
    return torch.ops.treespec.skinny_glu.default(rms_norm(s, g).reshape(B * T, H), wgu), s


def inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = (4 * torch.randn(B, T, H, generator=gen)).to(dtype)  # a residual stream far from unit norm
    xo = torch.randn(B, T, H, generator=gen).to(dtype)
    wo = (torch.randn(H, H, generator=gen) / H**0.5).to(dtype)
    g = (1 + 0.5 * torch.randn(H, generator=gen)).to(dtype)  # a norm weight far from ones
    wgu = (torch.randn(2 * I, H, generator=gen) / H**0.5).to(dtype)
    return r, xo, wo, g, wgu


def ops(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def rsqrts(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.rsqrt]


@pytest.fixture
def cpu_on(monkeypatch):
    """The pass runs on CPU graphs of 16-bit and float32 values, switched on."""
    monkeypatch.setattr(norm_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(norm_module, "_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.setenv(norm_module.NORM_ENV, "1")


def test_the_pass_runs_after_skinny_linears_and_before_clean_up():
    assert PASSES.index(skinny_linears) < PASSES.index(fuse_residual_norm) < PASSES.index(clean_up_graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_and_norm_fold_into_the_two_gemms(cpu_on, dtype):
    args = inputs(dtype, seed=1)
    graph_inputs = []
    gm = capture(layer, *args, inputs=graph_inputs)
    want = gm(*graph_inputs)
    gm = fuse_residual_norm(gm, ON)
    (glu,), (out,) = ops(gm, GLU), ops(gm, NORM_OUT)
    assert not rsqrts(gm) and not ops(gm, LINEAR)
    assert not [n for n in gm.graph.nodes if n.target in (operator.add, torch.add)]
    assert len(glu.args) == 4 and glu.args[3] == 1e-6 and glu.args[0].args == (out, 1) and glu.args[2].args == (out, 2)
    got = gm(*graph_inputs)
    # one rounding of norm_weight * s where HF rounds twice: float32 to ~1e-6, 16-bit to a rounding
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the residual stream: bit for bit


def test_what_is_left_alone(cpu_on, monkeypatch):
    args = inputs()
    for fn, settings in ((layer_y_read_twice, ON), (layer_cublas, ON), (layer_norm_read_twice, ON), (layer, OFF),
                         (layer, SimpleNamespace())):  # fmt: skip
        gm = capture(fn, *args)
        before = [n.target for n in gm.graph.nodes]
        gm = fuse_residual_norm(gm, settings)
        assert [n.target for n in gm.graph.nodes] == before, fn.__name__
    monkeypatch.setenv(norm_module.NORM_ENV, "0")
    assert rsqrts(fuse_residual_norm(capture(layer, *args), ON))
    monkeypatch.setenv(norm_module.NORM_ENV, "yes")
    with pytest.raises(ValueError, match=norm_module.NORM_ENV):
        fuse_residual_norm(capture(layer, *args), ON)
    monkeypatch.delenv(norm_module.NORM_ENV)  # unset: off until a GPU round A/B
    assert rsqrts(fuse_residual_norm(capture(layer, *args), ON))
    monkeypatch.setenv(norm_module.NORM_ENV, "1")
    monkeypatch.setattr(norm_module, "_DEVICE_TYPES", ("cuda",))
    assert rsqrts(fuse_residual_norm(capture(layer, *args), ON))  # CPU tensors
    monkeypatch.setattr(norm_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(norm_module, "_DTYPES", (torch.float16, torch.bfloat16))
    assert rsqrts(fuse_residual_norm(capture(layer, *args), ON))  # float32: not a 16-bit verify
    monkeypatch.setattr(norm_module, "_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.setattr(skinny_op, "norm_out_supported", lambda M, N, K: False)
    assert rsqrts(fuse_residual_norm(capture(layer, *args), ON))  # the producer's tiles cannot emit the norm


def _all_passes_on_cpu(monkeypatch, dtype):
    """Every few-row pass told CPU (and ``dtype``) counts; the tiny models' o/down shapes measured on Triton.
    skinny_linear has no float64 path: a float64 graph keeps its plain GEMMs (and so its adds)."""
    names = ["fuse_glu", "fuse_qkv_rope", "fuse_residual_norm"] + (["skinny_linears"] if dtype != torch.float64 else [])
    for name in names:
        module = importlib.import_module(f"treecompile.passes.{name}")
        monkeypatch.setattr(module, "_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(module, "_DTYPES", (torch.float16, torch.bfloat16, dtype))
    monkeypatch.setattr(skinny_op, "_MEASURED", dict(skinny_op._MEASURED))
    for N, K in ((32, 32), (32, 64)):  # o_proj, down_proj of tiny_model
        skinny_op._MEASURED[(64, N, K)] = (16, 32, 4, 3, 3.0, 4.0)


def _hf_logits(family, monkeypatch, on: bool, device="cpu", dtype=torch.float32, **config):
    """(logits of one B=2 x T=12 forward of a tiny HF model through the treespec passes, the graph)."""
    from test_rewrite_attention import Captured, tiny_model

    from treecompile import passes as passes_pkg
    from treecompile.target import TargetBinding, TargetRunner, chain_mask

    monkeypatch.setenv(norm_module.NORM_ENV, "1" if on else "0")
    model = tiny_model(family, seed=3, **config).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm weights far from HF's ones (a dropped norm weight fails)
        for norm in [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]:
            norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    binding = TargetBinding(model, max_batch=2, max_seq_len=48, max_rows=12, page_size=8, fuse_projections=True)
    binding.skinny_linears = True
    runner = TargetRunner(model, binding, aux_layers=(1, 2), inductor=False)
    captured = Captured()
    monkeypatch.setattr(passes_pkg, "PASSES", passes_pkg.PASSES + [captured])
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 12)).to(device)
    binding.load(torch.zeros(2, dtype=torch.int64, device=device), chain_mask(12).expand(2, 12).to(device))
    with torch.no_grad():
        logits, _ = runner(ids, (torch.arange(12, device=device) + 5).expand(2, 12).contiguous())
    monkeypatch.setattr(passes_pkg, "PASSES", passes_pkg.PASSES[:-1])
    return logits, captured.graphs[-1]


# folded: o -> gate/up in each of 3 layers, down -> the next layer's q/k/v (Qwen3's q/k/v is a plain GEMM: not a
# consumer); the first layer's norm (after the embedding) and the final norm before the LM head always stay
@pytest.mark.parametrize("family,folds", [("llama", 5), ("mistral", 5), ("qwen2", 5), ("qwen3", 3)])
def test_hf_decoder_layers(monkeypatch, family, folds):
    _all_passes_on_cpu(monkeypatch, torch.float32)
    want, plain = _hf_logits(family, monkeypatch, on=False)
    got, gm = _hf_logits(family, monkeypatch, on=True)
    scaled = [n for n in ops(gm, GLU) + ops(gm, ROPE) if len(n.args) in (4, 9)]
    assert len(scaled) == folds and len(ops(gm, NORM_OUT)) == folds and not ops(plain, NORM_OUT)
    assert len(rsqrts(plain)) - len(rsqrts(gm)) == folds
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_with_the_norms_in_the_gemms_equals_hf_greedy(monkeypatch, family):
    """End to end in float32 on the CPU (skinny_linear has no float64 path; the ops' references): generate equals
    HF greedy token for token, and the verify's 2 x 12 rows ran skinny_glu with the row scale in every layer."""
    from test_fuse_mlp import generate_equals_hf_greedy
    from test_rewrite_attention import tiny_model

    from treecompile.ops import skinny_glu as glu_op

    _all_passes_on_cpu(monkeypatch, torch.float32)
    monkeypatch.setenv(norm_module.NORM_ENV, "1")
    model = tiny_model(family, seed=2, vocab_size=24).to(torch.float32)
    model.generation_config.eos_token_id = None
    normed_rows = []
    real = glu_op.skinny_glu_reference

    def spy(x, weight, *rest):  # the op's CPU path
        if rest and rest[0] is not None:
            normed_rows.append(x.shape[0])
        return real(x, weight, *rest)

    monkeypatch.setattr(glu_op, "skinny_glu_reference", spy)
    generate_equals_hf_greedy(model, topk=3, num_nodes=12, fuse_projections=True, packed_linears=False)
    assert normed_rows.count(24) >= 3, normed_rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the ops' Triton kernels)")
def test_gpu_bf16_logits_follow_the_unfused_graph(monkeypatch):
    """On the GPU in bfloat16 (the kernels, not the references): every layer's norms and adds fold, and the
    logits stay within bfloat16 rounding of the unfused graph's (the prologue rounds once where HF rounds twice)."""
    monkeypatch.setattr(skinny_op, "_MEASURED", dict(skinny_op._MEASURED))
    for N, K in ((256, 256), (256, 512)):  # o_proj, down_proj: on Triton tiles, so the adds fold too
        skinny_op._MEASURED[(64, N, K)] = (32, 64, 4, 3, 3.0, 4.0)
    # head dim 64: the attention kernels' least (32 was refused on the H100, forty-third session)
    config = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    want, plain = _hf_logits("llama", monkeypatch, False, "cuda", torch.bfloat16, **config)
    got, gm = _hf_logits("llama", monkeypatch, True, "cuda", torch.bfloat16, **config)
    assert len([n for n in ops(gm, GLU) + ops(gm, ROPE) if len(n.args) in (4, 9)]) == 5 == len(ops(gm, NORM_OUT))
    assert got.isfinite().all()
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 0.05 * scale, ((got.float() - want.float()).abs().max(), scale)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.9, agree
