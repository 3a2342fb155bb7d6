"""Mamba2 tree verify in the chunked (SSD) form: every node of a tree of up to 64 nodes at once.

Same op contract as ``treespec::mamba2_tree_verify`` (ops/mamba2_tree.py): per-node outputs, the same
replay payload rows ``[x | dt | a | B]`` (consumed by ``mamba2_replay_commit``), the state pool only
read. The sequential kernel walks the nodes one by one and, at a branch, replays the parent's
ancestors; its latency grows with the node count and the branches' depths. Here no node state is ever
formed: one program per (request, head, head-dim slice) does a few small matrix products over all
nodes, so a tree costs what a chain of the same node count costs.

Derivation (per request and head h, group g; the update of ops/mamba2_tree.py)
-------------------------------------------------------------------------
Node i starts from its parent's state (the committed S0 for a root):
``S_i = e^{a_i} S_parent + dt_i x_i (x) B_i`` and ``y_i = S_i C_i + D x_i``. Let anc(i) be the
ancestors-or-self of i and, for j in anc(i), ``seg(i, j) = sum of a_l over l in anc(i) \\ anc(j)``
(the decay from j's update to i's). Unrolling along the root-to-i path (a chain, so the SSD quadratic
form of the Mamba2 paper applies unchanged with the causal mask replaced by the ancestor mask):

    S_i = e^{seg(i, -)} S0 + sum_{j in anc(i)} e^{seg(i, j)} dt_j x_j (x) B_j
    y_i = e^{G_i} (S0 C_i) + sum_{j in anc(i)} e^{seg(i, j)} dt_j (C_i . B_j) x_j + D x_i

with ``G_i = sum_{l in anc(i)} a_l``. In matrices over the nodes: ``L = M * exp(SEG) * (C B^T) * dt``
(M the ancestor mask), ``Y = L X + e^G * (C S0^T) + D X``. ``seg`` is summed directly over the path
nodes (one product ``(M * a) (1 - M)^T``), never as a difference of two long cumulative sums, so strongly
negative decays lose no precision (the reason HF's and the paper's ``segsum`` mask before summing).

The ancestor mask comes from the parents by repeated squaring of ``I + parent edge`` (a boolean matrix
product per doubling: log2(64) = 6 small products), so parents need no host-side preprocessing.

Shapes (as ``mamba2_tree_verify``)
------
x           [B, N, H, P]     any float dtype, any strides; 1 <= N <= 64
dt          [B, N, H]        raw time step (before dt_bias and softplus)
A           [H]; B, C [B, N, G, S_n]; D, dt_bias [H] or None
state       [B, H, P, S_n]   fp32 (fp64 accepted on CPU); read only
parents     int64 [B, N]     ``parents[b, 0] == -1`` and ``parents[b, t] < t``
payload     [B, >=N, W]      state dtype; rows < N written as by ``mamba2_tree_verify``
y           [B, N, H, P]     dtype of x

``torch.ops.treespec.mamba2_tree_verify_chunked(x, dt, A, B, C, D, dt_bias, state, parents, payload,
dt_softplus, dt_min, dt_max) -> y`` (mutates payload)

Checks are metadata only (no host sync); parent values are clamped to [-1, t - 1] and not checked. The
CPU path is the chunked reference below in the state's dtype: within rounding of HF's token-by-token
decode, not bitwise equal to it (``mamba2_tree_verify``'s fp32 CPU path is). The kernel's fp32 products
run as three TF32 tensor-core products each ("tf32x3": fp32-level accuracy; one TF32 product would cost
~1e-3 relative error). The 0/1 ancestor products are exact in fp16.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ._common import HAS_TRITON, use_triton
from .mamba2_tree import (
    _check_inputs,
    _check_payload,
    _limits,
    _payload_offsets,
    _present,
    _process_dt,
)
from .tree_mask import build_ancestor_mask_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mamba2_tree import _softplus

logger = logging.getLogger(__name__)

__all__ = ["mamba2_tree_verify_chunked", "mamba2_tree_verify_chunked_reference"]


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::mamba2_tree_verify_chunked", mutates_args=("payload",))
def mamba2_tree_verify_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    state: torch.Tensor,
    parents: torch.Tensor,
    payload: torch.Tensor,
    dt_softplus: bool = True,
    dt_min: Optional[float] = None,
    dt_max: Optional[float] = None,
) -> torch.Tensor:
    """Per-node Mamba2 outputs of a tree in the chunked form: ``-> y [B, N, H, P]`` (module docstring)."""
    _check_inputs(x, dt, A, B, C, D, dt_bias, state, parents)
    _check_payload(payload, x, B, state)
    if use_triton(*_present(x, dt, A, B, C, D, dt_bias, state, parents, payload)):
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch_mamba2_tree_verify_chunked(
            x, dt, A, B, C, D, dt_bias, state, parents, payload, y, dt_softplus, dt_min, dt_max
        )
        return y
    return mamba2_tree_verify_chunked_reference(
        x, dt, A, B, C, D, dt_bias, state, parents, payload, dt_softplus, dt_min, dt_max
    )


@mamba2_tree_verify_chunked.register_fake
def _(x, dt, A, B, C, D, dt_bias, state, parents, payload, dt_softplus=True, dt_min=None, dt_max=None):
    _check_inputs(x, dt, A, B, C, D, dt_bias, state, parents)
    _check_payload(payload, x, B, state)
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def _launch_mamba2_tree_verify_chunked(
    x, dt, A, B, C, D, dt_bias, state, parents, payload, y, dt_softplus, dt_min, dt_max,
    block_p: Optional[int] = None, num_warps: int = 4, precision: str = "tf32x3",
) -> None:  # fmt: skip
    """Fill ``y`` and the payload rows < N. Grid: (B, H, P blocks); ``block_p`` a power of two >= 16;
    ``precision`` the fp32 products' ``input_precision`` (default "tf32x3")."""
    batch, num_nodes, num_heads, head_dim = x.shape
    n_groups, state_size = B.shape[2:]
    if batch == 0 or num_heads == 0 or head_dim == 0:
        return
    block_n = max(16, triton.next_power_of_2(num_nodes))
    block_s = min(max(16, triton.next_power_of_2(state_size)), 64)  # S_n runs in chunks of <= 64
    # Defaults from the H200 sweep at Mamba2-2.7B shapes (tests/gpu/m2_sweep.py, BENCHMARKS.md "Linear"):
    # 32-wide head-dim slices on one warpgroup, fp32 products as three TF32 tensor-core products ("tf32x3",
    # fp32-level accuracy; the FMA path "ieee" took 87-124 us at N=64 against 23 us, plain "tf32" 16 us at
    # ~1e-3 relative error).
    if block_p is None:
        block_p = min(max(16, triton.next_power_of_2(head_dim)), 32)
    dt_off, a_off, b_off = _payload_offsets(num_heads, head_dim)
    has_d, has_bias = D is not None, dt_bias is not None
    _mamba2_tree_verify_chunked_kernel[(batch, num_heads, triton.cdiv(head_dim, block_p))](
        x, dt, A, B, C, D if has_d else A, dt_bias if has_bias else A, state, parents, payload, y,
        num_nodes, *_limits(dt_min, dt_max),
        *x.stride(), *dt.stride(), A.stride(0), *B.stride(), *C.stride(),
        D.stride(0) if has_d else 0, dt_bias.stride(0) if has_bias else 0,
        *state.stride(), *parents.stride(), *payload.stride(), *y.stride(),
        GROUP=num_heads // n_groups, P=head_dim, SN=state_size,
        DT_OFF=dt_off, A_OFF=a_off, B_OFF=b_off,
        HAS_D=has_d, HAS_DT_BIAS=has_bias, SOFTPLUS=bool(dt_softplus),
        BLOCK_N=block_n, BLOCK_P=block_p, BLOCK_S=block_s, DOUBLINGS=(block_n - 1).bit_length(),
        PRECISION=precision, num_warps=num_warps,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _mamba2_tree_verify_chunked_kernel(
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, parents_ptr, payload_ptr, y_ptr,
        num_nodes, dt_lo_head, dt_lo_tail, dt_hi_head, dt_hi_tail,
        s_xb, s_xn, s_xh, s_xp,
        s_db, s_dn, s_dh,
        s_ah,
        s_Bb, s_Bn, s_Bg, s_Bs,
        s_Cb, s_Cn, s_Cg, s_Cs,
        s_Dh, s_biash,
        s_sb, s_sh, s_sp, s_ss,
        s_pb, s_pn,
        s_fb, s_fn, s_fw,
        s_yb, s_yn, s_yh, s_yp,
        GROUP: tl.constexpr, P: tl.constexpr, SN: tl.constexpr,
        DT_OFF: tl.constexpr, A_OFF: tl.constexpr, B_OFF: tl.constexpr,
        HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, DOUBLINGS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # One program per (request, head, head-dim slice) holds every node as one padded [BLOCK_N] tile
        # and runs the module docstring's quadratic form (the SSD "diagonal block" of the Mamba2 paper
        # and of mamba_ssm's chunk_scan, with the ancestor mask in place of the causal one).
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        pb = tl.program_id(2)
        g = h // GROUP
        nn = tl.arange(0, BLOCK_N)
        live = nn < num_nodes
        rows = nn[:, None]
        cols = nn[None, :]
        pp = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        pm = pp < P
        acc_ty = state_ptr.dtype.element_ty

        # Per-node dt and log decay a = dt * A; padded nodes get dt = 0 (they add nothing).
        dt_lo = (tl.zeros((), acc_ty) + dt_lo_head) + dt_lo_tail  # float64-exact in float64 (_common.float_pair)
        dt_hi = (tl.zeros((), acc_ty) + dt_hi_head) + dt_hi_tail
        A_h = tl.load(A_ptr + h * s_ah).to(acc_ty)
        dt_n = tl.load(dt_ptr + b * s_db + nn * s_dn + h * s_dh, mask=live, other=0.0).to(acc_ty)
        if HAS_DT_BIAS:
            dt_n = dt_n + tl.load(bias_ptr + h * s_biash).to(acc_ty)
        if SOFTPLUS:
            dt_n = _softplus(dt_n)
        # where, not min/max: a NaN dt stays NaN, as torch.clamp leaves it
        dt_n = tl.where(dt_n < dt_lo, dt_lo, dt_n)
        dt_n = tl.where(dt_n > dt_hi, dt_hi, dt_n)
        dt_n = tl.where(live, dt_n, 0.0)
        a_n = dt_n * A_h

        # Ancestor-or-self mask M[i, j] by doubling: R = I + parent edge; R <- (R R > 0) covers paths of
        # up to 2^k edges after k products. 0/1 entries and sums <= 64 are exact in fp16 with fp32 sums.
        par = tl.load(parents_ptr + b * s_pb + nn * s_pn, mask=live, other=-1)
        par = tl.minimum(tl.maximum(par, -1), nn - 1)  # stay acyclic on non-trees
        reach = ((rows == cols) | (par[:, None] == cols)) & live[:, None]
        R = reach.to(tl.float16)
        for _ in tl.static_range(DOUBLINGS):
            R = (tl.dot(R, R, out_dtype=tl.float32) > 0.5).to(tl.float16)
        anc = R > 0.5  # [i, j]
        anc_f = anc.to(acc_ty)

        # seg(i, j) = sum_l M[i, l] a_l (1 - M[j, l]): the decay from node j's update to node i's.
        M_a = anc_f * a_n[None, :]
        G = tl.sum(M_a, 1)
        seg = tl.dot(M_a, tl.trans(1.0 - anc_f), input_precision=PRECISION)
        decay = tl.where(anc, tl.exp(tl.where(anc, seg, 0.0)), 0.0)

        # C B^T [i, j] and C S0^T [i, p] over S_n in chunks.
        CB = tl.zeros((BLOCK_N, BLOCK_N), dtype=acc_ty)
        CS = tl.zeros((BLOCK_N, BLOCK_P), dtype=acc_ty)
        C_rows = C_ptr + b * s_Cb + g * s_Cg + rows * s_Cn
        B_rows = B_ptr + b * s_Bb + g * s_Bg + rows * s_Bn
        S_rows = state_ptr + b * s_sb + h * s_sh + pp[:, None] * s_sp
        payload_rows = payload_ptr + b * s_fb + rows * s_fn
        out_ty = payload_ptr.dtype.element_ty
        for s0 in tl.static_range(0, SN, BLOCK_S):
            ss = s0 + tl.arange(0, BLOCK_S)
            sm = ss < SN
            node_mask = live[:, None] & sm[None, :]
            C_t = tl.load(C_rows + ss[None, :] * s_Cs, mask=node_mask, other=0.0).to(acc_ty)
            B_t = tl.load(B_rows + ss[None, :] * s_Bs, mask=node_mask, other=0.0).to(acc_ty)
            S0 = tl.load(S_rows + ss[None, :] * s_ss, mask=pm[:, None] & sm[None, :], other=0.0).to(acc_ty)
            CB += tl.dot(C_t, tl.trans(B_t), input_precision=PRECISION)
            CS += tl.dot(C_t, tl.trans(S0), input_precision=PRECISION)
            if pb == 0:
                if h % GROUP == 0:  # one writer per group for the B part of each payload row
                    tl.store(payload_rows + (B_OFF + g * SN + ss[None, :]) * s_fw, B_t.to(out_ty), mask=node_mask)

        x_mask = live[:, None] & pm[None, :]
        X = tl.load(x_ptr + b * s_xb + rows * s_xn + h * s_xh + pp[None, :] * s_xp, mask=x_mask, other=0.0)
        X = X.to(acc_ty)
        L = decay * CB * dt_n[None, :]
        Y = tl.dot(L, X, input_precision=PRECISION) + tl.exp(G)[:, None] * CS
        if HAS_D:
            Y = Y + X * tl.load(D_ptr + h * s_Dh).to(acc_ty)
        tl.store(y_ptr + b * s_yb + rows * s_yn + h * s_yh + pp[None, :] * s_yp, Y.to(y_ptr.dtype.element_ty), mask=x_mask)

        # Replay payload: x (this slice), and dt, a once per head. Each element has exactly one writer.
        tl.store(payload_rows + (h * P + pp[None, :]) * s_fw, X.to(out_ty), mask=x_mask)
        if pb == 0:
            node_rows = payload_ptr + b * s_fb + nn * s_fn
            tl.store(node_rows + (DT_OFF + h) * s_fw, dt_n.to(out_ty), mask=live)
            tl.store(node_rows + (A_OFF + h) * s_fw, a_n.to(out_ty), mask=live)


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle of the chunked math)
# --------------------------------------------------------------------------------------------------


def mamba2_tree_verify_chunked_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    state: torch.Tensor,
    parents: torch.Tensor,
    payload: torch.Tensor,
    dt_softplus: bool = True,
    dt_min: Optional[float] = None,
    dt_max: Optional[float] = None,
) -> torch.Tensor:
    """Pure-torch chunked tree verify in the state's dtype; writes the same payload rows as the kernel.

    The module docstring's matrices, vectorised over requests and heads; it never forms a node state.
    """
    batch, num_nodes, num_heads, head_dim = x.shape
    n_groups = B.shape[2]
    group = num_heads // n_groups
    acc = state.dtype
    xf = x.to(acc)
    dtf = _process_dt(dt.to(acc), dt_bias, dt_softplus, dt_min, dt_max)  # [B, N, H]
    af = dtf * A.to(acc)

    node = torch.arange(num_nodes, device=parents.device)
    words, _ = build_ancestor_mask_reference(torch.minimum(parents.clamp(min=-1), node - 1))  # as the kernel
    anc = ((words[:, :, None] >> node) & 1).bool() & (node[None, :] <= node[:, None])  # [B, i, j]
    anc_f = anc.to(acc)[:, None]  # [B, 1, i, j]
    a_h = af.transpose(1, 2)  # [B, H, N]
    M_a = anc_f * a_h[:, :, None, :]  # [B, H, i, l]
    G = M_a.sum(-1)  # [B, H, i]
    seg = M_a @ (1 - anc_f).transpose(-1, -2)  # [B, H, i, j]
    decay = torch.where(anc[:, None], torch.exp(torch.where(anc[:, None], seg, 0)), 0)

    C_h = C.to(acc).repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, N, S_n]
    B_h = B.to(acc).repeat_interleave(group, dim=2).transpose(1, 2)
    X = xf.transpose(1, 2)  # [B, H, N, P]
    L = decay * (C_h @ B_h.transpose(-1, -2)) * dtf.transpose(1, 2)[:, :, None, :]
    CS = C_h @ state.to(acc).transpose(-1, -2)  # [B, H, N, P]
    Y = L @ X + G.exp()[..., None] * CS
    if D is not None:
        Y = Y + X * D.to(acc)[None, :, None, None]

    row = torch.cat([xf.reshape(batch, num_nodes, -1), dtf, af, B.to(acc).reshape(batch, num_nodes, -1)], dim=-1)
    payload[:, :num_nodes].copy_(row)
    return Y.transpose(1, 2).contiguous().to(x.dtype)
