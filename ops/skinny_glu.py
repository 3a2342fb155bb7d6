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

An optional RMSNorm row scale (``norm_sumsq``, ``eps``) folds the norm in front of a decoder layer's MLP into
this GEMM's epilogue. HF's ``LlamaRMSNorm`` feeds the GEMM ``norm_weight * round(s * r)`` (rounded again), with
``s`` the norm's input and ``r = rsqrt(mean(s^2) + eps)``, one number a row, so ``linear(norm_weight * s * r) =
r * linear(norm_weight * s)``. The producing GEMM (``treespec::skinny_linear_norm_out``) stores ``x = u =
round(norm_weight * s)`` (x's dtype) and ``norm_sumsq [S, M]``, float32 partial sums of ``s^2`` over S column
slices of s (``norm_sumsq.sum(0) = (s.float() ** 2).sum(-1)``); this op streams ``x`` into the MMA exactly as
without the norm, then scales its float32 sums by ``r = rsqrt(norm_sumsq.sum(0) / K + eps)`` (K = x's K, the
norm's width), first thing in the epilogue: before the roundings and silu. That drops the norm's own launch and
its [M, K] store and reload. Rounding: HF rounds ``s * r`` and then ``norm_weight * (s * r)`` to x's dtype; here
``round(norm_weight * s)`` is the only rounding before the GEMM (bfloat16: ~2^-8 relative, as any fusion of the
norm; float32: ~2^-24). In float16 ``norm_weight * s`` must fit the dtype (|value| <= 65504), which HF's order
only asks of the normalised row. The reference (the CPU path) does the same: the GEMM's sums in float32 (float64
for float64 x) scaled by the float32 ``r``, then the roundings. (An earlier version took ``norm_weight`` and did
the norm as a prologue: each K step multiplied the x tile by the norm weight in registers. On an H100 that fed
the MMA from registers and made wgmma synchronous, 17 ``wgmma.wait_group`` in the sm_90 loop where the plain
loop has 2, and an 8B verify went 6.3 -> 9.6 ms; the row scale keeps the K loop the plain one.)

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
norm_sumsq [S, M] or None  float32, contiguous, 1 <= S <= MAX_SUMSQ_SLICES (1024): per-slice sums of the norm
        input's squares; with it the sums are scaled by rsqrt(norm_sumsq.sum(0) / K + eps) (above)
eps     float, finite, >= 0: the norm's epsilon (unused without norm_sumsq)

Only metadata is checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import (
    HAS_TRITON, check_dim, check_dtype, check_same_device, env_switch, env_tiles, pdl_enabled, use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "skinny_glu", "skinny_glu_reference", "glu_wanted", "glu_config", "MAX_ROWS", "MAX_SUMSQ_SLICES", "GLU_ENV",
    "TILES_ENV",
]

MAX_ROWS = 64  # one MMA row block
MAX_SUMSQ_SLICES = 1024  # norm_sumsq's S: the epilogue loads it as one [next_pow2(S), BLOCK_M] tile
GLU_ENV = "TREECOMPILE_SKINNY_GLU"
TILES_ENV = "TREECOMPILE_SKINNY_GLU_TILES"  # "block_n,block_k,warps,stages" for every launch (A/B runs, sweeps)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: the CPU reference only


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::skinny_glu", mutates_args=())
def skinny_glu(
    x: torch.Tensor, weight: torch.Tensor, norm_sumsq: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:  # fmt: skip
    """``silu(x @ weight[:I].T) * (x @ weight[I:].T)`` for ``x [M <= 64, K]``; with ``norm_sumsq``, both sums
    scaled by the row's RMSNorm ``rsqrt(norm_sumsq.sum(0) / K + eps)`` first (see the module docstring)."""
    _check_inputs(x, weight, norm_sumsq, eps)
    if use_triton(x, weight, *(() if norm_sumsq is None else (norm_sumsq,))):
        out = x.new_empty((x.shape[0], weight.shape[0] // 2))
        _launch_skinny_glu(x, weight, out, norm_sumsq=norm_sumsq, eps=eps)
        return out
    if norm_sumsq is None:  # the plain call, as before the row scale existed (callers and test spies see it)
        return skinny_glu_reference(x, weight)
    return skinny_glu_reference(x, weight, norm_sumsq, eps)


@skinny_glu.register_fake
def _(x, weight, norm_sumsq=None, eps=0.0):
    _check_inputs(x, weight, norm_sumsq, eps)
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def check_row_scale(x: torch.Tensor, norm_sumsq: torch.Tensor | None, eps: float) -> None:
    """The RMSNorm row scale's arguments (shared with ``skinny_qkv_rope``), metadata only: ``norm_sumsq`` None or
    2-d ``[S, M]`` (M = x's rows, 1 <= S <= MAX_SUMSQ_SLICES) float32, contiguous (the kernels index it as
    ``s * M + m``), on x's device; ``eps`` finite and >= 0 (checked with or without norm_sumsq: a NaN or
    negative epsilon is a caller's bug either way)."""
    if not 0.0 <= eps < float("inf"):  # NaN fails it too
        raise ValueError(f"eps: the norm's epsilon must be a finite float >= 0, got {eps!r}")
    if norm_sumsq is None:
        return
    M = x.shape[0]
    check_dim("norm_sumsq", norm_sumsq, 2, "[S, M]")
    check_dtype("norm_sumsq", norm_sumsq, torch.float32)
    S = norm_sumsq.shape[0]
    if norm_sumsq.shape[1] != M or not 1 <= S <= MAX_SUMSQ_SLICES:
        raise ValueError(f"norm_sumsq: expected [S, M={M}] (x's M) with 1 <= S <= {MAX_SUMSQ_SLICES}, got "
                         f"{tuple(norm_sumsq.shape)}")  # fmt: skip
    if not norm_sumsq.is_contiguous():
        raise ValueError(f"norm_sumsq: expected a contiguous [S, M] tensor, got strides {tuple(norm_sumsq.stride())}")
    check_same_device(x=x, norm_sumsq=norm_sumsq)


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor, norm_sumsq: torch.Tensor | None = None, eps: float = 0.0
) -> None:  # fmt: skip
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
    check_row_scale(x, norm_sumsq, eps)


def glu_wanted() -> bool:
    """Whether ``passes/fuse_glu.py`` fuses every qualifying gate/up + silu-mul: yes unless
    ``TREECOMPILE_SKINNY_GLU=0`` (the unfused chain, for A/B runs). Anything but 0 / 1 is refused by name."""
    return env_switch(GLU_ENV, True)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def glu_config(M: int, I: int, K: int):
    """(block_m, block_n, block_k, num_warps, num_stages): ``TREECOMPILE_SKINNY_GLU_TILES`` where set (a sweep's
    winner in a round A/B, ``tests/gpu/glu_bench.py``), else the [M, 2I, K] gate/up GEMM's tiles from
    ``skinny_linear`` (measured entry, else default), block_n halved: each program streams block_n gate and
    block_n up rows, the bytes of one of that GEMM's slices."""
    from .skinny_linear import choose_skinny_config, measured_tiles

    block_m = max(16, triton.next_power_of_2(M))
    forced = env_tiles(TILES_ENV, "block_n", lambda n: n >= 16, ">= 16")
    if forced is not None:
        return (block_m, *forced)
    cfg = measured_tiles(M, 2 * I, K)
    if cfg is None or cfg.gemv:
        cfg = choose_skinny_config(M, 2 * I, K)
    return block_m, max(16, cfg.block_n // 2), cfg.block_k, cfg.num_warps, cfg.num_stages


def row_scale_args(x, norm_sumsq, eps: float) -> dict:
    """The row-scale kernel arguments (shared with ``skinny_qkv_rope``'s launcher): without ``norm_sumsq`` x
    stands in for the unused pointer, S = 1 and eps = 0, ROW_SCALE off (the plain kernel)."""
    on = norm_sumsq is not None
    S = norm_sumsq.shape[0] if on else 1
    return dict(ss=norm_sumsq if on else x, eps=float(eps) if on else 0.0, S=S, ROW_SCALE=on,
                S_P2=triton.next_power_of_2(S))  # fmt: skip


def _launch_skinny_glu(x, weight, out, config=None, norm_sumsq=None, eps: float = 0.0) -> None:
    """Fill preallocated ``out [M, I]`` (any row stride, last dim contiguous). ``config``: a ``glu_config``
    tuple (tests and sweeps), else ``glu_config``'s choice. ``norm_sumsq``: the RMSNorm row scale (ROW_SCALE;
    without it the kernel is the plain one)."""
    M, K = x.shape
    I = weight.shape[0] // 2
    block_m, block_n, block_k, warps, stages = config or glu_config(M, I, K)
    if block_m < M:
        raise ValueError(f"config: block_m={block_m} must cover x's M={M}")
    pdl = pdl_enabled(x.device)
    _skinny_glu_kernel[(triton.cdiv(I, block_n),)](
        x, weight, out, M, I, K, x.stride(0), weight.stride(0), out.stride(0), **row_scale_args(x, norm_sumsq, eps),
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
        of a head in ``skinny_qkv_rope``. The tiles go from memory straight into the MMA (no register pass over
        x: that made sm_90's wgmma synchronous, module docstring)."""
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
    def row_rsqrt(ss, eps, S, M, K, rm, S_P2: tl.constexpr, BLOCK_M: tl.constexpr):
        """The RMSNorm row scale ``rsqrt(sum_s ss[s, m] / K + eps)`` for rows ``rm`` as a float32 [BLOCK_M]
        vector: ``ss`` the contiguous [S, M] float32 partial sums of squares, loaded as one [S_P2, BLOCK_M]
        tile (slices past S masked, read as 0). Rows past M read row 0's sums, as the kernels' x rows past M read
        row 0: their sums are row 0's, scaled alike and finite (an unscaled or rsqrt(eps)-scaled dead row can
        overflow silu's exp), and dropped at the store."""
        rs = tl.arange(0, S_P2)
        rows = tl.where(rm < M, rm, 0)
        tile = tl.load(ss + rs[:, None] * M + rows[None, :], mask=(rs < S)[:, None], other=0.0)
        return tl.rsqrt(tl.sum(tile, axis=0) / K + eps)

    @triton.jit
    def _skinny_glu_kernel(
        x, w, out, M, I, K, s_xm, s_wn, s_om, ss, eps, S,
        ROW_SCALE: tl.constexpr, S_P2: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
        USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program n: features [n * BLOCK_N, +BLOCK_N) of the gate (weight rows f) and of the up projection
        (rows I + f), accumulated over K in two float32 tiles from one x tile a step; (ROW_SCALE: both scaled by
        the row's norm rsqrt from ``ss``, ``row_rsqrt``) then g, u rounded to x's dtype and ``silu(g) * u``
        (float32) stored. Rows past M / features past I read row 0 (in bounds) and are dropped at the store."""
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
        if ROW_SCALE:  # r is one number a row: linear(norm_weight * s * r) = r * linear(norm_weight * s)
            r = row_rsqrt(ss, eps, S, M, K, rm, S_P2, BLOCK_M)[:, None]
            acc_g *= r
            acc_u *= r
        g = acc_g.to(out.dtype.element_ty).to(tl.float32)  # the unfused GEMM's rounding
        u = acc_u.to(out.dtype.element_ty).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        o_ptrs = out + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
        tl.store(o_ptrs, y.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def row_scale_reference(x: torch.Tensor, norm_sumsq: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm row scale as the kernels compute it (shared with ``skinny_qkv_rope``): ``r = rsqrt(
    norm_sumsq.sum(0) / K + eps)`` in float32, as an [M, 1] column."""
    return torch.rsqrt(norm_sumsq.to(torch.float32).sum(0) / x.shape[1] + eps)[:, None]


def scaled_linear_reference(x, weight, bias, norm_sumsq, eps: float) -> torch.Tensor:
    """The GEMM's sums in float32 (float64 for float64 x) scaled by the row scale, plus ``bias`` (unscaled),
    rounded to x's dtype (shared with ``skinny_qkv_rope``)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    sums = F.linear(x.to(acc), weight.to(acc)) * row_scale_reference(x, norm_sumsq, eps).to(acc)
    if bias is not None:
        sums = sums + bias.to(acc)
    return sums.to(x.dtype)


def skinny_glu_reference(
    x: torch.Tensor, weight: torch.Tensor, norm_sumsq: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:  # fmt: skip
    """The CPU path and the test oracle: the unfused graph's ops and roundings (F.linear in x's dtype, then
    ``silu(g) * u`` in float32 for 16-bit x, rounded back). With ``norm_sumsq`` the GEMM's sums are float32
    (float64 for float64 x), scaled by ``row_scale_reference``'s r and then rounded to x's dtype."""
    I = weight.shape[0] // 2
    gu = F.linear(x, weight) if norm_sumsq is None else scaled_linear_reference(x, weight, None, norm_sumsq, eps)
    g, u = gu[:, :I], gu[:, I:]
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return (F.silu(g.to(wide)) * u.to(wide)).to(x.dtype)
