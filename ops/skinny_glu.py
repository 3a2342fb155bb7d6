"""A verify tree's gate/up projection and its gate, ``silu(x @ gate.T) * (x @ up.T)``, as one few-row GEMM.

Why it exists: an 8B verify of 64 nodes runs its MLP's gate/up as one fused [2I, H] GEMM whose [64, 2I] output
goes to memory, then an Inductor kernel reads it back for ``silu(g) * u``: 2.9 us a layer on an H100 with PDL
off, 93 us a verify, against 1.4 us a layer for the decode's one row (notes/gpu-2026-12-05-s41). Here each
program holds the same BLOCK_N features of the gate and of the up projection (two weight row ranges of the
fused weight, two accumulators over one stream of x's K steps) and stores ``silu(g) * u`` for them: one launch
and one [M, I] store in place of a launch, a [M, 2I] store and a reload. (A GEMM epilogue that applies the
gated activation to paired columns is what CUTLASS's and TensorRT-LLM's gated-GEMM epilogues do; read
there, written here for Triton.)

Numerics follow the unfused graph: g and u are rounded to x's dtype (the gate/up GEMM's output), the product
``silu(g) * u`` is computed in float32 and rounded to x's dtype (Inductor's silu-mul kernel). Only the GEMM's
summation order differs from cuBLAS's.

Tiles: the gate/up shape's own entry in ``skinny_linear``'s measured table, half as wide (a program streams
as many weight bytes as that entry's), else its default tiles. ``passes/fuse_glu.py`` applies it to every
qualifying verify (``TREECOMPILE_SKINNY_GLU=0`` turns it off). Timed in 8B rounds (forty-second session,
notes/gpu-2026-12-05-s42.md): verify(64) 6.647 -> 6.556 and 6.629 -> 6.551 ms on an H100 SXM, 5.215-5.232 ->
5.147 on an H200; the decode and draft rounds do not run it.

Shapes
------
x       [M, K]  float16 / bfloat16 / float32 (float64 on the CPU: the reference); 1 <= M <= MAX_ROWS (64);
        last dim contiguous, any row stride
weight  [2I, K] x's dtype, contiguous rows: rows [0, I) the gate projection, [I, 2I) the up projection
        (``fuse_projections``' fused gate/up weight)
out     [M, I]  x's dtype

Only metadata is checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import HAS_TRITON, check_dim, check_dtype, check_same_device, env_switch, pdl_enabled, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["skinny_glu", "skinny_glu_reference", "glu_wanted", "glu_config", "MAX_ROWS", "GLU_ENV"]

MAX_ROWS = 64  # one MMA row block
GLU_ENV = "TREECOMPILE_SKINNY_GLU"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: the CPU reference only


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::skinny_glu", mutates_args=())
def skinny_glu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(x @ weight[:I].T) * (x @ weight[I:].T)`` for ``x [M <= 64, K]`` (see the module docstring)."""
    _check_inputs(x, weight)
    if use_triton(x, weight):
        out = x.new_empty((x.shape[0], weight.shape[0] // 2))
        _launch_skinny_glu(x, weight, out)
        return out
    return skinny_glu_reference(x, weight)


@skinny_glu.register_fake
def _(x, weight):
    _check_inputs(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_dim("x", x, 2, "[M, K]")
    check_dim("weight", weight, 2, "[2I, K]")
    check_dtype("x", x, *_DTYPES)
    check_dtype("weight", weight, x.dtype)
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"x: 1..{MAX_ROWS} rows (one MMA row block), got M={M}")
    if weight.shape[1] != K or weight.shape[0] < 2 or weight.shape[0] % 2:
        raise ValueError(f"weight: expected [2I, K={K}] (gate rows, then up rows), got {tuple(weight.shape)}")
    if K < 1:
        raise ValueError(f"x: K must be >= 1, got K={K}")
    if K > 1 and x.stride(1) != 1:
        raise ValueError(f"x: the last dim must have stride 1, got strides {tuple(x.stride())}")
    if weight.stride(1) != 1 or weight.stride(0) != K:
        raise ValueError(f"weight: expected contiguous rows, got strides {tuple(weight.stride())}")
    check_same_device(x=x, weight=weight)


def glu_wanted() -> bool:
    """Whether ``passes/fuse_glu.py`` fuses every qualifying gate/up + silu-mul: yes unless
    ``TREECOMPILE_SKINNY_GLU=0`` (the unfused chain, for A/B runs). Anything but 0 / 1 is refused by name."""
    return env_switch(GLU_ENV, True)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def glu_config(M: int, I: int, K: int):
    """(block_m, block_n, block_k, num_warps, num_stages): the [M, 2I, K] gate/up GEMM's tiles from
    ``skinny_linear`` (measured entry, else default), block_n halved: each program streams block_n gate and
    block_n up rows, the bytes of one of that GEMM's slices."""
    from .skinny_linear import choose_skinny_config, measured_tiles

    cfg = measured_tiles(M, 2 * I, K)
    if cfg is None or cfg.gemv:
        cfg = choose_skinny_config(M, 2 * I, K)
    block_m = max(16, triton.next_power_of_2(M))
    return block_m, max(16, cfg.block_n // 2), cfg.block_k, cfg.num_warps, cfg.num_stages


def _launch_skinny_glu(x, weight, out, config=None) -> None:
    """Fill preallocated ``out [M, I]`` (any row stride, last dim contiguous). ``config``: a ``glu_config``
    tuple (tests and sweeps), else ``glu_config``'s choice."""
    M, K = x.shape
    I = weight.shape[0] // 2
    block_m, block_n, block_k, warps, stages = config or glu_config(M, I, K)
    if block_m < M:
        raise ValueError(f"config: block_m={block_m} must cover x's M={M}")
    pdl = pdl_enabled(x.device)
    _skinny_glu_kernel[(triton.cdiv(I, block_n),)](
        x, weight, out, M, I, K, x.stride(0), weight.stride(0), out.stride(0),
        EVEN_K=K % block_k == 0, PREC="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **(dict(launch_pdl=True) if pdl else {}),
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def paired_rows_dot(
        x, w, x_rows, a_rows, b_rows, K, s_xm, s_wn,
        EVEN_K: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """``(x[x_rows] @ w[a_rows].T, x[x_rows] @ w[b_rows].T)`` as float32 [BLOCK_M, BLOCK_N] tiles over all of K:
        one x tile a K step feeds both weight row ranges (int64 row indices, all in bounds; the K tail masked
        unless EVEN_K). Shared by the kernels that pair two slices of one weight: gate / up here, the two halves
        of a head in ``skinny_qkv_rope``."""
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x + x_rows[:, None] * s_xm + rk[None, :]
        a_ptrs = w + a_rows[:, None] * s_wn + rk[None, :]
        b_ptrs = w + b_rows[:, None] * s_wn + rk[None, :]
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                at = tl.load(a_ptrs)
                bt = tl.load(b_ptrs)
            else:
                k_ok = ((k0 + rk) < K)[None, :]
                xt = tl.load(x_ptrs, mask=k_ok, other=0.0)
                at = tl.load(a_ptrs, mask=k_ok, other=0.0)
                bt = tl.load(b_ptrs, mask=k_ok, other=0.0)
            acc_a = tl.dot(xt, tl.trans(at), acc_a, input_precision=PREC)
            acc_b = tl.dot(xt, tl.trans(bt), acc_b, input_precision=PREC)
            x_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        return acc_a, acc_b

    @triton.jit
    def _skinny_glu_kernel(
        x, w, out, M, I, K, s_xm, s_wn, s_om,
        EVEN_K: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program n: features [n * BLOCK_N, +BLOCK_N) of the gate (weight rows f) and of the up projection
        (rows I + f), accumulated over K in two float32 tiles from one x tile a step; then g, u rounded to x's
        dtype and ``silu(g) * u`` (float32) stored. Rows past M / features past I read row 0 (in bounds) and are
        dropped at the store."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        n_ok = rn < I
        if USE_PDL:  # wait for the previous kernel (x is its output), then let the next one launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        g_rows = tl.where(n_ok, rn, 0).to(tl.int64)
        acc_g, acc_u = paired_rows_dot(
            x, w, tl.where(m_ok, rm, 0).to(tl.int64), g_rows, g_rows + I, K, s_xm, s_wn,
            EVEN_K, PREC, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        g = acc_g.to(out.dtype.element_ty).to(tl.float32)  # the unfused GEMM's rounding
        u = acc_u.to(out.dtype.element_ty).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        o_ptrs = out + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
        tl.store(o_ptrs, y.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def skinny_glu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The CPU path and the test oracle: the unfused graph's ops and roundings (F.linear in x's dtype, then
    ``silu(g) * u`` in float32 for 16-bit x, rounded back)."""
    I = weight.shape[0] // 2
    gu = F.linear(x, weight)
    g, u = gu[:, :I], gu[:, I:]
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return (F.silu(g.to(wide)) * u.to(wide)).to(x.dtype)
