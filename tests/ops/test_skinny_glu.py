"""treespec::skinny_glu: the Triton kernel (interpreter on CPU, the device on GPU) against the float64 unfused
gate/up + silu-mul, over row counts 1..64, I not a multiple of the slice, K not a multiple of the step, strided
rows; the op's CPU path and its boundary checks. Outputs are poisoned with NaN so an unwritten element fails.
bfloat16 runs on the GPU only (the interpreter's tl.dot misreads bfloat16 operands)."""

from __future__ import annotations

import pytest
import torch
from conftest import poisoned
from treecompile.ops.skinny_glu import (
    GLU_ENV, MAX_ROWS, _launch_skinny_glu, glu_config, glu_wanted, skinny_glu_reference,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(M, I, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(2 * I, K, generator=gen) / K**0.5).to(dtype)
    return x, w


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
