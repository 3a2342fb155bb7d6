"""treespec::skinny_glu: the Triton kernel (interpreter on CPU, the device on GPU) against the float64 unfused
gate/up + silu-mul, over row counts 1..64, I not a multiple of the slice, K not a multiple of the step, strided
rows; the RMSNorm prologue against HF's norm in float64 (rows of very different magnitudes, a norm weight far from
ones, K tails, strided x and norm weight); the op's CPU path (HF's norm exactly) and its boundary checks. Outputs
are poisoned with NaN so an unwritten element fails. bfloat16 runs on the GPU only (the interpreter's tl.dot
misreads bfloat16 operands)."""

from __future__ import annotations

import pytest
import torch
from conftest import poisoned
from treecompile.ops.skinny_glu import (
    GLU_ENV, MAX_ROWS, _launch_skinny_glu, glu_config, glu_wanted, rmsnorm_reference, skinny_glu_reference,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(M, I, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(2 * I, K, generator=gen) / K**0.5).to(dtype)
    return x, w


def _norm_inputs(M, K, dtype, seed):
    """The norm's input rows at magnitudes from 1/16 to 64 (a dropped or misplaced per-row scale r fails) and a
    norm weight of varied values around 1, some negative (a dropped norm weight fails)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * 2.0 ** (torch.arange(M) % 11 - 4.0)[:, None]
    norm_weight = 1 + 0.6 * torch.randn(K, generator=gen)
    return x.to(dtype), norm_weight.to(dtype)


def _rmsnorm_float64(x, norm_weight, eps):
    """HF's LlamaRMSNorm written out in float64 (no rounding anywhere): the float64 oracle's norm."""
    s = x.cpu().double()
    return norm_weight.cpu().double() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16], ids=str)
@pytest.mark.parametrize(
    "M,I,K,config",
    [(1, 16, 64, (16, 16, 32, 4, 2)), (17, 24, 72, (32, 16, 32, 4, 2)), (20, 40, 96, (32, 32, 32, 4, 3)),
     (64, 40, 200, (64, 16, 16, 4, 2)), (33, 50, 64, None)],
)  # fmt: skip
def test_norm_prologue_matches_float64_hf_norm(dtype, M, I, K, config, kernel_device):
    """With norm_weight the gate/up input is HF's RMSNorm of x: the row's sum of squares over the same K steps
    (a tail step, K = 72 or 200 past the last 32 / 16, adds nothing), the accumulators scaled by r before the
    roundings and silu. Against the float64 oracle a little looser than without the norm at 16 bits (the kernel
    rounds norm_weight * x to x's dtype); against the op's HF-rounding reference, float16, one rounding apart."""
    d = kernel_device
    _, w = _inputs(M, I, K, dtype, seed=M + I + K)
    x, norm_weight = _norm_inputs(M, K, dtype, seed=M * K)
    x, w, norm_weight = x.to(d), w.to(d), norm_weight.to(d)
    out = poisoned((M, I), dtype, d)
    _launch_skinny_glu(x, w, out, config, norm_weight, 1e-5)
    assert not out.isnan().any(), "unwritten output elements"
    want = skinny_glu_reference(_rmsnorm_float64(x, norm_weight, 1e-5), w.cpu().double())
    tol = {torch.float32: 1e-5, torch.float16: 3e-2, torch.bfloat16: 8e-2}[dtype]
    torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)
    if dtype == torch.float16:  # HF's rounding (norm_weight * round(x * r)) against the kernel's one rounding
        hf = skinny_glu_reference(x.cpu(), w.cpu(), norm_weight.cpu(), 1e-5)
        torch.testing.assert_close(out.cpu().float(), hf.float(), rtol=4e-3, atol=4e-3)


def test_norm_prologue_with_strided_rows_and_norm_weight(kernel_device):
    """x as a column range of a wider table and the norm weight as a column of another (stride 3): both read with
    their strides; eps enters the scale (and with eps > 0 a row of zeros gives zeros, not NaN)."""
    d = kernel_device
    M, I, K = 20, 24, 72
    _, w = (t.to(d) for t in _inputs(M, I, K, torch.float32, seed=8))
    x, norm_weight = _norm_inputs(M, K, torch.float32, seed=8)
    x[3] = 0.0
    wide_x = torch.zeros(M, K + 24, device=d)
    wide_x[:, 8 : 8 + K] = x.to(d)
    table = torch.zeros(K, 3, device=d)
    table[:, 1] = norm_weight.to(d)
    assert table[:, 1].stride(0) == 3
    for eps in (1e-6, 0.5):
        out = poisoned((M, I), torch.float32, d)
        _launch_skinny_glu(wide_x[:, 8 : 8 + K], w, out, (32, 16, 32, 4, 2), table[:, 1], eps)
        want = skinny_glu_reference(_rmsnorm_float64(x, norm_weight, eps), w.cpu().double())
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
        assert not out[3].any()  # silu(0) * 0


def test_norm_op_on_cpu_is_hf_exactly_and_traces():
    """The CPU path with norm_weight is HF's LlamaRMSNorm (its float32 statistics whatever x's dtype, float64
    included, and its two roundings) followed by the reference: bit for bit, so float64 lossless runs stay
    lossless; the op traces with the new arguments and passes opcheck."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    M, I, K = 24, 16, 40
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        _, w = _inputs(M, I, K, dtype, seed=4)
        x, norm_weight = _norm_inputs(M, K, dtype, seed=4)
        hf = LlamaRMSNorm(K, eps=1e-6).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(norm_weight)
            normed = hf(x)
        assert torch.equal(rmsnorm_reference(x, norm_weight, 1e-6), normed), dtype
        want = skinny_glu_reference(normed, w)
        assert torch.equal(skinny_glu_reference(x, w, norm_weight, 1e-6), want), dtype
        assert torch.equal(torch.ops.treespec.skinny_glu(x, w, norm_weight, 1e-6), want), dtype
    _, w = _inputs(M, I, K, torch.float64, seed=4)
    x, norm_weight = _norm_inputs(M, K, torch.float64, seed=4)
    compiled = torch.compile(lambda a, b, n: torch.ops.treespec.skinny_glu(a, b, n, 1e-6) * 2, backend="aot_eager",
                             fullgraph=True)  # fmt: skip
    assert torch.equal(compiled(x, w, norm_weight), skinny_glu_reference(x, w, norm_weight, 1e-6) * 2)
    torch.library.opcheck(torch.ops.treespec.skinny_glu.default, (x, w, norm_weight, 1e-6))
    torch.library.opcheck(torch.ops.treespec.skinny_glu.default, (x, w))


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


@pytest.mark.parametrize(
    "norm_weight,eps,match",
    [
        (torch.zeros(7), 1e-6, r"norm_weight: expected \[K=8\] \(x's K\)"),
        (torch.zeros(1, 8), 1e-6, r"norm_weight: expected a 1-d tensor \[K\]"),
        (torch.zeros(8, dtype=torch.float16), 1e-6, "norm_weight: expected dtype torch.float32"),
        (torch.zeros(8, device="meta"), 1e-6, "all tensors must be on one device"),
        (torch.zeros(8), -1e-6, "eps: the norm's epsilon must be a finite float >= 0"),
        (torch.zeros(8), float("nan"), "eps: the norm's epsilon must be a finite float >= 0"),
        (torch.zeros(8), float("inf"), "eps: the norm's epsilon must be a finite float >= 0"),
        (None, -1.0, "eps: the norm's epsilon"),
    ],
)
def test_bad_norm_arguments_name_the_argument(norm_weight, eps, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.skinny_glu(torch.zeros(2, 8), torch.zeros(4, 8), norm_weight, eps)


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
    assert glu_config(32, 48, 64) == (32, 32, 32, 4, 2)
