"""fuse_qkv_rope: a verify tree's fused q/k/v projection and HF's rotary embedding of q and k become one
treespec::skinny_qkv_rope call (unless TREECOMPILE_SKINNY_ROPE=0); everything the pass must not touch stays as it was.

The op's Triton path is CUDA-only; here the pass is told CPU counts too (its CPU path is the reference), so the
rewrite, the cases it leaves alone and the values are checked on this machine, on HF's own attention modules,
and a float64 generate runs through it losslessly. The kernel is checked in tests/ops/test_skinny_qkv_rope.py.
"""

import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from treecompile.ops import skinny_qkv_rope as rope_op
from treecompile.passes import PASSES, fuse_glu, fuse_qkv_rope, skinny_linears

from test_outer_products import capture

rope_module = importlib.import_module("treecompile.passes.fuse_qkv_rope")  # the package attribute is the pass
pytestmark = pytest.mark.usefixtures("one_thread")

ON = SimpleNamespace(binding=SimpleNamespace(skinny_linears=True))
OFF = SimpleNamespace(binding=SimpleNamespace(skinny_linears=False))
ROPE = torch.ops.treespec.skinny_qkv_rope.default
H, HQ, HKV, D = 32, 4, 2, 8


def calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == ROPE]


def rotate_half(t):
    return torch.cat((-t[..., D // 2 :], t[..., : D // 2]), dim=-1)


def hf_layout(x, w, cos, sin):  # fuse_projections' q/k/v, then HF's apply_rotary_pos_emb
    B, T, _ = x.shape
    q, k, v = torch.split(F.linear(x, w), [HQ * D, HKV * D, HKV * D], dim=-1)
    q = q.view(B, T, -1, D).transpose(1, 2)
    k = k.view(B, T, -1, D).transpose(1, 2)
    v = v.view(B, T, -1, D).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v


def _q_read_twice(x, w, cos, sin):  # the unrotated q has another user: left alone
    B, T, _ = x.shape
    q, k, v = torch.split(F.linear(x, w), [HQ * D, HKV * D, HKV * D], dim=-1)
    q = q.view(B, T, -1, D).transpose(1, 2)
    k = k.view(B, T, -1, D).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v, q.sum()


def _k_other_tables(x, w, cos, sin):  # k rotated by other tables than q: left alone
    B, T, _ = x.shape
    q, k, v = torch.split(F.linear(x, w), [HQ * D, HKV * D, HKV * D], dim=-1)
    q = q.view(B, T, -1, D).transpose(1, 2)
    k = k.view(B, T, -1, D).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * s + rotate_half(k) * c, v


def _no_rotation(x, w, cos, sin):
    B, T, _ = x.shape
    q, k, v = torch.split(F.linear(x, w), [HQ * D, HKV * D, HKV * D], dim=-1)
    return q.view(B, T, -1, D).transpose(1, 2) * 2, k, v


def inputs(B, T, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=gen).to(dtype)
    w = (torch.randn((HQ + 2 * HKV) * D, H, generator=gen) / H**0.5).to(dtype)
    pos = torch.randint(0, 512, (B, T), generator=gen).double()
    freqs = pos[..., None] / 10000.0 ** (torch.arange(0, D, 2).double() / D)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x, w, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.fixture
def cpu_on(monkeypatch):
    """The pass runs on CPU graphs, switched on."""
    monkeypatch.setattr(rope_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setenv(rope_op.ROPE_ENV, "1")


def test_the_pass_runs_after_fuse_glu_and_before_skinny_linears():
    assert PASSES.index(fuse_glu) < PASSES.index(fuse_qkv_rope) < PASSES.index(skinny_linears)


@pytest.mark.parametrize("B,T", [(1, 17), (2, 12), (4, 16)])
def test_rewrite_is_one_call_with_the_unfused_values(cpu_on, B, T):
    args = inputs(B, T, torch.float64, seed=B + T)
    graph_inputs = []
    gm = capture(hf_layout, *args, inputs=graph_inputs)
    want = gm(*graph_inputs)
    monkeypatch_dtypes = pytest.MonkeyPatch()
    monkeypatch_dtypes.setattr(rope_module, "_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    try:
        gm = fuse_qkv_rope(gm, ON)
    finally:
        monkeypatch_dtypes.undo()
    found = calls(gm)
    assert len(found) == 1 and found[0].args[5:] == (HQ, HKV) and found[0].args[2] is None
    names = [str(n.target) for n in gm.graph.nodes]
    assert not any("cat" in t or "neg" in t for t in names), names  # the rotation is gone
    got = gm(*graph_inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    eager = hf_layout(*args)
    for g, w in zip(got, eager):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_16_bit_values_follow_the_unfused_roundings(cpu_on):
    args = inputs(2, 10, torch.float16, seed=3)
    graph_inputs = []
    gm = fuse_qkv_rope(capture(hf_layout, *args, inputs=graph_inputs), ON)
    assert len(calls(gm)) == 1
    got = gm(*graph_inputs)
    want = hf_layout(*(a.double() for a in args))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=2e-2)


def test_rows_dtype_device_users_binding_and_switch_rules(cpu_on, monkeypatch):
    for B, T in ((1, 16), (1, 65), (2, 40)):  # <= 16 rows: the gemv kernels; past 64: several row blocks
        assert not calls(fuse_qkv_rope(capture(hf_layout, *inputs(B, T)), ON)), (B, T)
    assert not calls(fuse_qkv_rope(capture(hf_layout, *inputs(2, 10, torch.float32)), ON))
    for fn in (_q_read_twice, _k_other_tables, _no_rotation):
        gm = capture(fn, *inputs(2, 10))
        before = [n.target for n in gm.graph.nodes]
        gm = fuse_qkv_rope(gm, ON)
        assert not calls(gm) and [n.target for n in gm.graph.nodes] == before, fn.__name__
    assert not calls(fuse_qkv_rope(capture(hf_layout, *inputs(2, 10)), OFF))
    assert not calls(fuse_qkv_rope(capture(hf_layout, *inputs(2, 10)), SimpleNamespace()))
    monkeypatch.setenv(rope_op.ROPE_ENV, "0")
    assert not calls(fuse_qkv_rope(capture(hf_layout, *inputs(2, 10)), ON))
    monkeypatch.delenv(rope_op.ROPE_ENV)  # unset: on (two same-machine round A/Bs on an H200 won)
    assert len(calls(fuse_qkv_rope(capture(hf_layout, *inputs(2, 10)), ON))) == 1
    monkeypatch.setenv(rope_op.ROPE_ENV, "yes")
    with pytest.raises(ValueError, match=rope_op.ROPE_ENV):
        fuse_qkv_rope(capture(hf_layout, *inputs(2, 10)), ON)
    monkeypatch.setenv(rope_op.ROPE_ENV, "1")
    assert len(calls(fuse_qkv_rope(capture(hf_layout, *inputs(2, 10)), ON))) == 1
    monkeypatch.setattr(rope_module, "_DEVICE_TYPES", ("cuda",))
    assert not calls(fuse_qkv_rope(capture(hf_layout, *inputs(2, 10)), ON))  # CPU tensors


def _hf_run(family, monkeypatch, on: bool):
    """(logits of one B=2 x T=12 forward of a tiny HF model through the treespec passes, the rewritten graph)."""
    from test_rewrite_attention import Captured, tiny_model

    from treecompile import passes as passes_pkg
    from treecompile.target import TargetBinding, TargetRunner, chain_mask

    monkeypatch.setenv(rope_op.ROPE_ENV, "1" if on else "0")
    model = tiny_model(family, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # HF initialises Qwen2's q/k/v biases to zero: make them count (a dropped bias fails)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen, dtype=torch.float64))
    binding = TargetBinding(model, max_batch=2, max_seq_len=48, max_rows=12, page_size=8, fuse_projections=True)
    binding.skinny_linears = True
    runner = TargetRunner(model, binding, aux_layers=(1, 2), inductor=False)
    capture_pass = Captured()
    monkeypatch.setattr(passes_pkg, "PASSES", passes_pkg.PASSES + [capture_pass])
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 12))
    binding.load(torch.zeros(2, dtype=torch.int64), chain_mask(12).expand(2, 12))
    with torch.no_grad():
        logits, _ = runner(ids, (torch.arange(12) + 5).expand(2, 12).contiguous())
    monkeypatch.setattr(passes_pkg, "PASSES", passes_pkg.PASSES[:-1])
    return logits, capture_pass.graphs[-1]


@pytest.mark.parametrize("family,expected", [("llama", 3), ("mistral", 3), ("qwen2", 3), ("qwen3", 0)])
def test_hf_attention_modules(monkeypatch, family, expected):
    """On HF's own Llama, Mistral and Qwen2 (q/k/v bias) attention (float64, 24 rows) every layer's q/k/v +
    rotation becomes one call with the same logits; Qwen3's per-head q/k norms sit between the view and the
    rotation: left alone."""
    monkeypatch.setattr(rope_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(rope_module, "_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    want, plain = _hf_run(family, monkeypatch, on=False)
    got, gm = _hf_run(family, monkeypatch, on=True)
    assert not calls(plain) and len(calls(gm)) == expected
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_with_the_verify_on_the_op_equals_hf_greedy(monkeypatch, family):
    """Lossless end to end with the target's q/k/v + rotary embedding rewritten by the pass (float64 on the CPU:
    the op's reference; the pass told CPU and float64 count): generate equals HF greedy token for token, and the
    verify's 2 x 12 rows ran the op in every layer."""
    from test_fuse_mlp import generate_equals_hf_greedy
    from test_rewrite_attention import tiny_model

    monkeypatch.setattr(rope_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(rope_module, "_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    monkeypatch.setenv(rope_op.ROPE_ENV, "1")
    model = tiny_model(family, seed=2, vocab_size=24)
    model.generation_config.eos_token_id = None
    rows_seen = []
    real = rope_op.skinny_qkv_rope_reference

    def spy(x, weight, bias, cos, sin, hq, hkv):  # the op's CPU path
        rows_seen.append(x.shape[0])
        return real(x, weight, bias, cos, sin, hq, hkv)

    monkeypatch.setattr(rope_op, "skinny_qkv_rope_reference", spy)
    generate_equals_hf_greedy(model, topk=3, num_nodes=12, fuse_projections=True)
    assert rows_seen.count(24) >= 3, rows_seen  # the verify's 2 x 12 rows, every layer
