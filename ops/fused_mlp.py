"""A gated MLP for few rows as one weight stream: ``down(silu(x @ gate.T) * (x @ up.T))`` in two kernels.

Why it exists: a 1-row decode of an 8B Llama runs its MLP as cuBLAS gate/up (58 us), an Inductor silu-mul
kernel (1.5 us), cuBLAS split-K down (29.5 us) and cuBLAS's split-K reduce (1.7 us): 90.7 us a layer against
82.3 us of weight bytes at the copy rate (notes/gpu-2026-12-04-s31, c2_prof.tgz, decode_eager.txt). Each
kernel boundary costs a drain and a ramp, and silu-mul and the reduce are pure launch cost. For few rows the
intermediate activation of a slice of the intermediate features depends only on the gate and up rows of that
slice, and that slice's share of the down projection depends only on it. So one program per CHUNK-wide slice
of the intermediate dim can stream all three weights of its slice back to back:

    g, u   = x @ gate[j].T, x @ up[j].T              # [M, CHUNK]: gate / up rows j of the slice
    h      = silu(g) * u                             # rounded like the unfused path (below)
    ws[c]  = h @ down[:, j].T                        # [M, H] float32: the slice's partial of the output

and a second kernel sums the ``I / CHUNK`` partials of each output element in slice order (deterministic:
the same sum on every run) and stores them. That is one weight stream (gate, up and down of every slice) and
a reduction over a workspace of ``I / CHUNK x M x H`` float32 (8B, M = 1, CHUNK = 64: 3.7 MB, in L2), in
place of four launches. The split of a reduction into per-slice partials summed by a second pass is the
split-K GEMM's (the stream-K paper, Osama et al. 2023); fusing the two projections of a gated MLP around
their elementwise product for decode is what TensorRT-LLM's and SGLang's fused-MoE / gated-MLP kernels do for
small batches (read there, written here for Triton).

Numerics follow the unfused graph: g and u are rounded to x's dtype (the fused gate/up GEMM's output), the
product ``silu(g) * u`` is computed in float32 and rounded to x's dtype (Inductor's silu-mul kernel), and the
down projection accumulates in float32 and rounds once. Only the summation order differs.

An optional RMSNorm prologue (``norm_weight``, and ``residual`` for the residual add before it) folds the norm
that precedes a decoder layer's MLP into the same stream: the MLP's input is ``rmsnorm(x + residual) *
norm_weight`` (HF ``LlamaRMSNorm``). No program needs the normalised row before its first step: since the
norm's scale ``r = rsqrt(mean(s^2) + eps)`` is one number a row, ``gate(norm_weight * s * r) = r * gate(
norm_weight * s)``, so each program feeds ``norm_weight * s`` to the MMA, sums ``s^2`` over the same steps,
and scales its gate / up accumulators by ``r`` at the end. That drops the norm's own launch (~2.3 us a layer
at 8B decode). Rounding differs from HF's at one point: HF rounds ``s * r`` and then ``norm_weight * (s *
r)`` to x's dtype, the kernel rounds ``norm_weight * s`` (bfloat16: ~2^-8 relative, as any fusion of the
norm does); the reference below is HF's.

Whether it wins, and with which tiles, is for ``tests/gpu/mlp_sweep.py`` to measure on cold weights against
the cuBLAS chain. Until a shape has a measured entry (``measured_mlp_tiles``) it stays on the unfused path;
``TREECOMPILE_FUSED_MLP=1`` runs it for every qualifying shape with the default tiles (A/B runs).

Shapes
------
x       [M, H]  float16 / bfloat16 / float32 (float64 on the CPU: the reference, for lossless tests); 1 <= M <=
        MAX_ROWS (16); last dim contiguous, any row stride
gate    [I, H]  x's dtype, last dim contiguous (a ``gate_proj`` weight, or rows [0, I) of a fused gate/up one)
up      [I, H]  x's dtype, last dim contiguous
down    [H, I]  x's dtype, last dim contiguous
out     [M, H]  x's dtype
norm_weight [H] or None  x's dtype, any stride: with it, the MLP's input is rmsnorm(x (+ residual)) * norm_weight
residual    [M, H] or None  x's dtype, last dim contiguous; only with norm_weight (added before the norm, rounded
        to x's dtype as HF's residual add rounds)
eps     float >= 0: the norm's epsilon
constant_weight  bool: the weights are parameters, never written by the kernel before this one (kept for the
        callers' symmetry with ``skinny_linear``; the kernel waits for the previous one before any load).

Only metadata is checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._common import (
    HAS_TRITON, check_dim, check_dtype, check_same_device, env_switch, pdl_enabled, tma_weights_ok, use_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "fused_mlp", "fused_mlp_reference", "mlp_applies", "MlpConfig", "choose_mlp_config", "measured_mlp_tiles",
    "register_mlp_tiles", "fused_mlp_wanted", "fold_norm_wanted", "MAX_ROWS", "FUSED_MLP_ENV", "FUSED_MLP_NORM_ENV",
]

MAX_ROWS = 16  # one 16-row MMA tile; the workspace grows with M (I / CHUNK x M x H float32)
FUSED_MLP_ENV = "TREECOMPILE_FUSED_MLP"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: the CPU reference only


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::fused_mlp", mutates_args=())
def fused_mlp(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, constant_weight: bool = False,
    norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """``down(silu(gate(x)) * up(x))`` for ``x [M <= 16, H]``, x first normalised when ``norm_weight`` is given
    (see the module docstring)."""
    _check_inputs(x, gate, up, down, norm_weight, residual, eps)
    norm = () if norm_weight is None else (norm_weight,) + (() if residual is None else (residual,))
    if use_triton(x, gate, up, down, *norm):
        out = x.new_empty(x.shape)
        _launch_fused_mlp(x, gate, up, down, out, norm_weight=norm_weight, residual=residual, eps=eps)
        return out
    return fused_mlp_reference(x, gate, up, down, norm_weight, residual, eps)


@fused_mlp.register_fake
def _(x, gate, up, down, constant_weight=False, norm_weight=None, residual=None, eps=0.0):
    _check_inputs(x, gate, up, down, norm_weight, residual, eps)
    return x.new_empty(x.shape)


def _check_inputs(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
    norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 0.0,
) -> None:  # fmt: skip
    check_dim("x", x, 2, "[M, H]")
    check_dim("gate", gate, 2, "[I, H]")
    check_dim("up", up, 2, "[I, H]")
    check_dim("down", down, 2, "[H, I]")
    check_dtype("x", x, *_DTYPES)
    if x.dtype == torch.float64 and x.device.type != "cpu":
        raise ValueError(f"x: float64 runs on the CPU only (the float64 reference), got a tensor on {x.device.type}")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check_dtype(name, w, x.dtype)
    M, H = x.shape
    I = gate.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"x: 1..{MAX_ROWS} rows (a few-row MLP), got M={M}; run the unfused MLP for more")
    if H < 1 or I < 1:
        raise ValueError(f"x, gate: the hidden and intermediate sizes must be >= 1, got H={H}, I={I}")
    if tuple(gate.shape) != (I, H) or tuple(up.shape) != (I, H):
        raise ValueError(f"gate, up: expected [I, H={H}] each with one I, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if tuple(down.shape) != (H, I):
        raise ValueError(f"down: expected [H={H}, I={I}], got {tuple(down.shape)}")
    devices = dict(x=x, gate=gate, up=up, down=down)
    if residual is not None and norm_weight is None:
        raise ValueError("residual: only with norm_weight (the residual add before the norm)")
    if norm_weight is not None:
        check_dim("norm_weight", norm_weight, 1, "[H]")
        check_dtype("norm_weight", norm_weight, x.dtype)
        if norm_weight.shape[0] != H:
            raise ValueError(f"norm_weight: expected [H={H}], got {tuple(norm_weight.shape)}")
        if not (eps >= 0.0 and eps < float("inf")):
            raise ValueError(f"eps: the norm's epsilon must be finite and >= 0, got {eps}")
        devices["norm_weight"] = norm_weight
    if residual is not None:
        check_dtype("residual", residual, x.dtype)
        if tuple(residual.shape) != (M, H):
            raise ValueError(f"residual: expected x's shape [M={M}, H={H}], got {tuple(residual.shape)}")
        devices["residual"] = residual
    for name, t in (("x", x), ("gate", gate), ("up", up), ("down", down), ("residual", residual)):
        if t is not None and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: the last dim must have stride 1, got strides {tuple(t.stride())}")
    check_same_device(**devices)


FUSED_MLP_NORM_ENV = "TREECOMPILE_FUSED_MLP_NORM"


def fused_mlp_wanted() -> bool:
    """``TREECOMPILE_FUSED_MLP=1``: run the fused MLP for every qualifying shape, measured or not (A/B runs)."""
    return env_switch(FUSED_MLP_ENV, False)


def fold_norm_wanted() -> bool:
    """Whether callers of the fused MLP fold the RMSNorm (and residual add) before it into the op: yes unless
    ``TREECOMPILE_FUSED_MLP_NORM=0`` (A/B runs)."""
    return env_switch(FUSED_MLP_NORM_ENV, True)


def mlp_applies(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether a caller (the drafter's MLP) should take the fused op for these tensors (static metadata only):
    16-bit CUDA tensors of one dtype, 1..MAX_ROWS rows (the product of x's leading dims), 2-d weights of
    matching shapes with contiguous last dims, and a measured entry for the shape (or
    ``TREECOMPILE_FUSED_MLP=1``)."""
    H = int(x.shape[-1])  # ints: under a dynamic-shape trace this specializes instead of guarding symbolically
    M = 1
    for d in x.shape[:-1]:
        M *= int(d)
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and 1 <= M <= MAX_ROWS):
        return False
    if any(w.dtype != x.dtype or w.dim() != 2 or not w.is_cuda for w in (gate, up, down)):
        return False
    I = gate.shape[0]
    if tuple(gate.shape) != (I, H) or tuple(up.shape) != (I, H) or tuple(down.shape) != (H, I):
        return False
    if any(w.stride(1) != 1 for w in (gate, up, down)) or x.stride(-1) != 1:
        return False
    return fused_mlp_wanted() or measured_mlp_tiles(M, H, I) is not None


# --------------------------------------------------------------------------------------------------
# Tiles: defaults and the measured table
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlpConfig:
    """Tiles of one launch. The chunk kernel: BLOCK_M rows (>= 16, the MMA's least; rows past M read row 0
    and are dropped), ``chunk`` intermediate features a program (its grid is I / chunk), ``block_k`` of the
    hidden dim a gate/up step, ``block_h`` output features a down step. The reduce kernel: ``reduce_block``
    output features a program, ``reduce_chunks`` partials summed a step (0: all of them in one step, up to
    256; its loads are not pipelined, so each step is an L2 round trip: 8B, M = 1: 224 partials, one step of
    [256, 32] float32 for each of 128 programs). ``tma``: the weight tiles come through TMA descriptors (one
    box a tile, zero-filled past the weight's edge) where ``_common.tma_weights_ok`` holds, else through
    pointers."""

    block_m: int = 16
    chunk: int = 64
    block_k: int = 128
    block_h: int = 128
    num_warps: int = 4
    num_stages: int = 3
    reduce_block: int = 32
    reduce_chunks: int = 0
    tma: bool = False  # gate / up / down tiles through Hopper TMA descriptors (where the device and layout allow)


def _pow2(name: str, value: int, least: int) -> None:
    if value < least or value & (value - 1):
        raise ValueError(f"config: {name} must be a power of two >= {least}, got {value}")


def _check_config(cfg: MlpConfig, M: int) -> None:
    _pow2("block_m", cfg.block_m, 16)
    if cfg.block_m < M:
        raise ValueError(f"config: block_m={cfg.block_m} must cover x's M={M}")
    for name in ("chunk", "block_k", "block_h"):
        _pow2(name, getattr(cfg, name), 16)
    _pow2("reduce_block", cfg.reduce_block, 1)
    if cfg.reduce_chunks:
        _pow2("reduce_chunks", cfg.reduce_chunks, 1)
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"config: num_warps must be 1, 2, 4, 8 or 16, got {cfg.num_warps}")
    if not 1 <= cfg.num_stages <= 8:
        raise ValueError(f"config: num_stages must be in 1..8, got {cfg.num_stages}")
    if cfg.tma and max(cfg.chunk, cfg.block_k, cfg.block_h) > 256:
        raise ValueError(f"config: a TMA box spans at most 256 elements a dim, got chunk={cfg.chunk}, "
                         f"block_k={cfg.block_k}, block_h={cfg.block_h}")  # fmt: skip


def choose_mlp_config(M: int, H: int, I: int, **override) -> MlpConfig:
    """Default tiles for an unmeasured shape: 64-wide slices of the intermediate dim (8B: 224 programs, about
    two a Hopper SM, each streaming 1.5 MB of weights), 128-wide steps of the hidden dim, tiles no wider
    than the dims they cover, weight tiles through TMA where the device allows (on an H100, 8B, one row:
    137.7 us against 429.4 through pointers; notes/gpu-2026-12-05-s39/mlp_sweep.json)."""
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"M: the fused MLP takes 1..{MAX_ROWS} rows, got {M}")

    def fit(block: int, dim: int) -> int:
        return max(16, min(block, 1 << max(0, (dim - 1).bit_length())))

    cfg = dict(block_m=16, chunk=fit(64, I), block_k=fit(128, H), block_h=fit(128, H), tma=True)
    cfg.update(override)
    return MlpConfig(**cfg)


# (M, H, I): (chunk, block_k, block_h, num_warps, num_stages, reduce_block, reduce_chunks, us, unfused_us, tma), from
# tests/gpu/mlp_sweep.py on the H200 (cold weights; the unfused chain is cuBLAS gate/up, Inductor's silu-mul
# and cuBLAS down). Empty until measured: every shape stays on the unfused path.
_MEASURED: dict[tuple[int, int, int], tuple] = {}
WIN_MARGIN = 0.98  # the fused MLP must be >= 2% faster than the chain (the sweep's run-to-run noise is ~1%)


def register_mlp_tiles(rows) -> int:
    """Add sweep results (the dicts ``tests/gpu/mlp_sweep.py`` writes: ``M, H, I, unfused_us`` and ``best``
    with the ``MlpConfig`` fields and ``us``) to the measured table; later rows replace earlier ones of the
    same (M, H, I). A row that also timed the layer's residual add + RMSNorm in front (``unfused_norm_us`` and
    ``best_norm``) is judged by that pair: a round's MLPs (the target's, the head's) have the norm there and the
    op takes it in. Returns how many were added."""
    added = 0
    for r in rows:
        best = r.get("best")
        if r.get("best_norm") and r.get("unfused_norm_us") is not None:
            best, r = r["best_norm"], dict(r, unfused_us=r["unfused_norm_us"])
        if not best:
            continue
        M, H, I = int(r["M"]), int(r["H"]), int(r["I"])
        fields = {f: int(best[f]) for f in MlpConfig.__dataclass_fields__ if f in best and f != "tma"}
        cfg = MlpConfig(**fields, tma=bool(best.get("tma", False)))
        _check_config(cfg, M)
        _MEASURED[(M, H, I)] = (
            cfg.chunk, cfg.block_k, cfg.block_h, cfg.num_warps, cfg.num_stages, cfg.reduce_block,
            cfg.reduce_chunks, float(best["us"]), float(r["unfused_us"]), cfg.tma,
        )  # fmt: skip
        added += 1
    return added


def measured_mlp_tiles(M: int, H: int, I: int) -> MlpConfig | None:
    """The swept tiles for this shape when the sweep found the fused MLP faster than the unfused chain, else
    None. The smallest swept M of the same (H, I) at or above M stands in for M: never an entry swept at fewer
    rows, since the workspace (I / chunk x M x H float32) grows with M and at 16 rows of the 8B MLP is ~59 MB,
    more than L2; and 1 row stands only for itself (a decode's stream differs from a lane step's)."""
    if not 1 <= M <= MAX_ROWS:
        return None
    swept = [(m, v) for (m, h, i), v in _MEASURED.items() if h == H and i == I and m >= M and (m == 1) == (M == 1)]
    if not swept:
        return None
    _, entry = min(swept, key=lambda item: item[0])
    chunk, block_k, block_h, warps, stages, reduce_block, reduce_chunks, us, unfused_us, tma = entry
    if us > WIN_MARGIN * unfused_us:
        return None
    return MlpConfig(16, chunk, block_k, block_h, warps, stages, reduce_block, reduce_chunks, tma)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernels
# --------------------------------------------------------------------------------------------------


def _launch_fused_mlp(
    x, gate, up, down, out, config: MlpConfig | None = None, norm_weight=None, residual=None, eps: float = 0.0
) -> None:  # fmt: skip
    """Both kernels of one call: the chunk kernel writes ``ws [I / chunk, M, H]`` float32, the reduce kernel
    sums it into ``out``. Under PDL (Hopper) each waits for the kernel before it, then lets the next launch."""
    M, H = x.shape
    I = gate.shape[0]
    cfg = config or measured_mlp_tiles(M, H, I) or choose_mlp_config(M, H, I)
    _check_config(cfg, M)
    chunks = triton.cdiv(I, cfg.chunk)
    ws = torch.empty((chunks, M, H), dtype=torch.float32, device=x.device)
    pdl = pdl_enabled(x.device)  # never on the CPU or in the interpreter
    extra = dict(launch_pdl=True) if pdl else {}
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    norm = norm_weight is not None
    tma = cfg.tma and tma_weights_ok(gate, up, down)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        g_desc = TensorDescriptor(gate, [I, H], [gate.stride(0), 1], [cfg.chunk, cfg.block_k])
        u_desc = TensorDescriptor(up, [I, H], [up.stride(0), 1], [cfg.chunk, cfg.block_k])
        d_desc = TensorDescriptor(down, [H, I], [down.stride(0), 1], [cfg.block_h, cfg.chunk])
    else:  # unused (TMA=False)
        g_desc, u_desc, d_desc = gate, up, down
    _mlp_chunk_kernel[(chunks,)](
        x, gate, up, down, ws, g_desc, u_desc, d_desc,
        norm_weight if norm else x, residual if residual is not None else x, float(eps),
        M, H, I, x.stride(0), gate.stride(0), up.stride(0), down.stride(0),
        norm_weight.stride(0) if norm else 0, residual.stride(0) if residual is not None else 0,
        NORM=norm, HAS_RESIDUAL=residual is not None, TMA=tma, EVEN_H=H % cfg.block_k == 0,
        EVEN_I=I % cfg.chunk == 0, EVEN_OUT=H % cfg.block_h == 0, PREC=prec,
        USE_PDL=pdl, BLOCK_M=cfg.block_m, CHUNK=cfg.chunk, BLOCK_K=cfg.block_k, BLOCK_H=cfg.block_h,
        STAGES=cfg.num_stages, num_warps=cfg.num_warps, **extra,
    )  # fmt: skip
    step = cfg.reduce_chunks or min(256, triton.next_power_of_2(chunks))
    _mlp_reduce_kernel[(triton.cdiv(H, cfg.reduce_block), M)](
        ws, out, M, H, chunks, out.stride(0), USE_PDL=pdl, BLOCK=cfg.reduce_block, CHUNKS=step,
        num_warps=4, **extra,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _mlp_chunk_kernel(
        x, wg, wu, wd, ws, g_desc, u_desc, d_desc, nw, res, eps, M, H, I, s_xm, s_wg, s_wu, s_wd, s_nw, s_rm,
        NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, TMA: tl.constexpr,
        EVEN_H: tl.constexpr, EVEN_I: tl.constexpr, EVEN_OUT: tl.constexpr, PREC: tl.constexpr,
        USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_H: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        """Program c: intermediate features j = [c * CHUNK, +CHUNK). Gate and up rows j stream over H in
        BLOCK_K steps into two [BLOCK_M, CHUNK] float32 accumulators; h = silu(g) * u (rounded as the
        unfused path rounds); then the down projection's columns j stream over the H outputs in BLOCK_H
        steps, each step's [BLOCK_M, BLOCK_H] product stored to this program's partial ws[c] (float32).

        TMA: each gate / up / down tile is one box of its descriptor (zero past the weight's edge, so padded
        features and tail steps read zeros), moved into shared memory by the copy engine.

        NORM: the x tile of a step is s = x (+ residual, rounded to x's dtype), fed as norm_weight * s; the
        row's sum of s^2 accumulates over the same steps, and the gate / up accumulators are scaled by
        rsqrt(mean(s^2) + eps) after the loop (the module docstring's identity)."""
        c = tl.program_id(0)
        rj = c * CHUNK + tl.arange(0, CHUNK)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        j_ok = rj < I
        # Rows past M / I read row 0 (in bounds) instead of a masked load: the hot loops carry only their
        # own tail mask, and padded rows are dropped at the store (a padded feature j's h is zeroed below).
        rj_in = tl.where(j_ok, rj, 0).to(tl.int64)
        rm_in = tl.where(m_ok, rm, 0).to(tl.int64)
        x_ptrs = x + rm_in[:, None] * s_xm + rk[None, :]
        r_ptrs = res + rm_in[:, None] * s_rm + rk[None, :]
        n_ptrs = nw + rk * s_nw
        g_ptrs = wg + rj_in[:, None] * s_wg + rk[None, :]
        u_ptrs = wu + rj_in[:, None] * s_wu + rk[None, :]
        if USE_PDL:  # TREECOMPILE_PDL: wait for the previous kernel (x is its output), then let the next launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        dtype = x.dtype.element_ty
        acc_g = tl.zeros((BLOCK_M, CHUNK), tl.float32)
        acc_u = tl.zeros((BLOCK_M, CHUNK), tl.float32)
        sum_sq = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            if TMA:
                gt = g_desc.load([c * CHUNK, k0])
                ut = u_desc.load([c * CHUNK, k0])
            if EVEN_H:
                xt = tl.load(x_ptrs)
                if not TMA:
                    gt = tl.load(g_ptrs)
                    ut = tl.load(u_ptrs)
                if HAS_RESIDUAL:
                    xt = (xt.to(tl.float32) + tl.load(r_ptrs).to(tl.float32)).to(dtype)
                if NORM:
                    nt = tl.load(n_ptrs).to(tl.float32)
            else:
                k_ok = (k0 + rk) < H
                xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                if not TMA:
                    gt = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0)
                    ut = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0)
                if HAS_RESIDUAL:
                    xt = (xt.to(tl.float32) + tl.load(r_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)).to(dtype)
                if NORM:
                    nt = tl.load(n_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                sf = xt.to(tl.float32)
                sum_sq += tl.sum(sf * sf, axis=1)
                xt = (sf * nt[None, :]).to(dtype)
            acc_g = tl.dot(xt, tl.trans(gt), acc_g, input_precision=PREC)
            acc_u = tl.dot(xt, tl.trans(ut), acc_u, input_precision=PREC)
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            n_ptrs += BLOCK_K * s_nw
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if NORM:
            scale = tl.rsqrt(sum_sq / H + eps)[:, None]  # [BLOCK_M, 1]: the row's norm, applied after the sums
            acc_g *= scale
            acc_u *= scale
        g = acc_g.to(dtype).to(tl.float32)  # the gate/up GEMM's output dtype
        u = acc_u.to(dtype).to(tl.float32)
        h = (g / (1.0 + tl.exp(-g)) * u).to(dtype)  # silu(g) * u, one rounding (Inductor's silu-mul)
        if not EVEN_I:
            h = tl.where(j_ok[None, :], h, tl.zeros_like(h))  # padded features add nothing
        rh = tl.arange(0, BLOCK_H)
        d_ptrs = wd + rh.to(tl.int64)[:, None] * s_wd + rj_in[None, :]
        w_ptrs = ws + c.to(tl.int64) * M * H + rm.to(tl.int64)[:, None] * H + rh[None, :]
        for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
            if EVEN_OUT:
                if TMA:
                    dt = d_desc.load([h0, c * CHUNK])
                else:
                    dt = tl.load(d_ptrs)
                part = tl.dot(h, tl.trans(dt), input_precision=PREC)
                tl.store(w_ptrs, part, mask=m_ok[:, None])
            else:
                h_ok = (h0 + rh) < H
                if TMA:
                    dt = d_desc.load([h0, c * CHUNK])
                else:
                    dt = tl.load(d_ptrs, mask=h_ok[:, None], other=0.0)
                part = tl.dot(h, tl.trans(dt), input_precision=PREC)
                tl.store(w_ptrs, part, mask=m_ok[:, None] & h_ok[None, :])
            d_ptrs += BLOCK_H * s_wd
            w_ptrs += BLOCK_H

    @triton.jit
    def _mlp_reduce_kernel(
        ws, out, M, H, chunks, s_om, USE_PDL: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr
    ):  # fmt: skip
        """Program (n block, row m): out[m, n block] = sum over c of ws[c, m, n block], CHUNKS partials a step
        in slice order (the same sum on every run), rounded once to out's dtype."""
        rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = tl.program_id(1)
        n_ok = rn < H
        rc = tl.arange(0, CHUNKS)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK,), tl.float32)
        ptrs = ws + rc.to(tl.int64)[:, None] * M * H + m * H + rn[None, :]
        for c0 in range(0, chunks, CHUNKS):
            ok = ((c0 + rc) < chunks)[:, None] & n_ok[None, :]
            acc += tl.sum(tl.load(ptrs, mask=ok, other=0.0), axis=0)
            ptrs += CHUNKS * M * H
        tl.store(out + m * s_om + rn, acc.to(out.dtype.element_ty), mask=n_ok)


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def fused_mlp_reference(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
    norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """The CPU path and the test oracle: the unfused MLP, rounded as the fused kernel rounds (g and u to x's
    dtype, ``silu(g) * u`` computed in float32 or wider and rounded once); with ``norm_weight``, first HF's
    ``LlamaRMSNorm`` of ``x (+ residual)``."""
    wide = torch.promote_types(x.dtype, torch.float32)
    if norm_weight is not None:
        s = x if residual is None else x + residual
        s = s.to(wide)
        x = norm_weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    g, u = F.linear(x, gate), F.linear(x, up)
    h = (F.silu(g.to(wide)) * u.to(wide)).to(x.dtype)
    return F.linear(h, down)
