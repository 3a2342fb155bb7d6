"""fuse_glu: a verify tree's fused gate/up projection and its silu-mul become one treespec::skinny_glu call
(unless TREECOMPILE_SKINNY_GLU=0); everything the pass must not touch stays as it was.

The op's Triton path is CUDA-only; here the pass is told CPU counts too (its CPU path is the reference), so
the rewrite, the cases it leaves alone and the values are checked on this machine, and a float64 generate
runs through it losslessly. The kernel is checked in tests/ops/test_skinny_glu.py.
"""

import importlib
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from treecompile.ops import skinny_glu as glu_op
from treecompile.ops.skinny_glu import skinny_glu_reference
from treecompile.passes import PASSES, fuse_glu, fuse_mlp, skinny_linears

from test_outer_products import capture

glu_module = importlib.import_module("treecompile.passes.fuse_glu")  # the package attribute is the pass
pytestmark = pytest.mark.usefixtures("one_thread")

ON = SimpleNamespace(binding=SimpleNamespace(skinny_linears=True))
OFF = SimpleNamespace(binding=SimpleNamespace(skinny_linears=False))
GLU = torch.ops.treespec.skinny_glu.default
H, I = 32, 48


def calls(gm, target=GLU):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def fused_layout(x, gate_up, down):  # fuse_projections' layout, as Dynamo records HF's LlamaMLP
    g, u = torch.split(F.linear(x, gate_up), [I, I], dim=-1)
    return F.linear(F.silu(g) * u, down)


def separate(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _silu_reused(x, gate_up, down):
    g, u = torch.split(F.linear(x, gate_up), [I, I], dim=-1)
    a = F.silu(g)
    return F.linear(a * u, down), a


def _product_reused(x, gate_up, down):
    g, u = torch.split(F.linear(x, gate_up), [I, I], dim=-1)
    h = F.silu(g) * u
    return F.linear(h, down), h  # the product's other user gets the op's output: still one call


def _gate_up_bias(x, gate_up, down):
    g, u = torch.split(F.linear(x, gate_up, torch.ones(2 * I, dtype=x.dtype)), [I, I], dim=-1)
    return F.linear(F.silu(g) * u, down)


def weights(dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * I, H, generator=gen) / H**0.5).to(dtype)
    down = (torch.randn(H, I, generator=gen) / I**0.5).to(dtype)
    return gate_up, down


def rows(n, dtype=torch.float16, seed=1):
    return torch.randn(1, n, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def cpu_on(monkeypatch):
    """The pass runs on CPU graphs, switched on."""
    monkeypatch.setattr(glu_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setenv(glu_op.GLU_ENV, "1")


def test_the_pass_runs_after_fuse_mlp_and_before_skinny_linears():
    assert PASSES.index(fuse_mlp) < PASSES.index(fuse_glu) < PASSES.index(skinny_linears)


@pytest.mark.parametrize("n", [17, 24, 64])
def test_fused_gate_up_and_silu_mul_become_one_call(cpu_on, n):
    gate_up, down = weights()
    x = rows(n)
    gm = capture(fused_layout, x, gate_up, down)
    (want,) = gm(x, gate_up, down)
    gm = fuse_glu(gm, ON)
    (call,) = calls(gm)
    assert call.args[1].op == "placeholder"  # the fused weight itself, no copy
    assert not calls(gm, torch.split) and not calls(gm, F.silu) and not calls(gm, operator.mul)
    assert len(calls(gm, torch._C._nn.linear)) == 1  # the down projection stays for skinny_linears
    (got,) = gm(x, gate_up, down)
    assert torch.equal(got, F.linear(skinny_glu_reference(x.reshape(n, H), gate_up).reshape(1, n, I), down))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # the unfused path rounds silu and mul apart


def test_a_product_with_another_user_still_fuses(cpu_on):
    gate_up, down = weights(seed=3)
    x = rows(20)
    gm = fuse_glu(capture(_product_reused, x, gate_up, down), ON)
    assert len(calls(gm)) == 1
    y, h = gm(x, gate_up, down)
    assert torch.equal(h, skinny_glu_reference(x.reshape(20, H), gate_up).reshape(1, 20, I))


@pytest.mark.parametrize("fn", [_silu_reused, _gate_up_bias], ids=lambda f: f.__name__)
def test_other_patterns_are_left_alone(cpu_on, fn):
    gate_up, down = weights()
    gm = capture(fn, rows(20), gate_up, down)
    before = [n.target for n in gm.graph.nodes]
    gm = fuse_glu(gm, ON)
    assert not calls(gm) and [n.target for n in gm.graph.nodes] == before


def test_rows_dtype_device_layout_binding_and_switch_rules(cpu_on, monkeypatch):
    gate_up, down = weights()
    for n in (1, 16, 65):  # the gemv kernels / fused MLP below 17 rows, several row blocks past 64
        assert not calls(fuse_glu(capture(fused_layout, rows(n), gate_up, down), ON)), n
    w32 = [w.float() for w in (gate_up, down)]
    assert not calls(fuse_glu(capture(fused_layout, rows(20, torch.float32), *w32), ON))
    gate, up = gate_up[:I], gate_up[I:]
    assert not calls(fuse_glu(capture(separate, rows(20), gate, up, down), ON))  # not fuse_projections' layout
    assert not calls(fuse_glu(capture(fused_layout, rows(20), gate_up, down), OFF))
    assert not calls(fuse_glu(capture(fused_layout, rows(20), gate_up, down), SimpleNamespace()))
    monkeypatch.setenv(glu_op.GLU_ENV, "0")
    assert not calls(fuse_glu(capture(fused_layout, rows(20), gate_up, down), ON))
    monkeypatch.delenv(glu_op.GLU_ENV)  # unset: on
    assert calls(fuse_glu(capture(fused_layout, rows(20), gate_up, down), ON))
    monkeypatch.setenv(glu_op.GLU_ENV, "on")
    with pytest.raises(ValueError, match=glu_op.GLU_ENV):
        fuse_glu(capture(fused_layout, rows(20), gate_up, down), ON)
    monkeypatch.setenv(glu_op.GLU_ENV, "1")
    monkeypatch.setattr(glu_module, "_DEVICE_TYPES", ("cuda",))
    assert not calls(fuse_glu(capture(fused_layout, rows(20), gate_up, down), ON))  # CPU tensors


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_with_the_verify_on_the_op_equals_hf_greedy(monkeypatch, family):
    """Lossless end to end with the target's gate/up + silu-mul rewritten by the pass (float64 on the CPU: the
    op's reference; the pass told CPU and float64 count): generate equals HF greedy token for token, and the
    verify's 2 x 12 rows ran the op in every layer."""
    from test_fuse_mlp import generate_equals_hf_greedy
    from test_rewrite_attention import tiny_model

    monkeypatch.setattr(glu_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(glu_module, "_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    monkeypatch.setenv(glu_op.GLU_ENV, "1")
    model = tiny_model(family, seed=2, vocab_size=24)
    model.generation_config.eos_token_id = None
    with torch.no_grad():  # at HF's init scale the MLPs barely move the tokens: make them matter (a zeroed op fails)
        for layer in model.model.layers:
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                proj.weight.mul_(6.0)
    rows_seen = []
    real = glu_op.skinny_glu_reference

    def spy(x, weight):  # the op's CPU path
        rows_seen.append(x.shape[0])
        return real(x, weight)

    monkeypatch.setattr(glu_op, "skinny_glu_reference", spy)
    generate_equals_hf_greedy(model, topk=3, num_nodes=12, fuse_projections=True)
    assert 24 in rows_seen, rows_seen  # the verify's 2 x 12 rows
