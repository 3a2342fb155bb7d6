"""treespec::skinny_glu: the Triton kernel (interpreter on CPU, the device on GPU) against the float64 unfused
gate/up + silu-mul, over row counts 1..64, I not a multiple of the slice, K not a multiple of the step, strided
rows; the RMSNorm row scale (the producer's ``round(norm_weight * s)`` and per-slice sums of squares in, the sums
scaled by the row's rsqrt after the loop) against HF's norm in float64 (rows of very different magnitudes, a norm
weight far from ones, 1, 3 and 128 slices, K tails, strided x; a wrong sum of squares fails); the op's CPU path,
its tracing and its boundary checks. Outputs are poisoned with NaN so an unwritten element fails. bfloat16 runs on
the GPU only (the interpreter's tl.dot misreads bfloat16 operands)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import poisoned
from treecompile.ops.skinny_glu import (
    GLU_ENV, MAX_ROWS, MAX_SUMSQ_SLICES, TILES_ENV, _launch_skinny_glu, glu_config, glu_wanted, skinny_glu_reference,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(M, I, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(2 * I, K, generator=gen) / K**0.5).to(dtype)
    return x, w


def _row_scale_inputs(M, K, dtype, seed, slices, scales=None):
    """The norm's input s (rows at magnitudes ``scales``, default 1/16 to 64: a dropped or misplaced per-row scale
    fails), a norm weight g of varied values around 1, some negative (a dropped g fails), and what the producer
    GEMM hands the op: ``u = round(g * s)`` (x's dtype) and ``sumsq [slices, M]``, float32 sums of s^2 over
    ``slices`` column ranges of s (uneven; with more slices than K some are empty)."""
    gen = torch.Generator().manual_seed(seed)
    scales = 2.0 ** (torch.arange(M) % 11 - 4.0) if scales is None else scales
    s = (torch.randn(M, K, generator=gen) * scales[:, None]).to(dtype)
    g = (1 + 0.6 * torch.randn(K, generator=gen)).to(dtype)
    return s, g, *_producer(s, g, slices)


def _producer(s, g, slices):
    """``skinny_linear_norm_out``'s outputs for the norm input s and weight g: u = round(g * s), per-slice sumsq."""
    sf = s.float()
    u = (g.float() * sf).to(s.dtype)
    sumsq = torch.stack([(part**2).sum(-1) for part in torch.tensor_split(sf, slices, dim=1)]).contiguous()
    return u, sumsq


def _hf_norm_float64(s, g, eps):
    """HF's LlamaRMSNorm written out in float64 (no rounding anywhere): the float64 oracle's GEMM input."""
    s = s.cpu().double()
    return g.cpu().double() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "M,I,K,config",
    [(1, 16, 64, (16, 16, 32, 4, 2)), (17, 24, 72, (32, 16, 32, 4, 2)), (20, 40, 96, (32, 32, 32, 4, 3)),
     (64, 40, 200, (64, 16, 16, 4, 2)), (33, 50, 64, None)],
)  # fmt: skip
def test_matches_the_float64_unfused_graph(dtype, M, I, K, config, kernel_device):
    d = kernel_device
    x, w = (t.to(d) for t in _inputs(M, I, K, dtype, seed=M + I + K))
    out = poisoned((M, I), dtype, d)
    _launch_skinny_glu(x, w, out, config)
    assert not out.isnan().any(), "unwritten output elements"
    want = skinny_glu_reference(x.cpu().double(), w.cpu().double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)


def test_strided_rows_in_and_out(kernel_device):
    d = kernel_device
    x, w = (t.to(d) for t in _inputs(20, 24, 64, torch.float32, seed=5))
    wide_x = torch.zeros(20, 80, device=d)
    wide_x[:, 8:72] = x
    wide_out = torch.full((20, 40), float("nan"), device=d)
    _launch_skinny_glu(wide_x[:, 8:72], w, wide_out[:, 4:28], (32, 16, 32, 4, 2))
    want = skinny_glu_reference(x.cpu().double(), w.cpu().double())
    torch.testing.assert_close(wide_out[:, 4:28].cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert wide_out[:, :4].isnan().all() and wide_out[:, 28:].isnan().all()  # nothing written outside the view


def test_op_on_cpu_is_the_reference_and_traces():
    x, w = _inputs(24, 16, 32, torch.float64)
    I = 16
    want = torch.nn.functional.silu(x @ w[:I].T) * (x @ w[I:].T)
    assert torch.equal(torch.ops.treespec.skinny_glu(x, w), skinny_glu_reference(x, w))
    torch.testing.assert_close(skinny_glu_reference(x, w), want)
    compiled = torch.compile(lambda a, b: torch.ops.treespec.skinny_glu(a, b) * 2, backend="aot_eager",
                             fullgraph=True)  # fmt: skip
    assert torch.equal(compiled(x, w), skinny_glu_reference(x, w) * 2)
    x16, w16 = _inputs(20, 16, 32, torch.float16)  # 16-bit: silu(g) * u in float32 from the rounded g, u
    g, u = (x16 @ w16.T).split(16, dim=-1)
    assert torch.equal(skinny_glu_reference(x16, w16), (torch.nn.functional.silu(g.float()) * u.float()).half())


ROW_SCALE_SHAPES = [(17, 24, 72, (32, 16, 32, 4, 2)), (20, 40, 96, (32, 32, 32, 4, 3)),
                    (64, 40, 200, (64, 16, 16, 4, 2))]  # fmt: skip


@pytest.mark.parametrize("slices", [1, 3, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16], ids=str)
@pytest.mark.parametrize("M,I,K,config", ROW_SCALE_SHAPES)
def test_row_scale_matches_float64_hf_norm(dtype, M, I, K, config, slices, kernel_device):
    """Given u = round(g * s) and s's per-slice sums of squares, the op is the gate/up + silu-mul of HF's RMSNorm
    of s: the sums scaled by r = rsqrt(sumsq.sum(0) / K + eps) before the roundings and silu (K = 72 / 200: a
    tail step past the last 32 / 16; 128 slices: S_P2 = 128, more slices than K at K = 72 / 96, some empty).
    Against the float64 oracle a little looser than without the norm at 16 bits (g * s is rounded once); against
    the op's reference (the same numerics, the CPU path) as tight as the plain kernel."""
    d = kernel_device
    _, w = _inputs(M, I, K, dtype, seed=M + I + K)
    s, g, u, sumsq = _row_scale_inputs(M, K, dtype, seed=M * K + slices, slices=slices)
    w, u, sumsq = w.to(d), u.to(d), sumsq.to(d)
    out = poisoned((M, I), dtype, d)
    _launch_skinny_glu(u, w, out, config, sumsq, 1e-5)
    assert not out.isnan().any(), "unwritten output elements"
    want = skinny_glu_reference(_hf_norm_float64(s, g, 1e-5), w.cpu().double())
    tol = {torch.float32: 1e-5, torch.float16: 3e-2, torch.bfloat16: 8e-2}[dtype]
    torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)
    ref = skinny_glu_reference(u.cpu(), w.cpu(), sumsq.cpu(), 1e-5)
    torch.testing.assert_close(out.cpu(), ref, rtol=2e-3 if dtype == torch.float16 else tol, atol=2e-3 if
                               dtype == torch.float16 else tol)  # fmt: skip


def test_a_wrong_sum_of_squares_fails_the_comparison(kernel_device):
    """The comparison above has teeth: one of three slices dropped (a producer that lost a slice), or the sums
    taken of u = g * s instead of s, moves r by far more than the tolerance."""
    d = kernel_device
    M, I, K = 20, 24, 72
    _, w = _inputs(M, I, K, torch.float32, seed=3)
    s, g, u, sumsq = _row_scale_inputs(M, K, torch.float32, seed=3, slices=3)
    want = skinny_glu_reference(_hf_norm_float64(s, g, 1e-5), w.double())
    w, u = w.to(d), u.to(d)
    for bad in (sumsq[1:].contiguous(), _producer(u.cpu(), torch.ones(K), 3)[1]):
        out = poisoned((M, I), torch.float32, d)
        _launch_skinny_glu(u, w, out, (32, 16, 32, 4, 2), bad.to(d), 1e-5)
        assert not torch.allclose(out.cpu().double(), want, rtol=1e-3, atol=1e-3)
    out = poisoned((M, I), torch.float32, d)
    _launch_skinny_glu(u, w, out, (32, 16, 32, 4, 2), sumsq.to(d), 1e-5)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)


def test_row_scale_with_strided_rows_and_eps(kernel_device):
    """x (= u) as a column range of a wider table, read with its row stride; eps enters the scale (with eps > 0 a
    row of zeros gives zeros, not NaN); large rows (64 .. 1024: a dropped r is off by that factor)."""
    d = kernel_device
    M, I, K = 20, 24, 72
    _, w = (t.to(d) for t in _inputs(M, I, K, torch.float32, seed=8))
    s, g, _, _ = _row_scale_inputs(M, K, torch.float32, seed=8, slices=1, scales=2.0 ** (6 + torch.arange(M) % 5.0))
    s[3] = 0.0
    u, sumsq = _producer(s, g, 3)
    wide_x = torch.zeros(M, K + 24, device=d)
    wide_x[:, 8 : 8 + K] = u.to(d)
    for eps in (1e-6, 0.5):
        out = poisoned((M, I), torch.float32, d)
        _launch_skinny_glu(wide_x[:, 8 : 8 + K], w, out, (32, 16, 32, 4, 2), sumsq.to(d), eps)
        want = skinny_glu_reference(_hf_norm_float64(s, g, eps), w.cpu().double())
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
        assert not out[3].any()  # silu(0) * 0


def test_row_scale_op_on_cpu_and_traces():
    """The CPU path with norm_sumsq: the GEMM's sums in float32 (float64 for float64 x) scaled by the float32 r,
    rounded, then silu-mul, bit for bit as written out here; within one 16-bit rounding of HF's LlamaRMSNorm
    followed by the unfused graph (HF rounds s * r and g * (s * r), the producer g * s once); the op traces with
    the new arguments and passes opcheck."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    M, I, K = 24, 16, 40
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        _, w = _inputs(M, I, K, dtype, seed=4)
        s, g, u, sumsq = _row_scale_inputs(M, K, dtype, seed=4, slices=3)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        r = torch.rsqrt(sumsq.sum(0) / K + 1e-6)[:, None]
        gu = ((u.to(acc) @ w.to(acc).T) * r.to(acc)).to(dtype)
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        want = (F.silu(gu[:, :I].to(wide)) * gu[:, I:].to(wide)).to(dtype)
        got = torch.ops.treespec.skinny_glu(u, w, sumsq, 1e-6)
        assert torch.equal(got, want), dtype
        assert torch.equal(skinny_glu_reference(u, w, sumsq, 1e-6), want), dtype
        hf = LlamaRMSNorm(K, eps=1e-6).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(g)
            hf_out = skinny_glu_reference(hf(s), w)
        tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.double(), hf_out.double(), rtol=tol, atol=tol)
    _, w = _inputs(M, I, K, torch.float64, seed=4)
    _, _, u, sumsq = _row_scale_inputs(M, K, torch.float64, seed=4, slices=3)
    compiled = torch.compile(lambda a, b, n: torch.ops.treespec.skinny_glu(a, b, n, 1e-6) * 2, backend="aot_eager",
                             fullgraph=True)  # fmt: skip
    assert torch.equal(compiled(u, w, sumsq), skinny_glu_reference(u, w, sumsq, 1e-6) * 2)
    torch.library.opcheck(torch.ops.treespec.skinny_glu.default, (u, w, sumsq, 1e-6))
    torch.library.opcheck(torch.ops.treespec.skinny_glu.default, (u, w))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8)), f"1..{MAX_ROWS} rows"),
        (lambda: (torch.zeros(2, 8), torch.zeros(5, 8)), r"weight: expected \[2I, K=8\]"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 9)), r"weight: expected \[2I, K=8\]"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16)), "weight: expected dtype"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 16)[:, ::2]), "weight: expected contiguous rows"),
        (lambda: (torch.zeros(8, 2).t(), torch.zeros(4, 8)), "x: the last dim must have stride 1"),
        (lambda: (torch.zeros(8), torch.zeros(4, 8)), "x: expected a 2-d"),
    ],
)
def test_bad_input_names_the_argument(make, match):
    x, w = make()
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.skinny_glu(x, w)


BAD_ROW_SCALE = [  # (norm_sumsq, eps, error), for both ops (M = 2)
        (torch.zeros(2), 1e-6, r"norm_sumsq: expected a 2-d tensor \[S, M\]"),
        (torch.zeros(3, 3), 1e-6, r"norm_sumsq: expected \[S, M=2\] \(x's M\)"),
        (torch.zeros(0, 2), 1e-6, rf"norm_sumsq: .* 1 <= S <= {MAX_SUMSQ_SLICES}, got \(0, 2\)"),
        (torch.zeros(MAX_SUMSQ_SLICES + 1, 2), 1e-6, rf"norm_sumsq: .* 1 <= S <= {MAX_SUMSQ_SLICES}"),
        (torch.zeros(3, 2, dtype=torch.float64), 1e-6, "norm_sumsq: expected dtype torch.float32"),
        (torch.zeros(2, 3).t(), 1e-6, "norm_sumsq: expected a contiguous"),
        (torch.zeros(3, 2, device="meta"), 1e-6, "all tensors must be on one device"),
        (torch.zeros(3, 2), -1e-6, "eps: the norm's epsilon must be a finite float >= 0"),
        (torch.zeros(3, 2), float("nan"), "eps: the norm's epsilon must be a finite float >= 0"),
        (torch.zeros(3, 2), float("inf"), "eps: the norm's epsilon must be a finite float >= 0"),
        (None, -1.0, "eps: the norm's epsilon"),
]


@pytest.mark.parametrize("norm_sumsq,eps,match", BAD_ROW_SCALE)
def test_bad_row_scale_arguments_name_the_argument(norm_sumsq, eps, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.skinny_glu(torch.zeros(2, 8), torch.zeros(4, 8), norm_sumsq, eps)


def test_switch_and_tiles(monkeypatch):
    """``TREECOMPILE_SKINNY_GLU``: on unless 0, anything but 0 / 1 refused by name. The tiles are the gate/up
    GEMM's (its measured entry where it has one) at half the slice width."""
    from treecompile.ops import skinny_linear

    monkeypatch.delenv(GLU_ENV, raising=False)
    assert glu_wanted() is True
    monkeypatch.setenv(GLU_ENV, "0")
    assert glu_wanted() is False
    monkeypatch.setenv(GLU_ENV, "1")
    assert glu_wanted() is True
    monkeypatch.setenv(GLU_ENV, "yes")
    with pytest.raises(ValueError, match=GLU_ENV):
        glu_wanted()
    monkeypatch.setattr(skinny_linear, "gpu_class", lambda: "H100 SXM")
    assert glu_config(64, 14336, 4096) == (64, 64, 128, 4, 3)  # the H100's 64-row gate/up entry: 128 x 128, 3 stages
    row = dict(M=32, N=96, K=64, cublas_us=10.0, best=dict(block_n=64, block_k=32, warps=4, stages=2, us=8.0))
    skinny_linear.register_tiles([row])
    try:
        assert glu_config(32, 48, 64) == (32, 32, 32, 4, 2)
    finally:  # the registered row would leak into later tests of the process
        skinny_linear._REGISTERED.pop((32, 96, 64))


def test_tiles_env_replaces_the_choice_and_is_checked(monkeypatch, kernel_device):
    """``TREECOMPILE_SKINNY_GLU_TILES`` (a sweep's winner in a round A/B) replaces the tiles of every launch, the
    measured table's included; a malformed or out-of-range value is refused by name."""
    monkeypatch.setenv(TILES_ENV, "16, 32, 8, 3")
    assert glu_config(64, 14336, 4096) == (64, 16, 32, 8, 3)
    assert glu_config(20, 40, 96) == (32, 16, 32, 8, 3)
    d = kernel_device
    x, w = (t.to(d) for t in _inputs(20, 40, 96, torch.float32, seed=11))
    out = poisoned((20, 40), torch.float32, d)
    _launch_skinny_glu(x, w, out)  # the env's tiles: 16 features of each half a program, K step 32 (3 steps)
    want = skinny_glu_reference(x.cpu().double(), w.cpu().double())
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
    for bad in ("16,32,8", "a,b,c,d", "24,32,4,3", "8,32,4,3", "16,8,4,3", "16,32,32,3", "16,32,4,9", "16,32,3,3"):
        monkeypatch.setenv(TILES_ENV, bad)
        with pytest.raises(ValueError, match=TILES_ENV):
            glu_config(64, 14336, 4096)
