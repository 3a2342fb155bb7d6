"""``F.linear`` for few rows: a Triton GEMM tiled for M <= 64 (decode, draft lanes, small verify trees).

Why it exists: on the H200 cuBLAS runs the small-row GEMMs of a round as ``nvjet`` kernels that cost a fixed
~3.3-4.2 us each whatever the bytes (notes/gpu-2026-12-01-s9, SmolLM2 shapes: [1, 576] x [576, 960] 3.9 us,
[64, 576] x [576, 960] 4.2 us; 120 of them a forward, ~40% of a 1-row decode). And at 8B the qkv and o
projections of a 1-row decode stream their weights at 3.1-3.2 TB/s where the gate/up GEMM reaches 4.1
(notes/gpu-2026-11-30f/prof/decode.txt). A tile of 16-64 rows x a narrow slice of the output features, one
program per slice, the reduction dim streamed in BLOCK_K chunks, has a short prologue and puts many
programs in flight. Whether it wins, and with which tiles, is measured by ``tests/gpu/skinny_sweep.py`` on
cold weights (each call reads a different copy, as a forward does).

Shapes
------
x      [M, K]  float16 / bfloat16 / float32; 1 <= M <= MAX_ROWS; last dim contiguous, any row stride
weight [N, K]  x's dtype, contiguous (an ``nn.Linear`` weight, or a view of rows of one)
bias   [N] or None
out    [M, N]  x's dtype; accumulated in float32 (float32 inputs: IEEE products, no TF32)

Results equal ``F.linear`` up to summation order (a different kernel: not bitwise equal to cuBLAS).
Only metadata is checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._common import HAS_TRITON, check_dim, check_dtype, check_same_device, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "skinny_linear", "skinny_linear_reference", "linear_rows", "SkinnyConfig", "choose_skinny_config", "MAX_ROWS",
]

MAX_ROWS = 64
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M <= 64, K]`` (see the module docstring)."""
    _check_inputs(x, weight, bias)
    if use_triton(x, weight, *([bias] if bias is not None else [])):
        out = x.new_empty((x.shape[0], weight.shape[0]))
        _launch_skinny_linear(x, weight, bias, out)
        return out
    return skinny_linear_reference(x, weight, bias)


@skinny_linear.register_fake
def _(x, weight, bias=None):
    _check_inputs(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_dim("x", x, 2, "[M, K]")
    check_dim("weight", weight, 2, "[N, K]")
    check_dtype("x", x, *_DTYPES)
    check_dtype("weight", weight, x.dtype)
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"x: 1..{MAX_ROWS} rows (a skinny GEMM), got M={M}; use F.linear for more")
    if weight.shape[1] != K:
        raise ValueError(f"weight: expected [N, K={K}] (x's K), got {tuple(weight.shape)}")
    if K < 1 or weight.shape[0] < 1:
        raise ValueError(f"x, weight: K and N must be >= 1, got K={K}, N={weight.shape[0]}")
    if K > 1 and x.stride(1) != 1:
        raise ValueError(f"x: the last dim must have stride 1, got strides {tuple(x.stride())}")
    if K > 1 and weight.stride(1) != 1:
        raise ValueError(f"weight: the last dim must have stride 1, got strides {tuple(weight.stride())}")
    devices = dict(x=x, weight=weight)
    if bias is not None:
        check_dim("bias", bias, 1, "[N]")
        check_dtype("bias", bias, x.dtype)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias: expected [N={weight.shape[0]}], got {tuple(bias.shape)}")
        devices["bias"] = bias
    check_same_device(**devices)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x [..., K], weight, bias)``, through ``skinny_linear`` where it applies: 16-bit CUDA inputs
    of at most ``MAX_ROWS`` rows (the product of the leading dims) and a weight with a contiguous last dim.
    Everything else (CPU, float32, more rows) runs ``F.linear``. The choice reads static metadata only."""
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if (
        x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype and weight.dim() == 2
        and 1 <= M <= MAX_ROWS and (K == 1 or weight.stride(1) == 1)
        and (bias is None or bias.dtype == x.dtype)
    ):  # fmt: skip
        out = torch.ops.treespec.skinny_linear(x.reshape(M, K), weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of one launch: BLOCK_M rows (>= 16, the MMA's least), BLOCK_N output features a program,
    BLOCK_K of the reduction dim a step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def choose_skinny_config(M: int, N: int, K: int, **override) -> SkinnyConfig:
    """Static tiles from the shapes. Placeholder rule until the H200 sweep (``tests/gpu/skinny_sweep.py``)
    fills in measured ones: rows in one tile; 16-wide slices of the output features unless that makes more
    than ~4 programs per SM (132 SMs), so small layers get many programs and large ones long K streams."""
    block_m = max(16, triton.next_power_of_2(M))
    block_n = 16
    while block_n < 128 and triton.cdiv(N, block_n) > 4 * 132:
        block_n *= 2
    block_k = 128 if block_m <= 16 else 64
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    cfg = dict(block_m=block_m, block_n=block_n, block_k=block_k)
    cfg.update(override)
    return SkinnyConfig(**cfg)


def _launch_skinny_linear(x, weight, bias, out, config: SkinnyConfig | None = None) -> None:
    """Fill preallocated ``out [M, N]`` (any row stride, last dim contiguous)."""
    M, K = x.shape
    N = weight.shape[0]
    cfg = config or choose_skinny_config(M, N, K)
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m))
    _skinny_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out,
        M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _skinny_linear_kernel(
        x, w, b, out, M, N, K, s_xm, s_wn, s_om,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program (n slice, m block): out[m block, n slice] = x[m block] @ w[n slice].T (+ bias)."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        # Rows past M / N read row 0 (in bounds) instead of a masked load: the hot loop carries only the K
        # mask, and the rows are dropped at the store.
        x_ptrs = x + tl.where(m_ok, rm, 0).to(tl.int64)[:, None] * s_xm + rk[None, :]
        w_ptrs = w + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * s_wn + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                wt = tl.load(w_ptrs)
            else:
                k_ok = (k0 + rk) < K
                xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path and the test oracle: ``F.linear``."""
    return F.linear(x, weight, bias)
