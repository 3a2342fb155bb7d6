"""treespec::skinny_qkv_rope: the Triton kernel (interpreter on CPU, the device on GPU) against the float64 unfused
q/k/v projection + HF rotary embedding, over row counts 1..64, GQA and MHA head counts, head dims whose half is one
or several programs, K not a multiple of the step, strided inputs; the RMSNorm row scale (the producer's
``round(norm_weight * s)`` and per-slice sums of squares in, the sums scaled by the row's rsqrt after the loop)
against HF's norm in float64 (rows of very different magnitudes, a norm weight far from ones, 1, 3 and 128 slices,
with and without a bias that must not be scaled; a wrong sum of squares fails); the op's CPU path and tracing, its
tiles and its boundary checks. Outputs are poisoned with NaN so an unwritten element fails. bfloat16 runs on the GPU
only (the interpreter's tl.dot misreads bfloat16 operands)."""

from __future__ import annotations

import pytest
import torch
from conftest import poisoned
from treecompile.ops.skinny_qkv_rope import (
    MAX_ROWS, ROPE_ENV, TILES_ENV, _launch_skinny_qkv_rope, rope_config, rope_wanted, skinny_qkv_rope_reference,
)  # fmt: skip
from treecompile.ops.skinny_glu import MAX_SUMSQ_SLICES
from test_skinny_glu import BAD_ROW_SCALE, _hf_norm_float64, _producer, _row_scale_inputs  # shared with glu

pytestmark = pytest.mark.usefixtures("one_thread")


def _rotary(M, D, dtype, gen, base=10000.0):
    """HF's default rotary tables for M rows at scattered positions (a tree's depths over a prefix)."""
    positions = torch.randint(0, 4096, (M,), generator=gen).double()
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2).double() / D)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _inputs(M, K, Hq, Hkv, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn((Hq + 2 * Hkv) * D, K, generator=gen) / K**0.5).to(dtype)
    cos, sin = _rotary(M, D, dtype, gen)
    return x, w, cos, sin


def _hf_float64(x, w, cos, sin, Hq, Hkv, bias=None):
    """The oracle, written out as HF does it: q_proj / k_proj / v_proj, then apply_rotary_pos_emb, all float64."""
    M, D = x.shape[0], cos.shape[1]
    x, w, cos, sin = (t.cpu().double() for t in (x, w, cos, sin))
    out = x @ w.T + (0 if bias is None else bias.cpu().double())
    q, k, v = out.split([Hq * D, Hkv * D, Hkv * D], dim=-1)

    def rope(a, H):
        a = a.reshape(M, H, D)
        rot = torch.cat((-a[..., D // 2 :], a[..., : D // 2]), dim=-1)
        return (a * cos[:, None] + rot * sin[:, None]).reshape(M, H * D)

    return rope(q, Hq), rope(k, Hkv), v


def _outputs(M, Hq, Hkv, D, dtype, d):
    return poisoned((M, Hq * D), dtype, d), poisoned((M, Hkv * D), dtype, d), poisoned((M, Hkv * D), dtype, d)


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16], ids=str)
@pytest.mark.parametrize(
    "M,K,Hq,Hkv,D,config",
    [(1, 64, 2, 1, 32, (16, 16, 32, 4, 2)), (17, 72, 4, 2, 32, (32, 16, 32, 4, 2)),
     (20, 96, 4, 4, 64, (32, 16, 32, 4, 3)), (64, 200, 8, 2, 64, (64, 32, 16, 4, 2)), (33, 64, 6, 2, 64, None)],
)  # fmt: skip
def test_matches_the_float64_unfused_graph(dtype, M, K, Hq, Hkv, D, config, kernel_device):
    d = kernel_device
    x, w, cos, sin = (t.to(d) for t in _inputs(M, K, Hq, Hkv, D, dtype, seed=M + K + D))
    q, k, v = poisoned((M, Hq * D), dtype, d), poisoned((M, Hkv * D), dtype, d), poisoned((M, Hkv * D), dtype, d)
    _launch_skinny_qkv_rope(x, w, None, cos, sin, q, k, v, config)
    for name, got in (("q", q), ("k", k), ("v", v)):
        assert not got.isnan().any(), f"unwritten {name} elements"
    tol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    for got, want in zip((q, k, v), _hf_float64(x, w, cos, sin, Hq, Hkv)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    if dtype == torch.float16:  # the reference's roundings: the GEMM output, then one rounding of the rotation
        for got, want in zip((q, k, v), skinny_qkv_rope_reference(x.cpu(), w.cpu(), None, cos.cpu(), sin.cpu(), Hq, Hkv)):
            torch.testing.assert_close(got.cpu(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_bias_is_added_before_the_rotation(dtype, kernel_device):
    """Qwen2's q/k/v bias, strided: added to the float32 sums, then rounded and rotated."""
    d = kernel_device
    M, K, Hq, Hkv, D = 24, 64, 4, 2, 32
    x, w, cos, sin = (t.to(d) for t in _inputs(M, K, Hq, Hkv, D, dtype, seed=11))
    bias = torch.randn(2 * (Hq + 2 * Hkv) * D, generator=torch.Generator().manual_seed(2)).to(dtype).to(d)[::2]
    q, k, v = poisoned((M, Hq * D), dtype, d), poisoned((M, Hkv * D), dtype, d), poisoned((M, Hkv * D), dtype, d)
    _launch_skinny_qkv_rope(x, w, bias, cos, sin, q, k, v, (32, 16, 32, 4, 2))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip((q, k, v), _hf_float64(x, w, cos, sin, Hq, Hkv, bias)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    x64, w64, c64, s64, b64 = (t.cpu().double() for t in (x, w, cos, sin, bias))
    for got, want in zip(torch.ops.treespec.skinny_qkv_rope(x64, w64, b64, c64, s64, Hq, Hkv),
                         _hf_float64(x64, w64, c64, s64, Hq, Hkv, b64)):  # fmt: skip
        torch.testing.assert_close(got, want)


def test_strided_inputs_and_outputs(kernel_device):
    d = kernel_device
    M, K, Hq, Hkv, D = 20, 64, 4, 2, 32
    x, w, cos, sin = (t.to(d) for t in _inputs(M, K, Hq, Hkv, D, torch.float32, seed=5))
    wide_x = torch.zeros(M, K + 16, device=d)
    wide_x[:, 8 : 8 + K] = x
    wide_cs = torch.zeros(M, 3 * D, device=d)  # cos and sin as column ranges of one table
    wide_cs[:, :D], wide_cs[:, 2 * D :] = cos, sin
    wide_q = torch.full((M, Hq * D + 8), float("nan"), device=d)
    k, v = poisoned((M, Hkv * D), torch.float32, d), poisoned((M, Hkv * D), torch.float32, d)
    q = wide_q[:, 4 : 4 + Hq * D]
    _launch_skinny_qkv_rope(wide_x[:, 8 : 8 + K], w, None, wide_cs[:, :D], wide_cs[:, 2 * D :], q, k, v, (32, 16, 32, 4, 2))
    for got, want in zip((q, k, v), _hf_float64(x, w, cos, sin, Hq, Hkv)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert wide_q[:, :4].isnan().all() and wide_q[:, 4 + Hq * D :].isnan().all()  # nothing written outside q


def test_op_on_cpu_is_the_reference_and_traces():
    M, K, Hq, Hkv, D = 24, 32, 4, 2, 8
    x, w, cos, sin = _inputs(M, K, Hq, Hkv, D, torch.float64)
    got = torch.ops.treespec.skinny_qkv_rope(x, w, None, cos, sin, Hq, Hkv)
    for g, want in zip(got, _hf_float64(x, w, cos, sin, Hq, Hkv)):
        torch.testing.assert_close(g, want)
        assert g.is_contiguous()

    def f(a, b, c, s):
        q, k, v = torch.ops.treespec.skinny_qkv_rope(a, b, None, c, s, Hq, Hkv)
        return q * 2, k, v

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for g, want in zip(compiled(x, w, cos, sin), (got[0] * 2, got[1], got[2])):
        assert torch.equal(g, want)
    x16, w16, c16, s16 = _inputs(20, 32, 2, 1, 8, torch.float16, seed=3)  # 16-bit: rotation in float32, one rounding
    q16 = skinny_qkv_rope_reference(x16, w16, None, c16, s16, 2, 1)[0]
    a = (x16 @ w16[:16].T).float().view(20, 2, 8)
    rot = torch.cat((-a[..., 4:], a[..., :4]), dim=-1)
    assert torch.equal(q16, (a * c16.float()[:, None] + rot * s16.float()[:, None]).half().reshape(20, 16))


ROW_SCALE_SHAPES = [(17, 72, 4, 2, 32, (32, 16, 32, 4, 2)), (20, 96, 4, 4, 64, (32, 16, 32, 4, 3)),
                    (64, 200, 8, 2, 64, (64, 32, 16, 4, 2))]  # fmt: skip


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("slices", [1, 3, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16], ids=str)
@pytest.mark.parametrize("M,K,Hq,Hkv,D,config", ROW_SCALE_SHAPES)
def test_row_scale_matches_float64_hf_norm(dtype, M, K, Hq, Hkv, D, config, slices, with_bias, kernel_device):
    """Given u = round(g * s) and s's per-slice sums of squares, the op is the q/k/v projection + rotation of HF's
    RMSNorm of s: the sums scaled by r = rsqrt(sumsq.sum(0) / K + eps) before the bias (unscaled), the roundings
    and the rotation (K = 72 / 200: a tail step; 128 slices: S_P2 = 128, some slices empty). Against the float64
    oracle a little looser than without the norm at 16 bits (g * s is rounded once); against the op's reference
    (the same numerics, the CPU path) as tight as the plain kernel."""
    d = kernel_device
    _, w, cos, sin = _inputs(M, K, Hq, Hkv, D, dtype, seed=M + K + D)
    s, g, u, sumsq = _row_scale_inputs(M, K, dtype, seed=M * K + slices, slices=slices)
    bias = None
    if with_bias:
        bias = torch.randn((Hq + 2 * Hkv) * D, generator=torch.Generator().manual_seed(M)).to(dtype).to(d)
    w, cos, sin, u, sumsq = (t.to(d) for t in (w, cos, sin, u, sumsq))
    q, k, v = _outputs(M, Hq, Hkv, D, dtype, d)
    _launch_skinny_qkv_rope(u, w, bias, cos, sin, q, k, v, config, sumsq, 1e-5)
    for name, got in (("q", q), ("k", k), ("v", v)):
        assert not got.isnan().any(), f"unwritten {name} elements"
    tol = {torch.float32: 1e-5, torch.float16: 3e-2, torch.bfloat16: 8e-2}[dtype]
    for got, want in zip((q, k, v), _hf_float64(_hf_norm_float64(s, g, 1e-5), w, cos, sin, Hq, Hkv, bias)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    ref_tol = 2e-3 if dtype == torch.float16 else tol
    cpu = [t if t is None else t.cpu() for t in (u, w, bias, cos, sin)]
    for got, want in zip((q, k, v), skinny_qkv_rope_reference(*cpu, Hq, Hkv, sumsq.cpu(), 1e-5)):
        torch.testing.assert_close(got.cpu(), want, rtol=ref_tol, atol=ref_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_row_scale_applies_to_the_sums_not_the_bias(dtype, kernel_device):
    """linear(rmsnorm(s)) = r * (W @ (g * s)) + bias: rows of magnitude 1/64 .. 1/8 (r = 8 .. 64) under a bias of
    magnitude ~20, so scaling the bias by r (or adding it before the scale) is off by (r - 1) |bias|, hundreds,
    where the bias-sized outputs' tolerance is ~0.6 in float16: the oracle with a scaled bias is checked to be
    that far from the right one, so a kernel that scaled the bias would fail."""
    d = kernel_device
    M, K, Hq, Hkv, D = 24, 72, 4, 2, 32
    _, w, cos, sin = _inputs(M, K, Hq, Hkv, D, dtype, seed=13)
    s, g, u, sumsq = _row_scale_inputs(M, K, dtype, seed=13, slices=3, scales=2.0 ** -(6 - torch.arange(M) % 4.0))
    bias = (20 * torch.randn(2 * (Hq + 2 * Hkv) * D, generator=torch.Generator().manual_seed(3))).to(dtype)[::2]
    w, cos, sin, u, sumsq, bias = (t.to(d) for t in (w, cos, sin, u, sumsq, bias))
    q, k, v = _outputs(M, Hq, Hkv, D, dtype, d)
    _launch_skinny_qkv_rope(u, w, bias, cos, sin, q, k, v, (32, 16, 32, 4, 2), sumsq, 1e-6)
    normed = _hf_norm_float64(s, g, 1e-6)
    want = _hf_float64(normed, w, cos, sin, Hq, Hkv, bias)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, ref in zip((q, k, v), want):  # relative to the bias-dominated outputs: a few units of 1e-3 in float16
        torch.testing.assert_close(got.cpu().double(), ref, rtol=tol, atol=tol)
    r = torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    scaled_bias = (normed @ w.cpu().double().T + r * bias.cpu().double()).split([Hq * D, Hkv * D, Hkv * D], -1)[2]
    assert (scaled_bias - want[2]).abs().max() > 100  # a scaled bias would miss by far more than the tolerance
    assert not torch.allclose(v.cpu().double(), scaled_bias, rtol=tol, atol=tol)


def test_a_wrong_sum_of_squares_fails_the_comparison(kernel_device):
    """The comparisons above have teeth: one of three slices dropped (a producer that lost a slice), or the sums
    taken of u = g * s instead of s, moves r by far more than the tolerance."""
    d = kernel_device
    M, K, Hq, Hkv, D = 20, 72, 2, 1, 32
    _, w, cos, sin = _inputs(M, K, Hq, Hkv, D, torch.float32, seed=3)
    s, g, u, sumsq = _row_scale_inputs(M, K, torch.float32, seed=3, slices=3)
    want = _hf_float64(_hf_norm_float64(s, g, 1e-5), w, cos, sin, Hq, Hkv)
    w, cos, sin, u = (t.to(d) for t in (w, cos, sin, u))
    for bad in (sumsq[1:].contiguous(), _producer(u.cpu(), torch.ones(K), 3)[1]):
        q, k, v = _outputs(M, Hq, Hkv, D, torch.float32, d)
        _launch_skinny_qkv_rope(u, w, None, cos, sin, q, k, v, (32, 16, 32, 4, 2), bad.to(d), 1e-5)
        for got, ref in zip((q, k, v), want):
            assert not torch.allclose(got.cpu().double(), ref, rtol=1e-3, atol=1e-3)
    q, k, v = _outputs(M, Hq, Hkv, D, torch.float32, d)
    _launch_skinny_qkv_rope(u, w, None, cos, sin, q, k, v, (32, 16, 32, 4, 2), sumsq.to(d), 1e-5)
    for got, ref in zip((q, k, v), want):
        torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_row_scale_with_large_rows_strided_inputs_and_eps(kernel_device):
    """Rows of magnitude 64 .. 1024 (a dropped r is off by that factor), x (= u) as a column range of a wider
    table, read with its row stride; eps enters the scale (a row of zeros gives zeros with eps > 0, not NaN)."""
    d = kernel_device
    M, K, Hq, Hkv, D = 20, 72, 2, 1, 32
    _, w, cos, sin = (t.to(d) for t in _inputs(M, K, Hq, Hkv, D, torch.float32, seed=6))
    s, g, _, _ = _row_scale_inputs(M, K, torch.float32, seed=6, slices=1, scales=2.0 ** (6 + torch.arange(M) % 5.0))
    s[5] = 0.0
    u, sumsq = _producer(s, g, 3)
    wide_x = torch.zeros(M, K + 24, device=d)
    wide_x[:, 8 : 8 + K] = u.to(d)
    for eps in (1e-6, 0.5):
        q, k, v = _outputs(M, Hq, Hkv, D, torch.float32, d)
        _launch_skinny_qkv_rope(wide_x[:, 8 : 8 + K], w, None, cos, sin, q, k, v, (32, 16, 32, 4, 2), sumsq.to(d), eps)
        for got, want in zip((q, k, v), _hf_float64(_hf_norm_float64(s, g, eps), w, cos, sin, Hq, Hkv)):
            torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
        assert not q[5].any() and not k[5].any() and not v[5].any()


def test_row_scale_op_on_cpu_and_traces():
    """The CPU path with norm_sumsq: the GEMM's sums in float32 (float64 for float64 x) scaled by the float32 r,
    plus the unscaled bias, rounded, then the rotation, bit for bit as written out here; within one 16-bit
    rounding of HF's LlamaRMSNorm followed by the unfused graph; the op traces with the new arguments (bias or
    not) and passes opcheck."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    M, K, Hq, Hkv, D = 24, 40, 4, 2, 8
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        _, w, cos, sin = _inputs(M, K, Hq, Hkv, D, dtype, seed=4)
        s, g, u, sumsq = _row_scale_inputs(M, K, dtype, seed=4, slices=3)
        bias = torch.randn((Hq + 2 * Hkv) * D, generator=torch.Generator().manual_seed(1)).to(dtype)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        r = torch.rsqrt(sumsq.sum(0) / K + 1e-6)[:, None].to(acc)
        hf = LlamaRMSNorm(K, eps=1e-6).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(g)
            normed = hf(s)
        for b in (None, bias):
            sums = (u.to(acc) @ w.to(acc).T) * r + (0 if b is None else b.to(acc))
            eye = torch.eye(sums.shape[1], dtype=dtype)  # an identity GEMM (exact): the reference's rotation alone
            want = skinny_qkv_rope_reference(sums.to(dtype), eye, None, cos, sin, Hq, Hkv)
            got = torch.ops.treespec.skinny_qkv_rope(u, w, b, cos, sin, Hq, Hkv, sumsq, 1e-6)
            tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
            for gt, wt, h in zip(got, want, skinny_qkv_rope_reference(normed, w, b, cos, sin, Hq, Hkv)):
                assert torch.equal(gt, wt), dtype
                torch.testing.assert_close(gt.double(), h.double(), rtol=tol, atol=tol)
    _, w, cos, sin = _inputs(M, K, Hq, Hkv, D, torch.float64, seed=4)
    _, _, u, sumsq = _row_scale_inputs(M, K, torch.float64, seed=4, slices=3)
    bias = torch.randn((Hq + 2 * Hkv) * D, generator=torch.Generator().manual_seed(1)).double()

    def f(a, b, c, s, n, bb):
        q, k, v = torch.ops.treespec.skinny_qkv_rope(a, b, bb, c, s, Hq, Hkv, n, 1e-6)
        return q * 2, k, v

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for bb in (None, bias):
        want = skinny_qkv_rope_reference(u, w, bb, cos, sin, Hq, Hkv, sumsq, 1e-6)
        for g, ref in zip(compiled(u, w, cos, sin, sumsq, bb), (want[0] * 2, want[1], want[2])):
            assert torch.equal(g, ref)
    op = torch.ops.treespec.skinny_qkv_rope.default
    torch.library.opcheck(op, (u, w, bias, cos, sin, Hq, Hkv, sumsq, 1e-6))
    torch.library.opcheck(op, (u, w, None, cos, sin, Hq, Hkv))


def _args(M=2, K=8, Hq=2, Hkv=1, D=4, **over):
    a = dict(x=torch.zeros(M, K), w=torch.zeros((Hq + 2 * Hkv) * D, K), b=None, cos=torch.zeros(M, D),
             sin=torch.zeros(M, D), Hq=Hq, Hkv=Hkv)  # fmt: skip
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(x=torch.zeros(MAX_ROWS + 1, 8)), f"1..{MAX_ROWS} rows"),
        (dict(w=torch.zeros(15, 8)), r"weight: expected \[\(Hq \+ 2 Hkv\) D = 16, K=8\]"),
        (dict(w=torch.zeros(16, 9)), r"weight: expected \[\(Hq \+ 2 Hkv\) D = 16, K=8\]"),
        (dict(w=torch.zeros(16, 8, dtype=torch.float16)), "weight: expected dtype"),
        (dict(w=torch.zeros(16, 16)[:, ::2]), "weight: expected contiguous rows"),
        (dict(x=torch.zeros(8, 2).t()), "x: the last dim must have stride 1"),
        (dict(cos=torch.zeros(4, 2).t()), "cos: the last dim must have stride 1"),
        (dict(cos=torch.zeros(3, 4)), r"cos, sin: expected \[M=2, D\]"),
        (dict(sin=torch.zeros(2, 6)), r"cos, sin: expected \[M=2, D\]"),
        (dict(cos=torch.zeros(2, 3), sin=torch.zeros(2, 3)), "D must be even"),
        (dict(Hq=3, Hkv=2), "num_q_heads, num_kv_heads"),
        (dict(Hkv=0), "num_q_heads, num_kv_heads"),
        (dict(sin=torch.zeros(2, 4, dtype=torch.float64)), "sin: expected dtype"),
        (dict(x=torch.zeros(8)), "x: expected a 2-d"),
        (dict(b=torch.zeros(15)), r"bias: expected \[\(Hq \+ 2 Hkv\) D = 16\]"),
        (dict(b=torch.zeros(16, 1)), "bias: expected a 1-d"),
        (dict(b=torch.zeros(16, dtype=torch.float16)), "bias: expected dtype"),
    ],
)
def test_bad_input_names_the_argument(over, match):
    a = _args(**over)
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.skinny_qkv_rope(a["x"], a["w"], a["b"], a["cos"], a["sin"], a["Hq"], a["Hkv"])


@pytest.mark.parametrize("norm_sumsq,eps,match", BAD_ROW_SCALE)
def test_bad_row_scale_arguments_name_the_argument(norm_sumsq, eps, match):
    a = _args()
    args = (a["x"], a["w"], a["b"], a["cos"], a["sin"], a["Hq"], a["Hkv"])
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.skinny_qkv_rope(*args, norm_sumsq, eps)


def test_switch_and_tiles(monkeypatch):
    """``TREECOMPILE_SKINNY_ROPE``: on unless 0, anything but 0 / 1 refused by name. The tiles are the q/k/v
    GEMM's swept MMA entry (even where cuBLAS won it) at half the slice width, dividing D/2."""
    from treecompile.ops import skinny_linear

    monkeypatch.delenv(ROPE_ENV, raising=False)
    assert rope_wanted() is True
    monkeypatch.setenv(ROPE_ENV, "0")
    assert rope_wanted() is False
    monkeypatch.setenv(ROPE_ENV, "1")
    assert rope_wanted() is True
    monkeypatch.setenv(ROPE_ENV, "on")
    with pytest.raises(ValueError, match=ROPE_ENV):
        rope_wanted()
    monkeypatch.setattr(skinny_linear, "gpu_class", lambda: "H100 SXM")
    assert skinny_linear.measured_tiles(64, 6144, 4096) is None  # cuBLAS keeps the plain GEMM ...
    assert rope_config(64, 6144, 4096, 128) == (64, 32, 128, 4, 4)  # ... its 64 x 128 tiles serve the fused op
    monkeypatch.setattr(skinny_linear, "gpu_class", lambda: None)
    assert rope_config(40, 6144, 4096, 128) == (64, 16, 128, 4, 4)  # the H200's 32-wide entry, nearest M 64
    assert rope_config(64, 6144, 4096, 96)[1] == 16  # 48 features a half: 16 divides it, 32 does not
    row = dict(M=32, N=192, K=64, cublas_us=10.0, best=dict(block_n=64, block_k=32, warps=4, stages=2, us=8.0))
    skinny_linear.register_tiles([row])
    try:
        assert rope_config(32, 192, 64, 32) == (32, 16, 32, 4, 2)  # D/2 = 16 caps the half at 16
        assert rope_config(32, 192, 64, 64) == (32, 32, 32, 4, 2)
    finally:
        skinny_linear._REGISTERED.pop((32, 192, 64))


def test_tiles_env_replaces_the_choice_and_is_checked(monkeypatch, kernel_device):
    """``TREECOMPILE_SKINNY_ROPE_TILES`` (a sweep's winner in a round A/B) replaces the tiles of every launch;
    a malformed or out-of-range value is refused by name."""
    monkeypatch.setenv(TILES_ENV, "32, 64, 8, 3")
    assert rope_config(40, 6144, 4096, 128) == (64, 32, 64, 8, 3)
    d = kernel_device
    M, K, Hq, Hkv, D = 20, 96, 2, 1, 64
    x, w, cos, sin = (t.to(d) for t in _inputs(M, K, Hq, Hkv, D, torch.float32, seed=9))
    q, k, v = poisoned((M, Hq * D), torch.float32, d), poisoned((M, Hkv * D), torch.float32, d), poisoned(
        (M, Hkv * D), torch.float32, d)  # fmt: skip
    _launch_skinny_qkv_rope(x, w, None, cos, sin, q, k, v)  # the env's tiles: 32 of each 32-wide half, K step 64
    for got, want in zip((q, k, v), _hf_float64(x, w, cos, sin, Hq, Hkv)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    for bad in ("32,64,8", "a,b,c,d", "24,64,4,3", "8,64,4,3", "128,64,4,3", "32,64,32,3", "32,64,4,9", "32,8,4,3"):
        monkeypatch.setenv(TILES_ENV, bad)
        with pytest.raises(ValueError, match=TILES_ENV):
            rope_config(40, 6144, 4096, 128)
