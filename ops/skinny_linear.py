"""``F.linear`` for few rows: a Triton GEMM tiled for M <= 256 (decode, draft lanes, verify trees, and the
verify of a small batch of trees).

Why it exists: on the H200 cuBLAS runs the small-row GEMMs of a round as ``nvjet`` kernels that cost a fixed
~3.3-4.2 us each whatever the bytes (notes/gpu-2026-12-01-s9, SmolLM2 shapes: [1, 576] x [576, 960] 3.9 us,
[64, 576] x [576, 960] 4.2 us; 120 of them a forward, ~40% of a 1-row decode). And at 8B the qkv and o
projections of a 1-row decode stream their weights at 3.1-3.2 TB/s where the gate/up GEMM reaches 4.1
(notes/gpu-2026-11-30f/prof/decode.txt). A tile of 16-64 rows x a narrow slice of the output features, one
program per slice, the reduction dim streamed in BLOCK_K chunks, has a short prologue and puts many
programs in flight. Whether it wins, and with which tiles, is measured by ``tests/gpu/skinny_sweep.py`` on
cold weights (each call reads a different copy, as a forward does).

Past 64 rows (a batch of trees: 4 requests x 24 nodes is 96 verify rows) the MMA tiles repeat over row blocks
(``block_m`` 64 unless a measured entry says otherwise; each row block rereads its weight slice, from L2). Those
shapes run the kernel only where ``tests/gpu/skinny_sweep.py out.json rows`` measured it faster than cuBLAS,
like every other shape: until then they stay on cuBLAS.

Two kernels: the MMA tiles above (16-256 rows), and for <= 16 rows a multiply-add "gemv" kernel (no 16-row
MMA padding; 4-8 wide output slices, so a 576-wide layer still has 144 programs), optionally launched as a
programmatic dependent launch: its programs become resident while the previous kernel drains (SmolLM2's
1-row o projection: 3.35 us cuBLAS, 2.24 us gemv, 1.99 us gemv_pdl).

Either kernel can also split the reduction dim K over ``split_k`` programs a slice (split-K): a shape with few
output slices (the 8B qkv at 64 rows: 192 slices for 132 SMs, 1.45 waves) then fills every SM with weight
streams. Each split writes a float32 partial ``[M, BLOCK_N]`` to a workspace; the split that arrives last at its
slice (an atomic counter a slice, in a per-device table that every launch leaves zeroed) sums the partials in
split order, so the result does not depend on arrival order (deterministic), adds the bias (and the residual) and
stores. (The semaphore-ordered reduction of split-K / stream-K GEMMs: CUTLASS's ``Semaphore`` and the stream-K
paper, Osama et al. 2023; written here for Triton.)

``skinny_linear_norm_out`` (the residual epilogue, plus the next RMSNorm's inputs): a decoder layer's RMSNorm
after ``h = residual + o_proj(x)`` moves into this GEMM's epilogue and the next GEMM's end, not the next GEMM's K
loop. This op also stores ``u = round(norm_weight * s)`` (s: the rounded sum, as stored) and, for each BLOCK_N-wide
output slice, the rows' partial sums of ``s^2``; the next GEMM streams ``u`` straight into its MMA and scales its
sums by the row's ``rsqrt(sum of the partials / N + eps)`` at the end. Why not a norm prologue in the next GEMM's
K loop: one that feeds the MMA from registers made wgmma synchronous (17 ``wgmma.wait_group`` in the loop instead
of 2; an 8B verify 6.3 -> 9.6 ms on an H100). Only the MMA kernel has it (``norm_out_supported``), split-K or not:
under split-K the split that reduces a slice writes its norm inputs. (No shipped entry splits the verify's o or
down: on a slower H100, fifty-fifth session, slices 64-256 wide split 2-8 ways ran 16.4-18.5 us for the 64-row o
against the shipped 32-wide whole-K slices' 14.7, and 46.5-48.5 for down against 45.2; a round with them
installed: verify(64) 6.611 against 6.433-6.449 ms. ``skinny_sweep.py wide``, notes/gpu-2026-12-07-s55.)

``l2_prefetch`` (a measured-table entry, or ``TREECOMPILE_SKINNY_L2_PREFETCH`` for a whole run): each program
first hints the 128-byte lines of its first weight tiles into L2 (``_common.prefetch_l2``), before its dependency
wait, so under dependent launches the weight streams in while the previous kernel ends. Off by default (no
entry has it) until timed on the GPU.

Shapes
------
x      [M, K]  float16 / bfloat16 / float32; 1 <= M <= MAX_ROWS (256); last dim contiguous, any row stride
weight [N, K]  x's dtype, contiguous (an ``nn.Linear`` weight, or a view of rows of one)
bias   [N] or None, any stride
residual [M, N] or None  x's dtype, last dim contiguous, any row stride: added in the GEMM's epilogue (a decoder
       layer's ``h = residual + o_proj(x)`` in one launch). Rounded as the unfused graph rounds: the GEMM (+ bias)
       to x's dtype first (what ``F.linear`` returns), then that plus the residual in float32, rounded again
       (PyTorch's 16-bit add), i.e. ``round(round(x @ weight.T + bias) + residual)``; for float32 one rounding.
out    [M, N]  x's dtype; accumulated in float32 (float32 inputs: IEEE products, no TF32)
norm_weight [N]  (``skinny_linear_norm_out``) x's dtype, any stride: the next RMSNorm's weight
s      [M, N]  (``skinny_linear_norm_out``) x's dtype: ``skinny_linear(x, weight, bias, constant_weight, residual)``
u      [M, N]  (``skinny_linear_norm_out``) x's dtype: ``round(norm_weight.float() * s.float())``
sumsq  [S, M]  (``skinny_linear_norm_out``) float32, S = ``norm_out_slices(M, N, K)`` = cdiv(N, the launch's
       block_n): sumsq[j, m] = sum of s[m, n].float() ** 2 over the slice's columns [j * block_n, (j + 1) * block_n)
constant_weight  bool: the weight is a parameter or constant, never written by the kernel just before
       this one. Only then may a programmatic dependent launch (a ``gemv_pdl`` tile entry) read its first
       weight tile before waiting for that kernel; otherwise it waits first. Default False (always safe).

Tiles come from a table measured on the H200 (``_MEASURED``) with a GPU's own entries laid over it where that
GPU was swept (``_MEASURED_BY_GPU``, chosen by ``gpu_class``: so far the H100 SXM), and rows a user registers.

Results equal ``F.linear`` up to summation order (a different kernel: not bitwise equal to cuBLAS).
Only metadata is checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._common import (
    HAS_TRITON, check_dim, check_dtype, check_l2_prefetch, check_same_device, counter_table, env_switch, pdl_enabled,
    prefetch_l2, tma_weights_ok, use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "skinny_linear", "skinny_linear_reference", "linear_rows", "SkinnyConfig", "choose_skinny_config",
    "measured_tiles", "swept_mma_tiles", "register_tiles", "gemv_config", "gpu_class", "MAX_ROWS", "GEMV_MAX_ROWS",
    "skinny_linear_norm_out", "skinny_linear_norm_out_reference", "norm_out_slices", "norm_out_supported",
]

MAX_ROWS = 256
ROW_BLOCK = 64  # rows a default MMA tile takes past 64 rows (more rows: more row blocks)
GEMV_MAX_ROWS = 16  # the multiply-add (gemv) kernel's rows: its accumulator is [BLOCK_M, BLOCK_N, BLOCK_K]
# (16 rows: a (4, 4, 16) tree's verify; whether the gemv beats the 16-row MMA tile there is for the sweep's "mid"
# mode to say: the shipped table has no gemv entry past 8 rows)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::skinny_linear", mutates_args=())
def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, constant_weight: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` for ``x [M <= 256, K]``, plus ``residual [M, N]`` when given: the sum of
    ``F.linear``'s result (rounded to x's dtype) and the residual, rounded again, as ``F.linear(...) + residual``
    in x's dtype rounds (see the module docstring)."""
    _check_inputs(x, weight, bias, residual)
    if use_triton(x, weight, *(t for t in (bias, residual) if t is not None)):
        out = x.new_empty((x.shape[0], weight.shape[0]))
        _launch_skinny_linear(x, weight, bias, out, constant_weight=constant_weight, residual=residual)
        return out
    return skinny_linear_reference(x, weight, bias, residual)


@skinny_linear.register_fake
def _(x, weight, bias=None, constant_weight=False, residual=None):
    _check_inputs(x, weight, bias, residual)
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("treespec::skinny_linear_norm_out", mutates_args=())
def skinny_linear_norm_out(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, constant_weight: bool, residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(s, u, sumsq)``: ``s = skinny_linear(x, weight, bias, constant_weight, residual)`` (same bits), ``u =
    round(norm_weight * s)`` (float32 product of the rounded s, rounded to x's dtype) and ``sumsq [S, M]``
    float32, the sum of ``s.float() ** 2`` over each of the launch's BLOCK_N-wide output slices (S =
    ``norm_out_slices(M, N, K)``; the last slice may be partial): the next GEMM streams ``u`` into its MMA
    and scales its sums by ``rsqrt(sumsq.sum(0) / N + eps)`` (see the module docstring). Only where
    ``norm_out_supported(M, N, K)`` (the MMA kernel, not gemv); otherwise ValueError. Metadata checks
    only: safe under CUDA-graph capture."""
    cfg = _check_norm_out_inputs(x, weight, bias, residual, norm_weight)
    if use_triton(x, weight, residual, norm_weight, *(() if bias is None else (bias,))):
        M, N = x.shape[0], weight.shape[0]
        s, u = x.new_empty((M, N)), x.new_empty((M, N))
        sumsq = torch.empty(((N + cfg.block_n - 1) // cfg.block_n, M), dtype=torch.float32, device=x.device)
        _launch_skinny_linear(x, weight, bias, s, cfg, constant_weight, residual=residual,
                              norm=(u, sumsq, norm_weight))  # fmt: skip
        return s, u, sumsq
    return skinny_linear_norm_out_reference(x, weight, bias, residual, norm_weight, block_n=cfg.block_n)


@skinny_linear_norm_out.register_fake
def _(x, weight, bias, constant_weight, residual, norm_weight):
    cfg = _check_norm_out_inputs(x, weight, bias, residual, norm_weight)
    M, N = x.shape[0], weight.shape[0]
    sumsq = x.new_empty(((N + cfg.block_n - 1) // cfg.block_n, M), dtype=torch.float32)
    return x.new_empty((M, N)), x.new_empty((M, N)), sumsq


def _check_norm_out_inputs(x, weight, bias, residual, norm_weight) -> SkinnyConfig:
    """skinny_linear's checks, plus residual and norm_weight required; the launch config (its refusal raised)."""
    if residual is None:
        raise ValueError("residual: required by skinny_linear_norm_out ([M, N], x's dtype)")
    if norm_weight is None:
        raise ValueError("norm_weight: required by skinny_linear_norm_out ([N], x's dtype)")
    _check_inputs(x, weight, bias, residual)
    N = weight.shape[0]
    check_dim("norm_weight", norm_weight, 1, f"[N={N}]")
    check_dtype("norm_weight", norm_weight, x.dtype)
    if norm_weight.shape[0] != N:
        raise ValueError(f"norm_weight: expected [N={N}] (weight's N), got {tuple(norm_weight.shape)}")
    check_same_device(x=x, norm_weight=norm_weight)
    M, K = x.shape
    cfg = _default_config(M, N, K)
    refusal = _norm_out_refusal(cfg)
    if refusal is not None:
        raise ValueError(f"skinny_linear_norm_out: not supported for (M={M}, N={N}, K={K}): {refusal}")
    return cfg


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
) -> None:
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
    if residual is not None:
        N = weight.shape[0]
        check_dim("residual", residual, 2, f"[M={M}, N={N}]")
        check_dtype("residual", residual, x.dtype)
        if tuple(residual.shape) != (M, N):
            raise ValueError(f"residual: expected [M={M}, N={N}] (x's M, weight's N), got {tuple(residual.shape)}")
        if N > 1 and residual.stride(1) != 1:
            raise ValueError(f"residual: the last dim must have stride 1, got strides {tuple(residual.stride())}")
        devices["residual"] = residual
    check_same_device(**devices)


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, constant_weight: bool = False
) -> torch.Tensor:
    """``F.linear(x [..., K], weight, bias)``, through ``skinny_linear`` where it applies and pays: 16-bit
    CUDA inputs of at most ``MAX_ROWS`` rows (the product of the leading dims), a weight with a contiguous
    last dim, and a shape the sweep measured faster than cuBLAS (``measured_tiles``). Everything else (CPU,
    float32, more rows, unmeasured or cuBLAS-won shapes) runs ``F.linear``. Static metadata only.
    ``constant_weight``: see the module docstring (True for a module's own weights)."""
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if (
        x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype and weight.dim() == 2
        and 1 <= M <= MAX_ROWS and (K == 1 or (weight.stride(1) == 1 and x.stride(-1) == 1))
        and (bias is None or bias.dtype == x.dtype) and measured_tiles(M, weight.shape[0], K) is not None
    ):  # fmt: skip
        out = torch.ops.treespec.skinny_linear(x.reshape(M, K), weight, bias, constant_weight)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of one launch: BLOCK_M rows, BLOCK_N output features a program, BLOCK_K of the reduction dim a
    step. ``gemv=False``: the MMA kernel (BLOCK_M >= 16, the MMA's least). ``gemv=True``: the multiply-add
    kernel for M <= GEMV_MAX_ROWS (BLOCK_M = M rounded up to a power of two, any BLOCK_N >= 1: no 16-row
    MMA padding, and narrow slices put many programs in flight). ``pdl``: launch the gemv kernel as a
    programmatic dependent launch (sm90+): its programs start while the previous kernel drains; they load
    their first weight tile before waiting for it only for a ``constant_weight`` call. Where
    ``_common.pdl_enabled`` holds (Hopper, unless ``TREECOMPILE_PDL=0``) every launch is a dependent one."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False
    pdl: bool = False
    split_k: int = 1  # programs a slice along K (split-K); > 1 reduces through a workspace + counter table
    l2_prefetch: int = 0  # BLOCK_K tiles of a program's weight slice hinted into L2 before anything waits
    pipeline: bool = False  # gemv only: the K loop software-pipelined by the compiler (see _skinny_gemv_kernel)
    tma: bool = False  # MMA tiles only: weight tiles as TMA boxes where the device and layout allow (else pointers)


# Measured on the H200 by tests/gpu/skinny_sweep.py (bf16, cold weights: each call reads another copy, as a
# forward does). M = 64: notes/gpu-2026-12-01-s10/skinny_sweep.json; M <= 8, the MMA tiles against the gemv
# kernel, plain and as a dependent launch: notes/gpu-2026-12-01-s11/gemv_sweep.json. (M, N, K): the best
# tiles (block_n, block_k, num_warps, num_stages), their time and cuBLAS's in us, and the kernel when not
# the MMA one ("gemv"; "gemv_pdl": gemv as a programmatic dependent launch). Where cuBLAS was as fast, the
# shape stays on it. Triton wins SmolLM2's 1-row projections by 17-48% (gemv_pdl: cuBLAS's small GEMMs cost
# a fixed ~3.3-5 us), its 8-row ones by 4-8% (MMA tiles), the 8B o projection at 1 row by 14% (gemv_pdl)
# and the 64-row GEMMs over big weights (8B gate/up, down, LM head) by 5-7%. cuBLAS keeps the 8B qkv,
# gate/up and down at 1-4 rows (the gemv kernel streams them at 3.1-3.7 TB/s against cuBLAS's 3.2-4.1),
# the heads' vocabulary projections, and the 4-row GEMMs. Past index 6 (the kind), an entry may carry: 7 split_k,
# 8 l2_prefetch, 9 the row block, 10 the gemv's compiler-pipelined loop, 11 the MMA tiles' TMA weight boxes.
# Forty-second session, same H200 class (copy 4.27 TB/s): the 8B's 1-row entries, target and head, are the
# pipelined gemv (index 10) of ``skinny_sweep.py pipe 1,4 8b`` (notes/gpu-2026-12-05-s42/pipe_sweep.json), 5-23%
# under cuBLAS; 8B rounds on that machine: decode 4.575 -> 4.271 ms. The 8B o at 64 rows moved to Triton from a
# 2.5% sweep win (streamk_sweep.json) and its round: verify(64) 5.215-5.232 -> 5.164 ms, more than the GEMM's
# 0.3 us a layer, as a cuBLAS call also breaks the chain of dependent launches. Its 4-row rows stay as they were
# (the new sweep kept them on cuBLAS but for the head's fc, by a 2.3% margin within its noise).
_MEASURED: dict[tuple[int, int, int], tuple] = {
    (1, 960, 576): (4, 1024, 4, 2, 2.07, 3.98, "gemv_pdl"),  # SmolLM2 qkv
    (1, 576, 576): (4, 1024, 4, 2, 1.99, 3.35, "gemv_pdl"),  # SmolLM2 o
    (1, 3072, 576): (4, 512, 4, 3, 3.37, 4.08, "gemv_pdl"),  # SmolLM2 gate/up
    (1, 576, 1536): (4, 1024, 8, 2, 3.17, 5.10, "gemv_pdl"),  # SmolLM2 down
    (8, 960, 576): (32, 128, 4, 4, 3.48, 3.67),
    (8, 576, 576): (16, 128, 4, 4, 3.14, 3.36),
    (8, 3072, 576): (32, 128, 4, 4, 3.95, 4.11),
    (8, 576, 1536): (32, 256, 4, 4, 4.58, 4.98),
    (64, 960, 576): (16, 128, 4, 4, 3.58, 3.77),
    (64, 576, 576): (16, 128, 4, 4, 3.31, 3.72),
    (64, 3072, 576): (32, 128, 4, 4, 4.28, 4.38),
    (64, 576, 1536): (16, 256, 4, 4, 4.85, 5.15),
    (1, 49152, 576): (128, 128, 4, 3, 18.04, 16.80),  # SmolLM2 LM head
    (64, 49152, 576): (128, 64, 4, 3, 18.73, 19.18),
    (1, 576, 1728): (4, 1024, 8, 2, 3.24, 5.23, "gemv_pdl"),  # SmolLM2 draft head: fc
    (8, 576, 1728): (4, 512, 4, 2, 6.35, 5.24, "gemv_pdl"),
    (1, 8192, 576): (8, 256, 4, 3, 5.96, 5.02, "gemv_pdl"),  # SmolLM2 draft head: LM head (8k draft vocabulary)
    (8, 8192, 576): (16, 128, 4, 3, 8.40, 5.14),
    (1, 6144, 4096): (16, 256, 4, 4, 14.39, 16.70, "gemv_pdl", 1, 0, 0, True),  # Llama-8B qkv
    (1, 4096, 4096): (8, 512, 4, 4, 10.38, 13.46, "gemv_pdl", 1, 0, 0, True),  # Llama-8B o
    (1, 28672, 4096): (4, 512, 4, 6, 56.61, 60.74, "gemv_pdl", 1, 0, 0, True),  # Llama-8B gate/up
    (1, 4096, 14336): (8, 512, 4, 3, 29.97, 33.04, "gemv_pdl", 1, 0, 0, True),  # Llama-8B down
    (4, 6144, 4096): (4, 512, 4, 3, 27.89, 16.29, "gemv_pdl"),
    (4, 4096, 4096): (64, 256, 4, 4, 13.12, 13.31),
    (4, 28672, 4096): (64, 128, 4, 3, 65.57, 57.23),
    (4, 4096, 14336): (4, 256, 4, 3, 57.45, 32.55, "gemv_pdl"),
    (64, 6144, 4096): (32, 128, 4, 4, 17.70, 16.76),
    (64, 4096, 4096): (32, 256, 4, 4, 11.98, 12.29),  # o: see above the table
    (64, 28672, 4096): (128, 64, 4, 4, 60.22, 64.28),
    (64, 4096, 14336): (32, 256, 4, 4, 34.43, 36.22),
    (1, 128256, 4096): (128, 256, 4, 4, 238.39, 247.44),  # Llama-8B LM head
    (64, 128256, 4096): (128, 128, 4, 4, 254.53, 272.44),
    (1, 4096, 12288): (16, 512, 4, 3, 25.72, 30.23, "gemv_pdl", 1, 0, 0, True),  # 8B EAGLE-3 head: fc
    (4, 4096, 12288): (4, 512, 8, 3, 52.06, 30.91, "gemv_pdl"),
    (1, 32000, 4096): (8, 512, 4, 6, 63.29, 66.15, "gemv_pdl", 1, 0, 0, True),  # 8B EAGLE-3 head: LM head (32k draft vocabulary)
    (4, 32000, 4096): (128, 256, 4, 3, 66.56, 67.59),
    # 65-256 rows (a batch of trees' verify: B x N rows), tuple index 9 = the row block:
    # notes/gpu-2026-12-03-s26/rows_sweep.json. Triton wins SmolLM2's qkv, o and down by 6-24% and gate/up at
    # 128 rows; cuBLAS keeps gate/up at 96 and 256 rows and the LM head. In loop_profile at batch 4 (random
    # weights) these entries took the (4, 5, 24) round from 1.433 to 1.266 ms and (4, 6, 32) from 1.590 to
    # 1.380 (notes/gpu-2026-12-03-s26.md): more than the isolated GEMMs' ~3 us a layer, as cuBLAS also
    # breaks the chain of dependent launches.
    (96, 960, 576): (32, 128, 4, 4, 3.29, 3.86, "dot", 1, 0, 32),  # SmolLM2 qkv
    (128, 960, 576): (16, 128, 4, 4, 2.96, 3.85, "dot", 1, 0, 64),
    (256, 960, 576): (32, 128, 4, 4, 3.15, 3.95, "dot", 1, 0, 64),
    (96, 576, 576): (16, 128, 4, 4, 2.94, 3.67, "dot", 1, 0, 32),  # SmolLM2 o
    (128, 576, 576): (16, 128, 4, 4, 2.86, 3.77, "dot", 1, 0, 64),
    (256, 576, 576): (32, 128, 4, 4, 3.02, 3.81, "dot", 1, 0, 64),
    (96, 3072, 576): (32, 64, 4, 4, 5.03, 4.49, "dot", 1, 0, 32),  # SmolLM2 gate/up (cuBLAS keeps 96, 256)
    (128, 3072, 576): (64, 128, 4, 4, 4.10, 4.56, "dot", 1, 0, 64),
    (256, 3072, 576): (64, 64, 4, 4, 4.99, 4.75, "dot", 1, 0, 64),
    (96, 576, 1536): (16, 128, 4, 4, 4.80, 5.12, "dot", 1, 0, 32),  # SmolLM2 down
    (128, 576, 1536): (16, 128, 4, 4, 4.59, 5.23, "dot", 1, 0, 64),
    (256, 576, 1536): (32, 128, 4, 4, 4.83, 5.29, "dot", 1, 0, 64),
    (96, 49152, 576): (128, 64, 4, 3, 40.77, 21.28, "dot", 1, 0, 64),  # SmolLM2 LM head (cuBLAS keeps it)
    (128, 49152, 576): (64, 64, 4, 3, 22.44, 21.47, "dot", 1, 0, 128),
    (256, 49152, 576): (64, 64, 4, 3, 42.74, 28.30, "dot", 1, 0, 128),
}
# Entries of one GPU class laid over the table above on that GPU (``gpu_class``); a (M, N, K) key here replaces
# the H200's. H100: the pipelined gemv (tuple index 10) measured by ``skinny_sweep.py pipe 1,4 8b`` on an H100
# (copy 2.43 TB/s): notes/gpu-2026-12-05-s39/pipe_sweep.json. At one row it beats cuBLAS on every 8B weight by
# 7-21%; at four rows the heads' LM projection (-7%), o (-4%), down and fc (-2%) clear the 2% margin, while
# gate/up and qkv stay on cuBLAS. 8B rounds on that H100 (bench rounds, same machine): decode 6.083 -> 5.619 ms,
# draft round 1.654 -> 1.630, verify(64) unchanged (6.734 -> 6.709). An earlier 64-row sweep there (splitk64.json)
# sent gate/up back to cuBLAS and the verify got slower (6.808 ms; a cuBLAS GEMM also breaks the chain of
# dependent launches). The 64-row entries come from the fortieth session's ``skinny_sweep.py tma 64 8b`` on an
# H100 SXM (notes/gpu-2026-12-05-s40/tma_sweep.json): gate/up on 128 x 128 tiles, 3 stages, 84.2 us against
# cuBLAS 87.4 and the H200's 128 x 64 tiles 89.3; qkv, o and the head's fc stay on cuBLAS; TMA weight boxes tied
# pointer loads everywhere (none is used). Same machine, 8B rounds: verify(64) 6.803-6.816 -> 6.671 ms. The 64-row
# o moved to Triton in the forty-ninth session, on the 256-wide K steps that session's sweep was the first to try
# on an H100 (``skinny_sweep.py tma 64 "8b o"``, notes/gpu-2026-12-06-s49/call2/o64.json: 14.76 us against
# cuBLAS 15.49 and 15.71 on 128-wide steps); same machine, two A/B pairs of 8B rounds: verify(64) 6.497 / 6.511
# -> 6.469 / 6.469 ms, decode and draft unchanged.
_MEASURED_BY_GPU: dict[str, dict[tuple[int, int, int], tuple]] = {
    "H100 SXM": {
        (1, 6144, 4096): (4, 1024, 8, 6, 19.14, 21.26, "gemv_pdl", 1, 0, 0, True),  # Llama-8B qkv
        (1, 4096, 4096): (8, 512, 4, 3, 13.30, 16.82, "gemv_pdl", 1, 0, 0, True),  # Llama-8B o
        (1, 28672, 4096): (4, 1024, 8, 6, 77.25, 82.80, "gemv_pdl", 1, 0, 0, True),  # Llama-8B gate/up
        (1, 4096, 14336): (8, 512, 4, 3, 41.63, 45.03, "gemv_pdl", 1, 0, 0, True),  # Llama-8B down
        (1, 4096, 12288): (8, 512, 4, 3, 36.11, 39.85, "gemv_pdl", 1, 0, 0, True),  # 8B EAGLE-3 head: fc
        (1, 32000, 4096): (4, 1024, 8, 6, 85.60, 97.38, "gemv_pdl", 1, 0, 0, True),  # 8B EAGLE-3 head: LM head
        (4, 6144, 4096): (8, 512, 4, 3, 21.89, 21.44, "gemv_pdl", 1, 0, 0, True),
        (4, 4096, 4096): (4, 512, 4, 4, 15.98, 16.56, "gemv_pdl", 1, 0, 0, True),
        (4, 28672, 4096): (4, 512, 4, 6, 81.85, 82.94, "gemv_pdl", 1, 0, 0, True),
        (4, 4096, 14336): (8, 256, 4, 4, 44.51, 45.56, "gemv_pdl", 1, 0, 0, True),
        (4, 4096, 12288): (8, 256, 4, 4, 39.03, 39.92, "gemv_pdl", 1, 0, 0, True),
        (4, 32000, 4096): (4, 512, 4, 6, 90.88, 98.21, "gemv_pdl", 1, 0, 0, True),
        (64, 6144, 4096): (64, 128, 4, 4, 20.90, 20.97),  # Llama-8B qkv (cuBLAS: within 2%)
        (64, 4096, 4096): (32, 256, 4, 4, 14.76, 15.49),  # Llama-8B o: see above the table
        (64, 28672, 4096): (128, 128, 4, 3, 84.16, 87.42),  # Llama-8B gate/up
        (64, 4096, 14336): (32, 256, 4, 4, 45.12, 47.67),  # Llama-8B down
        (64, 128256, 4096): (128, 128, 4, 3, 359.09, 390.93),  # Llama-8B LM head
        (64, 4096, 12288): (32, 128, 4, 4, 43.15, 42.44),  # 8B EAGLE-3 head: fc (cuBLAS)
        (64, 32000, 4096): (128, 128, 4, 3, 92.82, 101.72),  # 8B EAGLE-3 head: LM head
    },
}
# Rows added at run time by ``register_tiles``: over both tables above, whatever the GPU.
_REGISTERED: dict[tuple[int, int, int], tuple] = {}
MAX_SPLIT_K = 16
MAX_SLICES = 1 << 16  # output slices x row blocks one split-K launch may count in the counter table
WIN_MARGIN = 0.98  # Triton must be >= 2% faster than cuBLAS (run-to-run noise of the sweep is ~1%)
# A gemv entry measured at m rows that stands in for more (the nearest swept M, ``measured_tiles``) keeps its
# accumulator's size by a shorter K step. Why: an 8B draft round's step 0 runs 6 rows on the H100's 4-row gemv
# entries in 8-row blocks, twice the accumulator (128 float32 registers a thread at [8, 8, 256] on 4 warps): fc 56
# us against 39 measured at 4 rows, o 26 against 16, down 56 against 45 (forty-fifth session's trace,
# notes/gpu-2026-12-06-s45.md). With the shorter step the H100's draft round went 1.627 -> 1.613 ms (median of
# three A/B pairs, forty-sixth session, notes/gpu-2026-12-06-s46.md); verify and decode unchanged. It changes
# only the H100 table's 8B head shapes at 5-8 rows (fc, o, down, LM head): on the H200 table the few-row gemv
# entries that could stand in lost to cuBLAS (tests/ops/test_skinny_linear.py checks both).
# TREECOMPILE_GEMV_KEEP_FOOTPRINT=0 turns it off for A/B runs. It is read at import, because Dynamo traces
# measured_tiles from the drafter's compiled round; a value other than 0 or 1 fails the import by name.
GEMV_KEEP_FOOTPRINT = env_switch("TREECOMPILE_GEMV_KEEP_FOOTPRINT", True)
KINDS = ("dot", "gemv", "gemv_pdl")


def _band(M: int) -> int:
    """Row counts that share tiles: 1 (decode), 2-16 (draft lanes, tiny trees: one 16-row tile), 17-64 (one
    tree's verify), 65-256 (a batch of trees' verify: several row blocks)."""
    return 0 if M == 1 else 1 if M <= 16 else 2 if M <= 64 else 3


def register_tiles(rows) -> int:
    """Add sweep results (the dicts ``tests/gpu/skinny_sweep.py`` writes: ``M, N, K, cublas_us`` and ``best``
    with ``block_n, block_k, warps, stages, us``) to the measured table; later rows replace earlier ones of
    the same (M, N, K). Returns how many were added. For a model or GPU the built-in table does not cover."""
    added = 0
    for r in rows:
        best = r.get("best")
        if not best:
            continue
        kind = best.get("kind", "dot")
        if kind not in KINDS:
            raise ValueError(f"rows: best.kind must be one of {KINDS}, got {kind!r} for {r['M'], r['N'], r['K']}")
        if kind != "dot" and int(r["M"]) > GEMV_MAX_ROWS:
            raise ValueError(f"rows: a {kind} entry needs M <= {GEMV_MAX_ROWS}, got M={r['M']}")
        split_k = int(best.get("split_k", 1))
        if not 1 <= split_k <= MAX_SPLIT_K:
            raise ValueError(f"rows: best.split_k must be in 1..{MAX_SPLIT_K}, got {split_k} for {r['M'], r['N'], r['K']}")
        l2_prefetch = int(best.get("l2_prefetch", 0))
        check_l2_prefetch(f"rows: best of {r['M'], r['N'], r['K']}", l2_prefetch)
        # Past 64 rows the sweep also picks the row block; below, the tile holds every row (block_m from M).
        block_m = int(best.get("block_m", 0)) if int(r["M"]) > 64 and kind == "dot" else 0
        if block_m and (block_m < 16 or block_m & (block_m - 1)):
            raise ValueError(f"rows: best.block_m must be a power of two >= 16, got {block_m} for {r['M'], r['N'], r['K']}")
        pipeline = bool(best.get("pipeline", False))
        if pipeline and kind == "dot":
            raise ValueError(f"rows: best.pipeline is for the gemv kernels, got kind 'dot' for {r['M'], r['N'], r['K']}")
        tma = bool(best.get("tma", False))
        if tma and kind != "dot":
            raise ValueError(f"rows: best.tma is for the MMA tiles (kind 'dot'), got {kind!r} for {r['M'], r['N'], r['K']}")
        if tma and max(int(best["block_n"]), int(best["block_k"])) > 256:
            raise ValueError(f"rows: a best.tma tile spans at most 256 elements a dim, got block_n={best['block_n']}, "
                             f"block_k={best['block_k']} for {r['M'], r['N'], r['K']}")  # fmt: skip
        _REGISTERED[(int(r["M"]), int(r["N"]), int(r["K"]))] = (
            int(best["block_n"]), int(best["block_k"]), int(best["warps"]), int(best["stages"]),
            float(best["us"]), float(r["cublas_us"]), kind, split_k, l2_prefetch, block_m, pipeline, tma,
        )  # fmt: skip
        added += 1
    return added


# A GPU class of ``_MEASURED_BY_GPU`` and what its device name holds. Only the part measured: the PCIe and NVL
# H100s have other bandwidths and SM counts, so the H200's table serves them until swept.
_GPU_NAMES = {"H100 SXM": "H100 80GB HBM3"}


@functools.cache
def _gpu_class_of(index: int) -> str | None:
    name = torch.cuda.get_device_name(index)
    return next((cls for cls, part in _GPU_NAMES.items() if part in name), None)


@torch.compiler.assume_constant_result
def gpu_class() -> str | None:
    """The current CUDA device's key in ``_MEASURED_BY_GPU`` ("H100 SXM" for an "NVIDIA H100 80GB HBM3"), or
    None (no CUDA, or a GPU with no table of its own: the H200's table serves it).

    A constant for Dynamo (run once at trace time, no guard): the drafter calls ``linear_rows`` from Python
    inside its compiled round, and this keeps the CUDA device-name lookup out of the trace."""
    if not torch.cuda.is_available():
        return None
    return _gpu_class_of(torch.cuda.current_device())


def _swept_rows(N: int, K: int) -> dict[int, tuple]:
    """M -> entry for one (N, K), from the tables this process uses: the H200's, this GPU's own over them,
    registered rows over all. (A scan, not a merged copy: ``linear_rows`` asks at every eager call.)"""
    found = {}
    for table in (_MEASURED, _MEASURED_BY_GPU.get(gpu_class(), {}), _REGISTERED):
        for (m, n, k), entry in table.items():
            if n == N and k == K:
                found[m] = entry
    return found


def _kind(entry: tuple) -> str:
    return entry[6] if len(entry) > 6 else "dot"


def measured_tiles(M: int, N: int, K: int) -> SkinnyConfig | None:
    """The swept tiles for ``[M, K] x [N, K]^T`` when the sweep found them faster than cuBLAS, else None (the
    shape stays on cuBLAS). The nearest swept M of the same (N, K) in M's band stands in for M; a shape never
    swept is None: on unmeasured shapes cuBLAS is the safe default, and so is anything past ``MAX_ROWS``."""
    if not 1 <= M <= MAX_ROWS:
        return None
    # A gemv entry of <= 8 rows stands in for up to 8 (the kernel's limit until the twenty-seventh session);
    # 9-16 rows take a gemv entry only from a sweep at 9-16 rows (a bigger accumulator than 8 rows times)
    swept = [(m, v) for m, v in _swept_rows(N, K).items() if _band(m) == _band(M)
             and (_kind(v) == "dot" or M <= 8 or (m > 8 and M <= GEMV_MAX_ROWS))]  # fmt: skip
    if not swept:
        return None
    # Traced, the cache wrapper is skipped anyway (Dynamo warns of it): the plain function, then.
    config = _entry_config.__wrapped__ if torch.compiler.is_compiling() else _entry_config
    m, entry = _nearest(M, swept)
    return config(M, N, K, entry, m if GEMV_KEEP_FOOTPRINT else None)


def _nearest(M: int, swept) -> tuple[int, tuple]:
    """``(m, entry)`` of the swept M nearest ``M`` (the smaller on a tie) among ``(m, entry)`` pairs. A loop:
    Dynamo traces this from the drafter's compiled round (``linear_rows``), and ``min(..., key=...)`` breaks
    its graph for a symbolic row count."""
    best = None
    for m, entry in swept:
        if best is None or (abs(m - M), m) < (abs(best[0] - M), best[0]):
            best = (m, entry)
    return best


def swept_mma_tiles(M: int, N: int, K: int) -> tuple[int, int, int, int] | None:
    """(block_n, block_k, num_warps, num_stages) of the nearest swept M's MMA entry for (N, K) in M's band, won
    against cuBLAS or not, else None: the best Triton tiles a sweep found for that GEMM, for ops that fuse more
    than it (``skinny_qkv_rope``) and so run on Triton where the plain GEMM stays on cuBLAS."""
    swept = [(m, v) for m, v in _swept_rows(N, K).items() if _band(m) == _band(M) and _kind(v) == "dot"]
    return tuple(_nearest(M, swept)[1][:4]) if swept else None


@functools.lru_cache(maxsize=4096)
def _entry_config(M: int, N: int, K: int, entry: tuple, measured_m: int | None = None) -> SkinnyConfig | None:
    """One table entry as the launch config for M rows (None where cuBLAS won). Cached by the entry's own
    values (a changed entry is another key): eager ``linear_rows`` calls ask at every launch, and building the
    config costs several times the table scan. ``measured_m``: the rows the entry was swept at, given under
    ``GEMV_KEEP_FOOTPRINT`` (the default): a gemv entry standing in for more rows than its block held then takes a shorter K
    step, so its ``[BLOCK_M, BLOCK_N, BLOCK_K]`` accumulator stays the size that was measured."""
    block_n, block_k, warps, stages, us, cublas_us = entry[:6]
    kind = _kind(entry)
    if measured_m is not None and kind != "dot" and M > measured_m:
        grow = (1 << (M - 1).bit_length()) // (1 << (measured_m - 1).bit_length())  # block rows: powers of two
        block_k = max(16, block_k // grow)
    split_k = entry[7] if len(entry) > 7 else 1
    l2_prefetch = entry[8] if len(entry) > 8 else 0
    block_m = entry[9] if len(entry) > 9 else 0
    pipeline = bool(entry[10]) if len(entry) > 10 else False
    tma = bool(entry[11]) if len(entry) > 11 else False
    if us > WIN_MARGIN * cublas_us:
        return None
    tiles = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, split_k=split_k,
                 l2_prefetch=l2_prefetch)  # fmt: skip
    if block_m:
        tiles["block_m"] = block_m
    if kind != "dot":
        return gemv_config(M, N, K, pdl=kind == "gemv_pdl", pipeline=pipeline, **tiles)
    return choose_skinny_config(M, N, K, tma=tma, **tiles)


def choose_skinny_config(M: int, N: int, K: int, **override) -> SkinnyConfig:
    """Static tiles from the shapes, for shapes the sweep never measured (``measured_tiles`` first): up to 64
    rows in one tile, more in row blocks of ``ROW_BLOCK``; 16-wide slices of the output features unless that
    makes more than ~4 programs per SM (132 SMs), so small layers get many programs and large ones long K
    streams."""
    block_m = max(16, triton.next_power_of_2(M)) if M <= 64 else ROW_BLOCK
    block_n = 16
    while block_n < 128 and triton.cdiv(N, block_n) > 4 * 132:
        block_n *= 2
    block_k = 128 if block_m <= 16 else 64
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    cfg = dict(block_m=block_m, block_n=block_n, block_k=block_k)
    cfg.update(override)
    return SkinnyConfig(**cfg)


def gemv_config(M: int, N: int, K: int, **override) -> SkinnyConfig:
    """Tiles for the gemv kernel (M <= GEMV_MAX_ROWS): all rows in one program, 8-wide slices of the output
    features (N / 8 programs: 512 for a 4096-wide layer, so every SM has several), 512-wide K steps (128 for
    9-16 rows)."""
    if not 1 <= M <= GEMV_MAX_ROWS:
        raise ValueError(f"M: the gemv kernel takes 1..{GEMV_MAX_ROWS} rows, got {M}")
    block_m = triton.next_power_of_2(M)
    block_k = min(512, max(16, triton.next_power_of_2(K)))
    if block_m > 8:  # 9-16 rows: keep the [BLOCK_M, BLOCK_N, BLOCK_K] accumulator at 16k float32 elements
        block_k = min(block_k, 16384 // (block_m * 8))
    cfg = dict(block_m=block_m, block_n=8, block_k=block_k, gemv=True)
    cfg.update(override)
    return SkinnyConfig(**cfg)


def _default_config(M: int, N: int, K: int) -> SkinnyConfig:
    """The launch config of a call without one: the measured tiles, else the static ones. One place, so that
    ``norm_out_slices`` / ``norm_out_supported`` and the launch cannot disagree."""
    return measured_tiles(M, N, K) or choose_skinny_config(M, N, K)


def _norm_out_refusal(cfg: SkinnyConfig) -> str | None:
    """Why ``cfg`` cannot run the norm-out epilogue (None: it can). Only the MMA kernel's store has it (split-K or
    not: the split that reduces a slice writes it)."""
    if cfg.gemv:
        return "the chosen config is the gemv kernel (a measured <= 16-row entry), which has no norm-out epilogue"
    return None


def norm_out_slices(M: int, N: int, K: int) -> int:
    """S, the rows of ``skinny_linear_norm_out``'s ``sumsq [S, M]``: the launch's BLOCK_N-wide output slices,
    ``cdiv(N, block_n)`` of the config the launcher picks for (M, N, K) (measured tiles, else static ones)."""
    block_n = _default_config(M, N, K).block_n
    return (N + block_n - 1) // block_n


def norm_out_supported(M: int, N: int, K: int) -> bool:
    """Whether ``skinny_linear_norm_out`` runs for (M, N, K): the config the launcher picks is the MMA kernel
    (not gemv; any split_k, TMA weight boxes or not). Otherwise the op raises ValueError."""
    return _norm_out_refusal(_default_config(M, N, K)) is None


def _launch_skinny_linear(
    x, weight, bias, out, config: SkinnyConfig | None = None, constant_weight: bool = False, *, residual=None,
    norm=None,
) -> None:  # fmt: skip
    """Fill preallocated ``out [M, N]`` (any row stride, last dim contiguous); with ``residual [M, N]`` (any
    row stride, last dim contiguous) out = round(round(x @ weight.T + bias) + residual). ``norm = (u, sumsq,
    norm_weight)``: the norm-out epilogue (``skinny_linear_norm_out``; residual required, an MMA config): u [M, N]
    (last dim contiguous) = round(norm_weight * out), sumsq [cdiv(N, block_n), M] float32 contiguous = each slice's
    sum of out^2."""
    M, K = x.shape
    N = weight.shape[0]
    cfg = config or _default_config(M, N, K)
    norm_args = {}
    if norm is not None:
        u, sumsq, norm_weight = norm
        refusal = _norm_out_refusal(cfg)
        if refusal is not None:
            raise ValueError(f"skinny_linear_norm_out: {refusal}")
        if residual is None:
            raise ValueError("skinny_linear_norm_out: residual is required")
        slices = triton.cdiv(N, cfg.block_n)
        if tuple(sumsq.shape) != (slices, M) or sumsq.dtype != torch.float32 or not sumsq.is_contiguous():
            raise ValueError(f"sumsq: expected a contiguous float32 [S={slices}, M={M}], got "
                             f"{tuple(sumsq.shape)} {sumsq.dtype} strides {tuple(sumsq.stride())}")  # fmt: skip
        if tuple(u.shape) != (M, N) or (N > 1 and u.stride(1) != 1):
            raise ValueError(f"u: expected [M={M}, N={N}] with a contiguous last dim, got {tuple(u.shape)}")
        norm_args = dict(u=u, sq=sumsq, g=norm_weight, s_um=u.stride(0), s_g=norm_weight.stride(0), NORM_OUT=True)
    if cfg.gemv:
        _launch_gemv(x, weight, bias, out, cfg, constant_weight, residual)
        return
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m), cfg.split_k)
    ws, counters, k_per_split = _split_k_buffers(x, M, N, K, cfg, grid[0] * grid[1])
    pdl = pdl_enabled(x.device)
    tma = cfg.tma and tma_weights_ok(weight)
    if cfg.tma and max(cfg.block_n, cfg.block_k) > 256:
        raise ValueError(f"config: a TMA box spans at most 256 elements a dim, got block_n={cfg.block_n}, "
                         f"block_k={cfg.block_k}")  # fmt: skip
    if tma:  # one [BLOCK_N, BLOCK_K] box a step, zero past the weight's edges (host-built: no device work)
        from triton.tools.tensor_descriptor import TensorDescriptor

        w_desc = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [cfg.block_n, cfg.block_k])
    else:
        w_desc = weight  # unused (TMA=False)
    _skinny_linear_kernel[grid](
        x, weight, w_desc, bias if bias is not None else weight, residual if residual is not None else x, out, ws,
        counters, M, N, K, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        bias.stride(0) if bias is not None else 0, residual.stride(0) if residual is not None else 0,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, EVEN_K=K % cfg.block_k == 0, TMA=tma,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        L2_LINES=_l2_lines(cfg, weight.element_size()), LINE_ELEMS=128 // weight.element_size(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **(dict(launch_pdl=True) if pdl else {}), **norm_args,
    )  # fmt: skip


L2_PREFETCH_ENV = "TREECOMPILE_SKINNY_L2_PREFETCH"


def _l2_lines(cfg: SkinnyConfig, element_size: int) -> int:
    """128-byte lines of K a program hints into L2 (for each of its weight rows) before its dependency wait:
    the config's ``l2_prefetch`` tiles, or for A/B runs the ``TREECOMPILE_SKINNY_L2_PREFETCH`` count (0 or a
    power of two) for every launch, times BLOCK_K; at least one line when on, 0 when off or interpreting."""
    env = os.environ.get(L2_PREFETCH_ENV, "").strip()
    if env:
        try:
            tiles = check_l2_prefetch(L2_PREFETCH_ENV, int(env))
        except ValueError as exc:
            raise ValueError(f"{L2_PREFETCH_ENV}: {exc}") from None
    else:
        tiles = check_l2_prefetch("config", cfg.l2_prefetch)
    return max(1, tiles * cfg.block_k * element_size // 128) if tiles else 0


def _split_k_buffers(x, M: int, N: int, K: int, cfg: SkinnyConfig, slices: int):
    """``(workspace [split_k, M, N] float32, counters [MAX_SLICES] int32, k_per_split)`` of a split-K launch;
    for ``split_k == 1`` unused stand-ins and K. The counter table is one per device, zeroed once and left
    zeroed by every launch (the last split of a slice resets its counter), so a captured graph replays with
    no memset. Launches on one stream run one after another (a dependent launch waits for the previous grid
    before it touches the table); the table is not for concurrent launches on several streams."""
    if cfg.split_k == 1:
        return x, x, K
    if not 1 <= cfg.split_k <= MAX_SPLIT_K:
        raise ValueError(f"config: split_k must be in 1..{MAX_SPLIT_K}, got {cfg.split_k}")
    if slices > MAX_SLICES:
        raise ValueError(f"config: a split-K launch counts at most {MAX_SLICES} slices, got {slices} (block_n too small)")
    counters = counter_table("skinny_linear split-K", x.device, MAX_SLICES)
    ws = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.block_k), cfg.split_k) * cfg.block_k
    return ws, counters, k_per_split


if HAS_TRITON:

    @triton.jit
    def _skinny_linear_kernel(
        x, w, w_desc, b, r, out, ws, counters, M, N, K, k_per_split, s_xm, s_wn, s_om, s_b, s_rm,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr,
        USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, L2_LINES: tl.constexpr, LINE_ELEMS: tl.constexpr,
        u=None, sq=None, g=None, s_um=0, s_g=0, NORM_OUT: tl.constexpr = False,
    ):  # fmt: skip
        """Program (n slice, m block, k split): out[m block, n slice] = x[m block] @ w[n slice].T (+ bias)
        (+ residual[m block, n slice]), over K in [split * k_per_split, +k_per_split) when SPLIT_K > 1 (then
        reduced by ``_split_k_store``, which adds bias and residual).

        NORM_OUT (HAS_RES; ``skinny_linear_norm_out``): the store of a slice's result (under split-K the last
        split's) also writes ``u [M, N]`` (row stride s_um) = round(g * s) for the norm weight ``g`` (stride s_g)
        and the slice's sums of s^2 at ``sq [num slices, M]`` (contiguous): ``_norm_out_store``. Off (the
        default), the kernel is as before.

        TMA: each weight tile is one box of ``w_desc`` (the copy engine fills shared memory, the pipeliner keeps
        num_stages - 1 boxes in flight, zeros past N and K); the rows of x stay pointer loads (a few KB a step).
        On an H100 at 64 rows the boxes tied the pointer loads' cp.async pipeline on wide tiles and lost 3-11% on
        narrow ones (notes/gpu-2026-12-05-s40), so no table entry uses them."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        k_lo = tl.program_id(2) * k_per_split  # k_per_split: whole BLOCK_K tiles (K itself when SPLIT_K == 1)
        k_hi = tl.minimum(K, k_lo + k_per_split)
        if L2_LINES > 0:  # before the wait: the weight's first tiles stream in while the previous kernel ends
            _prefetch_weight(w, rn, n_ok, k_lo, k_hi, s_wn, L2_LINES, LINE_ELEMS)
        if USE_PDL:  # TREECOMPILE_PDL: wait for the previous kernel, then let the next one launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # Rows past M / N read row 0 (in bounds) instead of a masked load: the hot loop carries only the K
        # mask, and the rows are dropped at the store.
        x_ptrs = x + tl.where(m_ok, rm, 0).to(tl.int64)[:, None] * s_xm + (k_lo + rk)[None, :]
        w_ptrs = w + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * s_wn + (k_lo + rk)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if TMA:  # past K the box reads zeros (splits cover whole BLOCK_K tiles: only the last one ends there)
                wt = w_desc.load([tl.program_id(0) * BLOCK_N, k0])
            if EVEN_K:
                xt = tl.load(x_ptrs)
                if not TMA:
                    wt = tl.load(w_ptrs)
            else:
                k_ok = (k0 + rk) < K
                xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                if not TMA:
                    wt = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        slice_id = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        _split_k_store(acc, b, r, out, ws, counters, slice_id, rm, rn, M, N, s_om, s_b, s_rm, HAS_BIAS, HAS_RES,
                       SPLIT_K, u, sq, g, s_um, s_g, NORM_OUT)  # fmt: skip

    @triton.jit
    def _prefetch_weight(
        w, rn, n_ok, k_lo, k_hi, s_wn, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr
    ):  # fmt: skip
        """L2 hints for the 128-byte lines of w[rn, k_lo : k_lo + LINES * LINE_ELEMS] (clipped to k_hi): the
        [BLOCK_N, LINES] addresses of the program's first weight tiles (``prefetch_l2``: a hint, so it may
        precede the dependency wait even if the weight were being written)."""
        col = k_lo + tl.arange(0, LINES) * LINE_ELEMS
        lines = w + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * s_wn + col[None, :]
        prefetch_l2(tl.where((col < k_hi)[None, :], lines, w))

    @triton.jit
    def _split_k_store(
        acc, b, r, out, ws, counters, slice_id, rm, rn, M, N, s_om, s_b, s_rm,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr,
        u=None, sq=None, g=None, s_um=0, s_g=0, NORM_OUT: tl.constexpr = False,
    ):  # fmt: skip
        """Store ``acc [BLOCK_M, BLOCK_N]`` (+ bias) (+ residual: ``_bias_residual``) at out[rm, rn] (with
        NORM_OUT also the next RMSNorm's inputs: ``_norm_out_store``). With SPLIT_K > 1 ``acc`` is this split's
        partial: it goes to ``ws [SPLIT_K, M, N]``; the split that then finds its slice's counter at SPLIT_K - 1
        (the last to arrive) sums all SPLIT_K partials in split order (the same sum whichever split is last),
        adds bias and residual, stores, and zeroes the counter for the next launch. The barrier makes every
        thread's partial stores precede the counter's release (gpu scope); the partials are read through L2
        (.cg), never a stale L1 line."""
        m_ok = rm < M
        n_ok = rn < N
        ok = m_ok[:, None] & n_ok[None, :]
        o_ptrs = out + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
        if SPLIT_K == 1:
            y = _bias_residual(acc, b, r, out, rm, rn, n_ok, ok, s_b, s_rm, HAS_BIAS, HAS_RES)
            tl.store(o_ptrs, y, mask=ok)
            if NORM_OUT:
                _norm_out_store(y, u, sq, g, rm, rn, M, m_ok, n_ok, ok, s_um, s_g)
        else:
            part = rm.to(tl.int64)[:, None] * N + rn[None, :]
            tl.store(ws + tl.program_id(2).to(tl.int64) * M * N + part, acc, mask=ok)  # int64: no overflow
            tl.debug_barrier()
            arrived = tl.atomic_add(counters + slice_id, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                y = tl.zeros(acc.shape, tl.float32)
                for s in tl.static_range(SPLIT_K):
                    split_base = tl.full((), s, tl.int64) * M * N
                    y += tl.load(ws + split_base + part, mask=ok, other=0.0, cache_modifier=".cg")
                y = _bias_residual(y, b, r, out, rm, rn, n_ok, ok, s_b, s_rm, HAS_BIAS, HAS_RES)
                tl.store(o_ptrs, y, mask=ok)
                if NORM_OUT:
                    _norm_out_store(y, u, sq, g, rm, rn, M, m_ok, n_ok, ok, s_um, s_g)
                tl.atomic_xchg(counters + slice_id, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _norm_out_store(s, u, sq, g, rm, rn, M, m_ok, n_ok, ok, s_um, s_g):
        """The next RMSNorm's inputs from ``s``, the slice's output as stored (``round(round(acc + bias) +
        residual)``: the rounded values, as the unfused graph's norm reads them): u[rm, rn] = round(g[rn] * s)
        (float32 product, one rounding) under the store's mask, and the slice's sum over its columns of s^2
        (float32; masked columns add 0) at sq[program_id(0), rm] (rows < M only). Under split-K only the last
        split of a slice calls it, with the summed partials."""
        sf = s.to(tl.float32)
        gf = tl.load(g + rn * s_g, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(u + rm.to(tl.int64)[:, None] * s_um + rn[None, :], (gf[None, :] * sf).to(u.dtype.element_ty),
                 mask=ok)  # fmt: skip
        part = tl.sum(tl.where(ok, sf * sf, 0.0), axis=1)
        tl.store(sq + tl.program_id(0).to(tl.int64) * M + rm, part, mask=m_ok)

    @triton.jit
    def _bias_residual(
        y, b, r, out, rm, rn, n_ok, ok, s_b, s_rm, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr
    ):  # fmt: skip
        """The float32 sums ``y`` as stored at ``out``: + bias (any stride: a bias may be a view, a column of a
        wider table), rounded to out's dtype (what ``F.linear`` returns); with the residual, that plus
        residual[rm, rn] in float32, rounded again (the unfused graph's 16-bit add). The residual is read under
        the store's mask (any row stride, last dim contiguous)."""
        if HAS_BIAS:
            y += tl.load(b + rn * s_b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = y.to(out.dtype.element_ty)
        if HAS_RES:
            res = tl.load(r + rm.to(tl.int64)[:, None] * s_rm + rn[None, :], mask=ok, other=0.0)
            y = (y.to(tl.float32) + res.to(tl.float32)).to(out.dtype.element_ty)
        return y


def _launch_gemv(x, weight, bias, out, cfg: SkinnyConfig, constant_weight: bool, residual=None) -> None:
    M, K = x.shape
    N = weight.shape[0]
    if M > cfg.block_m:
        raise ValueError(f"config: the gemv kernel's block_m={cfg.block_m} must cover x's M={M}")
    # A gemv_pdl table entry, or every launch where pdl_enabled holds (Hopper unless TREECOMPILE_PDL=0); the
    # interpreter (CPU) has no grid-dependency control.
    pdl = (cfg.pdl or pdl_enabled(x.device)) and x.device.type == "cuda"
    extra = dict(launch_pdl=True) if pdl else {}
    grid = (triton.cdiv(N, cfg.block_n), 1, cfg.split_k)
    ws, counters, k_per_split = _split_k_buffers(x, M, N, K, cfg, grid[0])
    _skinny_gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, residual if residual is not None else x, out, ws, counters,
        M, N, K, k_per_split, x.stride(0), weight.stride(0), out.stride(0), bias.stride(0) if bias is not None else 0,
        residual.stride(0) if residual is not None else 0, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        USE_PDL=pdl, PREFETCH=pdl and constant_weight and not cfg.pipeline,
        PIPELINE=cfg.pipeline, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        L2_LINES=_l2_lines(cfg, weight.element_size()), LINE_ELEMS=128 // weight.element_size(),
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _skinny_gemv_kernel(
        x, w, b, r, out, ws, counters, M, N, K, k_per_split, s_xm, s_wn, s_om, s_b, s_rm,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
        PIPELINE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, L2_LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """Program (n slice, -, k split): out[:, n slice] = x @ w[n slice].T (+ bias) (+ residual[:, n slice]),
        by multiply-add on CUDA cores; over K in [split * k_per_split, +k_per_split) when SPLIT_K > 1 (reduced by
        ``_split_k_store``).

        PIPELINE: the loop loads each tile where it is used, in a ``tl.range`` of NUM_STAGES stages, and the
        compiler pipelines the loads (async copies into shared memory, NUM_STAGES - 1 tiles in flight; an sm_90
        compile shows them, ``tests/ops/test_sm90_compile.py``), where the register double buffer below has
        one tile in flight and compiles to no async copy at all. It waits for the previous kernel first (no
        first tile ahead of the wait).

        A 1-row GEMM is a weight stream: 2 FLOPs a loaded element, nothing for tensor cores to win, and a
        16-row MMA tile would be 15/16 padding. Each step multiplies a [BLOCK_N, BLOCK_K] weight tile into a
        [BLOCK_M, BLOCK_N, BLOCK_K] float32 accumulator; the K reduction runs once, after the loop. The
        next weight tile is loaded before the current one is used (a software double buffer). Under PDL
        (USE_PDL) the programs start while the previous kernel drains and ``gdc_wait`` before touching
        anything it may write (x, out's memory); with PREFETCH (a constant weight) the first weight tile is
        loaded before that wait. (Loads issued ahead of the dependency wait: the programmatic dependent
        launch section of the CUDA programming guide.)"""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        k_lo = tl.program_id(2) * k_per_split  # k_per_split: whole BLOCK_K tiles (K itself when SPLIT_K == 1)
        k_hi = tl.minimum(K, k_lo + k_per_split)
        w_ptrs = w + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * s_wn + (k_lo + rk)[None, :]
        x_ptrs = x + tl.where(m_ok, rm, 0).to(tl.int64)[:, None] * s_xm + (k_lo + rk)[None, :]
        if L2_LINES > 0:  # hints only: ahead of the wait in either case (the tiles after the first one)
            _prefetch_weight(w, rn, n_ok, k_lo + BLOCK_K, k_hi, s_wn, L2_LINES, LINE_ELEMS)
        if PIPELINE:
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
            for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
                k_ok = ((k0 + rk) < k_hi)[None, :]
                xt = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                wt = tl.load(w_ptrs, mask=k_ok, other=0.0).to(tl.float32)
                acc += xt[:, None, :] * wt[None, :, :]
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
        else:
            if USE_PDL and not PREFETCH:
                tl.extra.cuda.gdc_wait()  # the weight itself may be the previous kernel's output
            wt = tl.load(w_ptrs, mask=((k_lo + rk) < k_hi)[None, :], other=0.0)
            if USE_PDL and PREFETCH:
                tl.extra.cuda.gdc_wait()  # everything below may read or overwrite the previous kernel's memory
            if USE_PDL:
                # The next kernel may launch now: a dependent launch waits for this whole grid before it reads
                # anything (every treecompile kernel does; Inductor's wait where they read this one's output).
                tl.extra.cuda.gdc_launch_dependents()
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                xt = tl.load(x_ptrs, mask=((k0 + rk) < k_hi)[None, :], other=0.0).to(tl.float32)
                w_next = tl.load(w_ptrs + BLOCK_K, mask=((k0 + BLOCK_K + rk) < k_hi)[None, :], other=0.0)
                acc += xt[:, None, :] * wt.to(tl.float32)[None, :, :]
                wt = w_next
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=2)
        _split_k_store(y, b, r, out, ws, counters, tl.program_id(0), rm, rn, M, N, s_om, s_b, s_rm, HAS_BIAS,
                       HAS_RES, SPLIT_K)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def skinny_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The CPU path and the test oracle: ``F.linear``, plus ``residual`` in x's dtype (the unfused graph: the
    linear's result rounded, then the add's)."""
    out = F.linear(x, weight, bias)
    return out if residual is None else out + residual


def skinny_linear_norm_out_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CPU path of ``skinny_linear_norm_out`` and the test oracle: ``s`` the residual reference above, ``u =
    round(norm_weight.float() * s.float())``, ``sumsq [S, M]`` the sums of ``s.float() ** 2`` over column slices
    of ``block_n`` (default: the launch config's, so the kernel's slice boundaries), S = cdiv(N, block_n)."""
    s = skinny_linear_reference(x, weight, bias, residual)
    u = (norm_weight.float()[None, :] * s.float()).to(x.dtype)
    M, N = s.shape
    if block_n is None:
        block_n = _default_config(M, N, x.shape[1]).block_n
    slices = (N + block_n - 1) // block_n
    sq = F.pad(s.float().pow(2), (0, slices * block_n - N))
    return s, u, sq.reshape(M, slices, block_n).sum(-1).t().contiguous()
