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

An optional RMSNorm prologue (``norm_weight``, ``eps``) folds the norm in front of a decoder layer's MLP into the
GEMM, as ``fused_mlp``'s does: the gate/up input is then HF's ``LlamaRMSNorm`` of x, ``norm_weight * (s * r)``
with ``s = x.float()`` and ``r = rsqrt(mean(s^2) + eps)`` (x is the norm's input; the residual add before it is
the producing GEMM's epilogue, not this op's). No program needs the normalised row before its first K step:
``r`` is one number a row, so ``linear(norm_weight * s * r) = r * linear(norm_weight * s)``; each program feeds
``norm_weight * s`` (float32 product, rounded to x's dtype) to the MMA, sums ``s^2`` in float32 over the same
steps, and scales both accumulators by ``r`` after the loop, before the roundings and silu. That drops the
norm's own launch and its [M, K] store and reload. Rounding differs from HF's at one point: HF rounds ``s * r``
to x's dtype and then ``norm_weight * (s * r)``, the kernel rounds ``norm_weight * s`` once (bfloat16: ~2^-8
relative, as any fusion of the norm does; float32: ~2^-24). The reference (the CPU path, which float64 lossless
runs take) is HF's exactly, float32 norm for float64 x included. In float16 ``norm_weight * s`` must fit the
dtype (|value| <= 65504), which HF's order only asks of the normalised row.

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
norm_weight [K] or None  x's dtype, any stride: with it, the GEMM's input is rmsnorm(x) * norm_weight (above)
eps     float, finite, >= 0: the norm's epsilon (unused without norm_weight)

Only metadata is checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import HAS_TRITON, check_dim, check_dtype, check_same_device, env_switch, pdl_enabled, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "skinny_glu", "skinny_glu_reference", "rmsnorm_reference", "glu_wanted", "glu_config", "MAX_ROWS", "GLU_ENV",
]

MAX_ROWS = 64  # one MMA row block
GLU_ENV = "TREECOMPILE_SKINNY_GLU"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: the CPU reference only


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::skinny_glu", mutates_args=())
def skinny_glu(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:  # fmt: skip
    """``silu(x @ weight[:I].T) * (x @ weight[I:].T)`` for ``x [M <= 64, K]``, x first normalised (HF RMSNorm)
    when ``norm_weight`` is given (see the module docstring)."""
    _check_inputs(x, weight, norm_weight, eps)
    if use_triton(x, weight, *(() if norm_weight is None else (norm_weight,))):
        out = x.new_empty((x.shape[0], weight.shape[0] // 2))
        _launch_skinny_glu(x, weight, out, norm_weight=norm_weight, eps=eps)
        return out
    if norm_weight is None:  # the plain call, as before the prologue existed (callers and test spies see it)
        return skinny_glu_reference(x, weight)
    return skinny_glu_reference(x, weight, norm_weight, eps)


@skinny_glu.register_fake
def _(x, weight, norm_weight=None, eps=0.0):
    _check_inputs(x, weight, norm_weight, eps)
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def check_norm_prologue(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> None:
    """The RMSNorm prologue's arguments (shared with ``skinny_qkv_rope``), metadata only: ``norm_weight`` None
    or 1-d ``[K]`` of x's dtype on x's device (any stride: the kernels load it with its stride); ``eps`` finite
    and >= 0 (checked with or without norm_weight: a NaN or negative epsilon is a caller's bug either way)."""
    if not 0.0 <= eps < float("inf"):  # NaN fails it too
        raise ValueError(f"eps: the norm's epsilon must be a finite float >= 0, got {eps!r}")
    if norm_weight is None:
        return
    K = x.shape[1]
    check_dim("norm_weight", norm_weight, 1, "[K]")
    check_dtype("norm_weight", norm_weight, x.dtype)
    if norm_weight.shape[0] != K:
        raise ValueError(f"norm_weight: expected [K={K}] (x's K), got {tuple(norm_weight.shape)}")
    check_same_device(x=x, norm_weight=norm_weight)


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0
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
    check_norm_prologue(x, norm_weight, eps)


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


def _launch_skinny_glu(x, weight, out, config=None, norm_weight=None, eps: float = 0.0) -> None:
    """Fill preallocated ``out [M, I]`` (any row stride, last dim contiguous). ``config``: a ``glu_config``
    tuple (tests and sweeps), else ``glu_config``'s choice. ``norm_weight``: the RMSNorm prologue (NORM; without
    it x stands in for the unused pointer and the kernel is the plain one)."""
    M, K = x.shape
    I = weight.shape[0] // 2
    block_m, block_n, block_k, warps, stages = config or glu_config(M, I, K)
    if block_m < M:
        raise ValueError(f"config: block_m={block_m} must cover x's M={M}")
    pdl = pdl_enabled(x.device)
    norm = norm_weight is not None
    _skinny_glu_kernel[(triton.cdiv(I, block_n),)](
        x, weight, out, norm_weight if norm else x, float(eps), M, I, K, x.stride(0), weight.stride(0),
        out.stride(0), norm_weight.stride(0) if norm else 0, NORM=norm, EVEN_K=K % block_k == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **(dict(launch_pdl=True) if pdl else {}),
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def paired_rows_dot(
        x, w, nw, eps, x_rows, a_rows, b_rows, K, s_xm, s_wn, s_nw, NORM: tl.constexpr,
        EVEN_K: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """``(x[x_rows] @ w[a_rows].T, x[x_rows] @ w[b_rows].T)`` as float32 [BLOCK_M, BLOCK_N] tiles over all of K:
        one x tile a K step feeds both weight row ranges (int64 row indices, all in bounds; the K tail masked
        unless EVEN_K). Shared by the kernels that pair two slices of one weight: gate / up here, the two halves
        of a head in ``skinny_qkv_rope``.

        NORM (the RMSNorm prologue, module docstring): x is the norm's input s. Each step feeds
        ``norm_weight * s`` (float32 product rounded to x's dtype; norm weight ``nw`` read with its stride
        ``s_nw``, a masked tail reads 0 for both) and adds the row's float32 ``s^2`` to ``sum_sq``; after the
        loop both tiles are scaled by ``r = rsqrt(sum_sq / K + eps)``, so a caller's epilogue (bias, roundings,
        activation, rotation) starts from the normalised row's sums. Without NORM the code is the plain loop."""
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x + x_rows[:, None] * s_xm + rk[None, :]
        a_ptrs = w + a_rows[:, None] * s_wn + rk[None, :]
        b_ptrs = w + b_rows[:, None] * s_wn + rk[None, :]
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if NORM:
            n_ptrs = nw + rk * s_nw
            sum_sq = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                at = tl.load(a_ptrs)
                bt = tl.load(b_ptrs)
                if NORM:
                    nt = tl.load(n_ptrs)
            else:
                k_in = (k0 + rk) < K
                k_ok = k_in[None, :]
                xt = tl.load(x_ptrs, mask=k_ok, other=0.0)
                at = tl.load(a_ptrs, mask=k_ok, other=0.0)
                bt = tl.load(b_ptrs, mask=k_ok, other=0.0)
                if NORM:
                    nt = tl.load(n_ptrs, mask=k_in, other=0.0)
            if NORM:  # tail columns: s = 0 adds nothing to sum_sq, and norm_weight * s = 0 nothing to the sums
                sf = xt.to(tl.float32)
                sum_sq += tl.sum(sf * sf, axis=1)
                xt = (sf * nt.to(tl.float32)[None, :]).to(x.dtype.element_ty)
                n_ptrs += BLOCK_K * s_nw
            acc_a = tl.dot(xt, tl.trans(at), acc_a, input_precision=PREC)
            acc_b = tl.dot(xt, tl.trans(bt), acc_b, input_precision=PREC)
            x_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if NORM:  # r is one number a row: linear(norm_weight * s * r) = r * linear(norm_weight * s)
            r = tl.rsqrt(sum_sq / K + eps)[:, None]
            acc_a *= r
            acc_b *= r
        return acc_a, acc_b

    @triton.jit
    def _skinny_glu_kernel(
        x, w, out, nw, eps, M, I, K, s_xm, s_wn, s_om, s_nw,
        NORM: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program n: features [n * BLOCK_N, +BLOCK_N) of the gate (weight rows f) and of the up projection
        (rows I + f), accumulated over K in two float32 tiles from one x tile a step; then g, u rounded to x's
        dtype and ``silu(g) * u`` (float32) stored. Rows past M / features past I read row 0 (in bounds) and are
        dropped at the store. NORM: x is the norm's input; ``paired_rows_dot`` returns the sums already scaled
        by the row's rsqrt(mean(x^2) + eps), so the roundings and silu below see the normalised row's GEMM."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        n_ok = rn < I
        if USE_PDL:  # wait for the previous kernel (x is its output), then let the next one launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        g_rows = tl.where(n_ok, rn, 0).to(tl.int64)
        acc_g, acc_u = paired_rows_dot(
            x, w, nw, eps, tl.where(m_ok, rm, 0).to(tl.int64), g_rows, g_rows + I, K, s_xm, s_wn, s_nw,
            NORM, EVEN_K, PREC, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        g = acc_g.to(out.dtype.element_ty).to(tl.float32)  # the unfused GEMM's rounding
        u = acc_u.to(out.dtype.element_ty).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        o_ptrs = out + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
        tl.store(o_ptrs, y.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def rmsnorm_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm`` of x, op for op (shared with ``skinny_qkv_rope``): the row's statistics and scale in
    float32 whatever x's dtype (HF casts to float32, so a float64 model's norm is float32 too, and float64
    lossless runs must match that), ``s * r`` rounded to x's dtype, then multiplied by ``norm_weight`` in x's
    dtype (a second rounding; the kernel rounds once, module docstring)."""
    s = x.to(torch.float32)
    variance = s.pow(2).mean(-1, keepdim=True)
    s = s * torch.rsqrt(variance + eps)
    return norm_weight * s.to(x.dtype)


def skinny_glu_reference(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:  # fmt: skip
    """The CPU path and the test oracle: the unfused graph's ops and roundings (with ``norm_weight``, first HF's
    RMSNorm of x; F.linear in x's dtype, then ``silu(g) * u`` in float32 for 16-bit x, rounded back)."""
    if norm_weight is not None:
        x = rmsnorm_reference(x, norm_weight, eps)
    I = weight.shape[0] // 2
    gu = F.linear(x, weight)
    g, u = gu[:, :I], gu[:, I:]
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return (F.silu(g.to(wide)) * u.to(wide)).to(x.dtype)
