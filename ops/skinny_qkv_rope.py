"""A verify tree's fused q/k/v projection with the rotary embedding of q and k as its epilogue: one few-row GEMM.

Why it exists: an 8B verify of 64 nodes runs its q/k/v as one fused [(Hq + 2 Hkv) D, H] GEMM (cuBLAS: the Triton
tiles only tie it at 64 rows), then an Inductor kernel reads q and k back, rotates them and writes the layouts
attention wants: 3.7 us a layer on an H100 with PDL off, 117 us a verify, against 1.6 us a layer for the
decode's one row (notes/gpu-2026-12-05-s42.md). Here each program holds the same BLOCK_N features of both halves
of one head (rows ``h D + c`` and ``h D + D/2 + c`` of the fused weight, two accumulators over one stream of
x's K steps), which is exactly what the rotate-half rotary embedding pairs, so the rotation is an epilogue on
registers and q, k, v are stored once, each contiguous. (Serving engines do not run the rotation alone either:
TensorRT-LLM's ``applyBiasRopeUpdateKVCache`` adds the q/k/v bias, rotates and writes the KV cache in one kernel
after the GEMM. Here the GEMM's epilogue takes bias and rotation, with the head-halves pairing of ``skinny_glu``'s
gate/up programs.)

Numerics follow the unfused graph: the GEMM's outputs are rounded to x's dtype (the fused linear's output), the
rotation ``a * cos + rotate_half(a) * sin`` runs in float32 from x-dtype cos / sin (HF casts them to q's dtype)
and is rounded once (Inductor's fused pointwise kernel). Only the GEMM's summation order differs from cuBLAS's.

An optional RMSNorm row scale (``norm_sumsq``, ``eps``; ``skinny_glu``'s, whose docstring has the full story)
folds the norm in front of a decoder layer's attention into this GEMM's epilogue. HF feeds the q/k/v GEMM
``norm_weight * round(s * r)`` (rounded again), ``r = rsqrt(mean(s^2) + eps)`` one number a row; the producing GEMM
(``treespec::skinny_linear_norm_out``) stores ``x = u = round(norm_weight * s)`` and ``norm_sumsq [S, M]``, float32
partial sums of ``s^2`` over S column slices of s; this op streams ``x`` into the MMA as without the norm and
scales the float32 sums by ``r = rsqrt(norm_sumsq.sum(0) / K + eps)`` first in the epilogue: before the bias,
which is not scaled (``linear(normed) = r * (W @ (norm_weight * s)) + bias``), before the roundings and the
rotation. Rounding: one rounding of ``norm_weight * s`` where HF has two (bfloat16: ~2^-8 relative; float32:
~2^-24); in float16 ``norm_weight * s`` must fit the dtype. The reference (the CPU path) does the same: float32
sums (float64 for float64 x) scaled by the float32 ``r``, plus the bias, rounded, then the rotation. (The earlier
RMSNorm prologue, ``norm_weight`` multiplied into each K step's x tile in registers, made sm_90's wgmma
synchronous, 17 ``wgmma.wait_group`` in the loop against 2, and an 8B verify 6.3 -> 9.6 ms on an H100: gone.)

Tiles: the q/k/v shape's MMA entry in ``skinny_linear``'s measured table whether or not it beat cuBLAS (the op
replaces two launches, not one GEMM), half as wide, capped at D/2; else that shape's default tiles.
``passes/fuse_qkv_rope.py`` applies it to every qualifying verify (``TREECOMPILE_SKINNY_ROPE=0`` turns it off).
Forty-second session, H100 SXM (``tests/gpu/rope_bench.py``, 8B shape, 64 rows): equal to the unfused bf16 graph
bit for bit; 21.75 us against 25.83 for cuBLAS q/k/v + the compiled rotary kernel; one 8B round run with it:
verify(64) 6.508 ms against 6.551-6.556 on other H100s. Forty-third session, one H200, two A/Bs in the same
machine (``tests/gpu/session69.sh``): verify(64) 5.041 -> 5.010 and 5.026 -> 4.977 ms (notes/gpu-2026-12-05-s43.md).
Split-K over the K steps (each slice's partials summed by its last program, then this epilogue) was built and
timed in the fifty-fifth session on a slower H100 (notes/gpu-2026-12-07-s55): every split config ran 16-37% slower
than these tiles (25.2-29.8 us against 21.7), so it was taken out again.

Shapes
------
x       [M, K]   float16 / bfloat16 / float32 (float64 on the CPU: the reference); 1 <= M <= MAX_ROWS (64);
                 last dim contiguous, any row stride
weight  [(Hq + 2 Hkv) D, K]  x's dtype, contiguous rows: q heads, then k heads, then v heads (``fuse_projections``)
bias    [(Hq + 2 Hkv) D] or None, x's dtype, any stride (Qwen2's q/k/v bias: added to the float32 sums before
                 the rounding, as an addmm does)
cos/sin [M, D]   x's dtype, last dim contiguous, any row stride: row i's rotary table (HF's ``cos``/``sin``)
out     q [M, Hq D], k [M, Hkv D] (both rotated), v [M, Hkv D]; x's dtype, contiguous
norm_sumsq [S, M] or None  float32, contiguous, 1 <= S <= 1024 (``MAX_SUMSQ_SLICES``): per-slice sums of the
                 norm input's squares; with it the sums (not the bias) are scaled by rsqrt(norm_sumsq.sum(0) / K + eps)
eps     float, finite, >= 0: the norm's epsilon (unused without norm_sumsq)

On CUDA, D / 2 must be a multiple of 16 (the MMA tile's least width). Only metadata is checked at the boundary:
no host sync, safe under CUDA-graph capture.
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

    from .skinny_glu import paired_rows_dot, row_rsqrt, row_scale_args

from .skinny_glu import check_row_scale, scaled_linear_reference

__all__ = [
    "skinny_qkv_rope", "skinny_qkv_rope_reference", "rope_wanted", "rope_config", "MAX_ROWS", "ROPE_ENV",
    "MIN_HALF", "TILES_ENV",
]  # fmt: skip

MAX_ROWS = 64  # one MMA row block
MIN_HALF = 16  # a program's features per head half: tl.dot's least N
ROPE_ENV = "TREECOMPILE_SKINNY_ROPE"
TILES_ENV = "TREECOMPILE_SKINNY_ROPE_TILES"  # "half,block_k,warps,stages" for every launch (A/B runs, sweeps)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: the CPU reference only


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::skinny_qkv_rope", mutates_args=())
def skinny_qkv_rope(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, norm_sumsq: torch.Tensor | None = None, eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rope(x @ Wq.T + bq), rope(x @ Wk.T + bk), x @ Wv.T + bv)`` for ``x [M <= 64, K]``; with ``norm_sumsq``,
    the sums (not the bias) scaled by the row's RMSNorm ``rsqrt(norm_sumsq.sum(0) / K + eps)`` (module docstring)."""
    D = _check_inputs(x, weight, bias, cos, sin, num_q_heads, num_kv_heads, norm_sumsq, eps)
    if use_triton(x, weight, cos, sin, *(() if norm_sumsq is None else (norm_sumsq,))):
        q, k, v = _empty_outputs(x, num_q_heads, num_kv_heads, D)
        _launch_skinny_qkv_rope(x, weight, bias, cos, sin, q, k, v, norm_sumsq=norm_sumsq, eps=eps)
        return q, k, v
    if norm_sumsq is None:  # the plain call, as before the row scale existed (callers and test spies see it)
        return skinny_qkv_rope_reference(x, weight, bias, cos, sin, num_q_heads, num_kv_heads)
    return skinny_qkv_rope_reference(x, weight, bias, cos, sin, num_q_heads, num_kv_heads, norm_sumsq, eps)


@skinny_qkv_rope.register_fake
def _(x, weight, bias, cos, sin, num_q_heads, num_kv_heads, norm_sumsq=None, eps=0.0):
    D = _check_inputs(x, weight, bias, cos, sin, num_q_heads, num_kv_heads, norm_sumsq, eps)
    return _empty_outputs(x, num_q_heads, num_kv_heads, D)


def _empty_outputs(x, num_q_heads, num_kv_heads, D):
    M = x.shape[0]
    return x.new_empty((M, num_q_heads * D)), x.new_empty((M, num_kv_heads * D)), x.new_empty((M, num_kv_heads * D))


def _check_inputs(
    x, weight, bias, cos, sin, num_q_heads: int, num_kv_heads: int, norm_sumsq=None, eps: float = 0.0
) -> int:  # fmt: skip
    """Returns D (the head dim) once every argument is checked."""
    check_dim("x", x, 2, "[M, K]")
    check_dim("weight", weight, 2, "[(Hq + 2 Hkv) D, K]")
    check_dim("cos", cos, 2, "[M, D]")
    check_dim("sin", sin, 2, "[M, D]")
    check_dtype("x", x, *_DTYPES)
    for name, t in (("weight", weight), ("cos", cos), ("sin", sin)):
        check_dtype(name, t, x.dtype)
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"x: 1..{MAX_ROWS} rows (one MMA row block), got M={M}")
    if K < 1:
        raise ValueError(f"x: K must be >= 1, got K={K}")
    if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads, num_kv_heads: positive, with Hq a multiple of Hkv; got {num_q_heads}, "
                         f"{num_kv_heads}")  # fmt: skip
    if tuple(cos.shape) != tuple(sin.shape) or cos.shape[0] != M:
        raise ValueError(f"cos, sin: expected [M={M}, D] each, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    D = cos.shape[1]
    if D < 2 or D % 2:
        raise ValueError(f"cos: the head dim D must be even and >= 2, got D={D}")
    heads = num_q_heads + 2 * num_kv_heads
    if tuple(weight.shape) != (heads * D, K):
        raise ValueError(f"weight: expected [(Hq + 2 Hkv) D = {heads * D}, K={K}], got {tuple(weight.shape)}")
    if bias is not None:
        check_dim("bias", bias, 1, "[(Hq + 2 Hkv) D]")
        check_dtype("bias", bias, x.dtype)
        if bias.shape[0] != heads * D:
            raise ValueError(f"bias: expected [(Hq + 2 Hkv) D = {heads * D}], got {tuple(bias.shape)}")
        check_same_device(x=x, bias=bias)
    if x.device.type == "cuda" and (D // 2) % MIN_HALF:
        raise ValueError(f"cos: on CUDA the half head dim D/2 must be a multiple of {MIN_HALF}, got D={D}")
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: the last dim must have stride 1, got strides {tuple(t.stride())}")
    if weight.stride(1) != 1 or weight.stride(0) != K:
        raise ValueError(f"weight: expected contiguous rows, got strides {tuple(weight.stride())}")
    check_same_device(x=x, weight=weight, cos=cos, sin=sin)
    check_row_scale(x, norm_sumsq, eps)
    return D


def rope_wanted() -> bool:
    """Whether ``passes/fuse_qkv_rope.py`` fuses every qualifying q/k/v projection and rotary embedding: yes
    unless ``TREECOMPILE_SKINNY_ROPE=0`` (the unfused chain, for A/B runs). Anything but 0 / 1 is refused by name."""
    return env_switch(ROPE_ENV, True)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def rope_config(M: int, N: int, K: int, D: int):
    """(block_m, block_n, block_k, num_warps, num_stages) for the [M, N, K] q/k/v GEMM of head dim D: the
    nearest swept M's MMA tiles of that shape in ``skinny_linear``'s tables (won against cuBLAS or not), else
    its default tiles; block_n halved (a program streams block_n rows of each head half: one slice's bytes),
    the largest power of two <= that dividing D/2, at least ``MIN_HALF``. ``TREECOMPILE_SKINNY_ROPE_TILES`` (A/B
    runs: ``rope_bench.py``'s sweep winner in a round) replaces the choice for every launch."""
    from .skinny_linear import choose_skinny_config, swept_mma_tiles

    forced = _env_tiles(D)
    if forced is not None:
        return (max(16, triton.next_power_of_2(M)), *forced)
    tiles = swept_mma_tiles(M, N, K)
    if tiles is None:
        cfg = choose_skinny_config(M, N, K)
        tiles = (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    block_n, block_k, warps, stages = tiles
    half = max(MIN_HALF, block_n // 2)
    while half > MIN_HALF and (D // 2) % half:
        half //= 2
    return max(16, triton.next_power_of_2(M)), half, block_k, warps, stages


def _env_tiles(D: int):
    """``TREECOMPILE_SKINNY_ROPE_TILES="half,block_k,warps,stages"`` checked (``_common.env_tiles``: half a power
    of two >= MIN_HALF dividing D/2), or None when unset."""
    return env_tiles(TILES_ENV, "half", lambda half: half >= MIN_HALF and (D // 2) % half == 0,
                     f">= {MIN_HALF}, dividing D/2 = {D // 2}")  # fmt: skip


def _launch_skinny_qkv_rope(
    x, weight, bias, cos, sin, q, k, v, config=None, norm_sumsq=None, eps: float = 0.0
) -> None:  # fmt: skip
    """Fill preallocated ``q, k, v`` (any row stride, last dim contiguous). ``config``: a ``rope_config`` tuple
    (tests and sweeps), else ``rope_config``'s choice. ``norm_sumsq``: the RMSNorm row scale (ROW_SCALE; without
    it the kernel is the plain one)."""
    M, K = x.shape
    D = cos.shape[1]
    Hq, Hkv = q.shape[1] // D, k.shape[1] // D
    block_m, block_n, block_k, warps, stages = config or rope_config(M, weight.shape[0], K, D)
    if block_m < M or (D // 2) % block_n:
        raise ValueError(f"config: block_m={block_m} must cover M={M} and block_n={block_n} divide D/2={D // 2}")
    pdl = pdl_enabled(x.device)
    per_head = D // 2 // block_n
    _skinny_qkv_rope_kernel[((Hq + 2 * Hkv) * per_head,)](
        x, weight, weight if bias is None else bias, cos, sin, q, k, v,
        M, K, Hq, Hkv, x.stride(0), weight.stride(0), 0 if bias is None else bias.stride(0), cos.stride(0),
        sin.stride(0), q.stride(0), k.stride(0), v.stride(0), **row_scale_args(x, norm_sumsq, eps),
        HAS_BIAS=bias is not None, D=D, PER_HEAD=per_head,
        EVEN_K=K % block_k == 0, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **(dict(launch_pdl=True) if pdl else {}),
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _skinny_qkv_rope_kernel(
        x, w, b, cos, sin, q, k, v, M, K, Hq, Hkv, s_xm, s_wn, s_b, s_cm, s_sm, s_qm, s_km, s_vm, ss, eps, S,
        ROW_SCALE: tl.constexpr, S_P2: tl.constexpr, HAS_BIAS: tl.constexpr, D: tl.constexpr,
        PER_HEAD: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program p: head h = p // PER_HEAD (q heads, then k, then v), features [c, c + BLOCK_N) of both its
        halves, c = (p % PER_HEAD) * BLOCK_N: weight rows h D + c (lo) and h D + D/2 + c (hi), accumulated over K
        in two float32 tiles from one x tile a step. Epilogue: (ROW_SCALE) both scaled by the row's norm rsqrt
        from ``ss`` (``row_rsqrt``), the bias added unscaled (HAS_BIAS), both rounded to x's dtype; q and k heads
        rotate (lo' = lo cos - hi sin, hi' = hi cos + lo sin in float32), v heads do not; stored to their output.
        Rows past M read row 0 (in bounds) and are dropped at the store."""
        pid = tl.program_id(0)
        h = pid // PER_HEAD
        c = (pid % PER_HEAD) * BLOCK_N
        HALF: tl.constexpr = D // 2
        rn = tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        rows = tl.where(m_ok, rm, 0).to(tl.int64)
        if USE_PDL:  # wait for the previous kernel (x is its output), then let the next one launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        lo_rows = (h * D + c + rn).to(tl.int64)
        acc_lo, acc_hi = paired_rows_dot(
            x, w, rows, lo_rows, lo_rows + HALF, K, s_xm, s_wn, EVEN_K, PREC, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if ROW_SCALE:  # first: r * (W @ (norm_weight * s)), the bias below unscaled
            r = row_rsqrt(ss, eps, S, M, K, rm, S_P2, BLOCK_M)[:, None]
            acc_lo *= r
            acc_hi *= r
        if HAS_BIAS:
            acc_lo += tl.load(b + lo_rows * s_b).to(tl.float32)[None, :]
            acc_hi += tl.load(b + (lo_rows + HALF) * s_b).to(tl.float32)[None, :]
        lo = acc_lo.to(q.dtype.element_ty).to(tl.float32)  # the fused linear's rounding
        hi = acc_hi.to(q.dtype.element_ty).to(tl.float32)
        col = c + rn
        st_mask = m_ok[:, None]
        if h < Hq + Hkv:  # q or k: rotate with row i's table
            cl = tl.load(cos + rows[:, None] * s_cm + col[None, :]).to(tl.float32)
            ch = tl.load(cos + rows[:, None] * s_cm + (col + HALF)[None, :]).to(tl.float32)
            sl = tl.load(sin + rows[:, None] * s_sm + col[None, :]).to(tl.float32)
            sh = tl.load(sin + rows[:, None] * s_sm + (col + HALF)[None, :]).to(tl.float32)
            out_lo = lo * cl - hi * sl
            out_hi = hi * ch + lo * sh
            if h < Hq:
                base = q + rm.to(tl.int64)[:, None] * s_qm + (h * D + col)[None, :]
            else:
                base = k + rm.to(tl.int64)[:, None] * s_km + ((h - Hq) * D + col)[None, :]
            tl.store(base, out_lo.to(q.dtype.element_ty), mask=st_mask)
            tl.store(base + HALF, out_hi.to(q.dtype.element_ty), mask=st_mask)
        else:
            base = v + rm.to(tl.int64)[:, None] * s_vm + ((h - Hq - Hkv) * D + col)[None, :]
            tl.store(base, lo.to(q.dtype.element_ty), mask=st_mask)
            tl.store(base + HALF, hi.to(q.dtype.element_ty), mask=st_mask)


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def rotate_half_reference(a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``a * cos + rotate_half(a) * sin`` for ``a [M, H, D]``, ``cos``/``sin`` ``[M, D]``."""
    half = a.shape[-1] // 2
    rotated = torch.cat((-a[..., half:], a[..., :half]), dim=-1)
    return a * cos[:, None, :] + rotated * sin[:, None, :]


def skinny_qkv_rope_reference(
    x, weight, bias, cos, sin, num_q_heads: int, num_kv_heads: int, norm_sumsq=None, eps: float = 0.0
):  # fmt: skip
    """The CPU path and the test oracle: the unfused graph's ops and roundings (F.linear in x's dtype, then the
    rotation in float32 for 16-bit x, rounded back). With ``norm_sumsq`` the GEMM's sums are float32 (float64 for
    float64 x), scaled by the row's float32 ``rsqrt(norm_sumsq.sum(0) / K + eps)``, plus the unscaled bias, then
    rounded to x's dtype."""
    M, D = x.shape[0], cos.shape[1]
    if norm_sumsq is None:
        qkv = F.linear(x, weight, bias)
    else:
        qkv = scaled_linear_reference(x, weight, bias, norm_sumsq, eps)
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    q, k, v = qkv.split([num_q_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    c, s = cos.to(wide), sin.to(wide)
    q = rotate_half_reference(q.to(wide).view(M, num_q_heads, D), c, s).to(x.dtype).reshape(M, -1)
    k = rotate_half_reference(k.to(wide).view(M, num_kv_heads, D), c, s).to(x.dtype).reshape(M, -1)
    return q, k, v.contiguous()
