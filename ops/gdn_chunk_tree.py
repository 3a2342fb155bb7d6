"""Gated delta rule (GDN) tree verify in the chunked (WY) form: every node of a small tree at once.

Same op contract as ``treespec::gdn_tree_verify`` (ops/gdn_tree.py) for trees of at most 16 nodes, but
no node state is ever formed or kept: no workspace, one pass of small matrix products per (request,
value head). The seed runs GDN trees of 8 to 16 nodes this way (GDN_TREE_VERIFY_CHUNKED_MIN/MAX_NODES);
the op itself takes any tree of 1..16 nodes. Verify writes the same replay payload rows as
``gdn_tree_verify`` (``[k | v | g | beta]``, consumed by ``gdn_replay_commit``) and never the state pool.

Derivation (per request and value head; q, k already l2-normalised and q scaled as in gdn_tree.py)
-----------------------------------------------------------------------------------------------
The sequential rule, node i starting from its parent's state S_p (the committed S0 for a root):

    S_i = e^{g_i} S_p + k_i (x) u_i,    u_i = beta_i (v_i - k_i^T e^{g_i} S_p),    o_i = q_i^T S_i

Let anc(i) be the ancestors-or-self of i and G_i = sum of g over anc(i) (G_i = g_i + G_parent, 0 above
a root). Unrolling along the root-to-i path (a chain, so the chain's WY form applies unchanged):

    S_i = e^{G_i} S0 + sum_{j in anc(i)} e^{G_i - G_j} k_j (x) u_j

Substituting S_p of i into u_i gives a unit lower-triangular system over the N nodes,

    u_i + sum_{j strict anc of i} A_ij u_j = beta_i (v_i - e^{G_i} k_i^T S0),
    A_ij = beta_i (k_i . k_j) e^{G_i - G_j}

i.e. (I + A) U = beta * (V - e^G * K S0), lower triangular because parents have lower indices; it is
solved by forward substitution over the (at most 16) rows. Then

    o_i = e^{G_i} q_i^T S0 + sum_{j in anc(i)} (q_i . k_j) e^{G_i - G_j} u_j.

This is flash-linear-attention's chunk_gated_delta_rule / the DeltaNet paper's WY form for one chunk
with the causal mask replaced by the ancestor mask and the cumulative decay taken along the ancestor
path. G_i - G_j is summed directly over the path nodes strictly below j (``sum_l [l in anc(i) \\ anc(j)]
g_l``), never by subtracting two long cumulative sums, so strongly negative g loses no precision.

Shapes (as ``gdn_tree_verify``, minus the workspace)
------
q, k        [B, N, Hk, Dk]   any float dtype, any strides; 1 <= N <= 16
v           [B, N, Hv, Dv]   Hv % Hk == 0 (GQA: consecutive value heads share a key head)
g, beta     [B, N, Hv]       log decay and write strength
state       [B, Hv, Dk, Dv]  committed state, fp32 (fp64 accepted on CPU); read only
parents     int64 [B, N]     ``parents[b, 0] == -1`` and ``parents[b, t] < t``
payload     [B, >=N, W]      state dtype; rows < N written as by ``gdn_tree_verify``, rows >= N untouched
o           [B, N, Hv, Dv]   dtype of q

``torch.ops.treespec.gdn_tree_verify_chunked(q, k, v, g, beta, state, parents, payload, scale,
use_qk_l2norm) -> o`` (mutates payload)

Checks are metadata only (no host sync); ``parents`` values are not checked (a non-tree touches no
memory out of bounds; its output is unspecified). The CPU path is the chunked reference below, in the
state's dtype; it is not bitwise equal to HF's token-by-token decode (``gdn_tree_verify``'s fp32 CPU
path is), only within fp32 rounding of it.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ._common import HAS_TRITON, check_dim, check_same_device, float_pair, use_triton
from .gdn_tree import _check_inputs, _l2norm, _payload_offsets, gdn_payload_width
from .tree_mask import build_ancestor_mask_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = [
    "gdn_tree_verify_chunked",
    "gdn_tree_verify_chunked_reference",
    "CHUNKED_MAX_NODES",
]

CHUNKED_MAX_NODES = 16  # one padded 16-row tile per program (the smallest tl.dot tile)


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::gdn_tree_verify_chunked", mutates_args=("payload",))
def gdn_tree_verify_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parents: torch.Tensor,
    payload: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Per-node GDN outputs of a tree of <= 16 nodes, chunked form: ``-> o [B, N, Hv, Dv]``."""
    _check_chunked(q, k, v, g, beta, state, parents, payload)
    if use_triton(q, k, v, g, beta, state, parents, payload):
        batch, num_nodes = parents.shape
        o = torch.empty((batch, num_nodes, v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
        _launch_gdn_tree_verify_chunked(q, k, v, g, beta, state, parents, payload, o, scale, use_qk_l2norm)
        return o
    return gdn_tree_verify_chunked_reference(q, k, v, g, beta, state, parents, payload, scale, use_qk_l2norm)


@gdn_tree_verify_chunked.register_fake
def _(q, k, v, g, beta, state, parents, payload, scale=None, use_qk_l2norm=True):
    _check_chunked(q, k, v, g, beta, state, parents, payload)
    return q.new_empty((parents.shape[0], parents.shape[1], v.shape[2], v.shape[3]))


# --------------------------------------------------------------------------------------------------
# Validation (metadata only: no host sync)
# --------------------------------------------------------------------------------------------------


def _check_chunked(q, k, v, g, beta, state, parents, payload) -> None:
    _check_inputs(q, k, v, g, beta, state, parents)
    batch, num_nodes = parents.shape
    if num_nodes > CHUNKED_MAX_NODES:
        raise ValueError(
            f"q: the chunked GDN tree verify takes 1..{CHUNKED_MAX_NODES} tree nodes, got N = {num_nodes} "
            f"(use treespec::gdn_tree_verify for larger trees)"
        )
    check_dim("payload", payload, 3, "[B, N, W]")
    width = gdn_payload_width(q.shape[2], q.shape[3], v.shape[2], v.shape[3])
    if payload.shape[0] != batch or payload.shape[1] < num_nodes or payload.shape[2] != width:
        raise ValueError(
            f"payload: expected [B={batch}, >= N={num_nodes}, W={width}] (W = Hk*Dk + Hv*Dv + 2*Hv), "
            f"got {tuple(payload.shape)}"
        )
    if payload.dtype != state.dtype:
        raise ValueError(f"payload: dtype {payload.dtype} must equal the state dtype {state.dtype}")
    check_same_device(payload=payload, state=state)


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------


def _launch_gdn_tree_verify_chunked(
    q, k, v, g, beta, state, parents, payload, o, scale, use_qk_l2norm, block_v: Optional[int] = None,
    precision: str = "ieee",
) -> None:
    """Fill ``o`` and the payload rows < N. Grid: (B, Hv, Dv blocks); ``block_v`` a power of two >= 16;
    ``precision`` the products' ``input_precision``: "ieee" (FMA units) or "tf32x3" (three TF32 tensor-core
    products, fp32-level accuracy; 3.7x faster for the Mamba2 chunked kernel on the H200, not yet measured
    here, so not the default)."""
    batch, num_nodes, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[2:]
    if batch == 0 or num_v_heads == 0 or head_v_dim == 0:
        return
    block_k = max(16, triton.next_power_of_2(head_k_dim))
    if block_v is None:
        # Small value slices: more programs for small batches, and the [Dk, BLOCK_V] state tile stays
        # modest in registers (a tree of <= 16 nodes is latency-bound, not bandwidth-bound).
        block_v = min(max(16, triton.next_power_of_2(head_v_dim)), 32)
    v_off, g_off, beta_off = _payload_offsets(num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    _gdn_tree_verify_chunked_kernel[(batch, num_v_heads, triton.cdiv(head_v_dim, block_v))](
        q, k, v, g, beta, state, parents, payload, o,
        num_nodes, *float_pair(float(head_k_dim**-0.5 if scale is None else scale)),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        *state.stride(), *parents.stride(), *payload.stride(), *o.stride(),
        GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        V_OFF=v_off, G_OFF=g_off, BETA_OFF=beta_off, USE_L2NORM=bool(use_qk_l2norm),
        BLOCK_N=CHUNKED_MAX_NODES, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision,
        num_warps=4,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _gdn_tree_verify_chunked_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, parents_ptr, payload_ptr, o_ptr,
        num_nodes, scale_head, scale_tail,
        s_qb, s_qn, s_qh, s_qd,
        s_kb, s_kn, s_kh, s_kd,
        s_vb, s_vn, s_vh, s_vd,
        s_gb, s_gn, s_gh,
        s_bb, s_bn, s_bh,
        s_sb, s_sh, s_sk, s_sv,
        s_pb, s_pn,
        s_yb, s_yn, s_yw,
        s_ob, s_on, s_oh, s_od,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        V_OFF: tl.constexpr, G_OFF: tl.constexpr, BETA_OFF: tl.constexpr, USE_L2NORM: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # One program per (request, value head, value slice) holds all <= 16 nodes as one padded tile
        # and runs the chunked form of the module docstring (the WY idea of fla's chunk_gated_delta_rule
        # and its solve_tril, with the ancestor mask in place of the causal one). Every matrix product
        # is fp32 (or fp64 in the interpreter), IEEE by default (PRECISION): TF32 would cost ~1e-3 in the outputs.
        b = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        hk = hv // GROUP
        nn = tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        live = nn < num_nodes
        km = kk < DK
        vm = vv < DV
        acc_ty = state_ptr.dtype.element_ty

        # Ancestor-or-self words (bit j of word i: j is i or an ancestor), built in node order so a
        # parent's word is final before its children read it; from registers, so a non-tree parent
        # (unbuilt or out of range) reads an empty word and never memory out of bounds.
        par = tl.load(parents_ptr + b * s_pb + nn * s_pn, mask=live, other=-1)
        words = tl.zeros((BLOCK_N,), dtype=tl.int32)
        for i in tl.static_range(BLOCK_N):
            parent_i = tl.sum(tl.where(nn == i, par, 0), 0)
            parent_word = tl.sum(tl.where(nn == parent_i, words, 0), 0)
            words = tl.where(nn == i, parent_word | (1 << i), words)
        rows = nn[:, None]
        cols = nn[None, :]
        anc = (((words[:, None] >> cols) & 1) != 0) & (cols <= rows) & live[:, None]  # [i, j]
        strict = anc & (cols < rows)

        # Inputs of all nodes: q, k [N, Dk]; v [N, BLOCK_V]; g, beta [N].
        qk_mask = live[:, None] & km[None, :]
        Q = tl.load(q_ptr + b * s_qb + rows * s_qn + hk * s_qh + kk[None, :] * s_qd, mask=qk_mask, other=0.0)
        K = tl.load(k_ptr + b * s_kb + rows * s_kn + hk * s_kh + kk[None, :] * s_kd, mask=qk_mask, other=0.0)
        Q = Q.to(acc_ty)
        K = K.to(acc_ty)
        v_mask = live[:, None] & vm[None, :]
        V = tl.load(v_ptr + b * s_vb + rows * s_vn + hv * s_vh + vv[None, :] * s_vd, mask=v_mask, other=0.0)
        V = V.to(acc_ty)
        g_n = tl.load(g_ptr + b * s_gb + nn * s_gn + hv * s_gh, mask=live, other=0.0).to(acc_ty)
        beta_n = tl.load(beta_ptr + b * s_bb + nn * s_bn + hv * s_bh, mask=live, other=0.0).to(acc_ty)
        if USE_L2NORM:
            Q = Q * (1.0 / tl.sqrt(tl.sum(Q * Q, 1) + 1e-6))[:, None]
            K = K * (1.0 / tl.sqrt(tl.sum(K * K, 1) + 1e-6))[:, None]
        Q = Q * ((tl.zeros((), acc_ty) + scale_head) + scale_tail)  # float64-exact in float64 (_common.float_pair)

        # Replay payload rows (k normalised): each element has exactly one writer program.
        row = payload_ptr + b * s_yb + rows * s_yn
        out_ty = payload_ptr.dtype.element_ty
        tl.store(row + (V_OFF + hv * DV + vv[None, :]) * s_yw, V.to(out_ty), mask=v_mask)
        if vb == 0:
            if hv % GROUP == 0:
                tl.store(row + (hk * DK + kk[None, :]) * s_yw, K.to(out_ty), mask=qk_mask)
            node_row = payload_ptr + b * s_yb + nn * s_yn
            tl.store(node_row + (G_OFF + hv) * s_yw, g_n.to(out_ty), mask=live)
            tl.store(node_row + (BETA_OFF + hv) * s_yw, beta_n.to(out_ty), mask=live)

        # Decay along the ancestor path: G_i = sum_{l in anc(i)} g_l, and for j in anc(i)
        # G_i - G_j = sum_l [l in anc(i)] g_l [l not in anc(j)] as one product (no cancellation).
        anc_f = anc.to(acc_ty)
        G = tl.sum(anc_f * g_n[None, :], 1)
        path_g = tl.dot(anc_f * g_n[None, :], tl.trans(1.0 - anc_f), input_precision=PRECISION)
        decay = tl.where(anc, tl.exp(tl.where(anc, path_g, 0.0)), 0.0)  # [i, j]
        exp_G = tl.exp(G)

        s_mask = km[:, None] & vm[None, :]
        S0 = tl.load(
            state_ptr + b * s_sb + hv * s_sh + kk[:, None] * s_sk + vv[None, :] * s_sv, mask=s_mask, other=0.0
        ).to(acc_ty)
        KS = tl.dot(K, S0, input_precision=PRECISION)  # [N, BLOCK_V]
        QS = tl.dot(Q, S0, input_precision=PRECISION)
        KK = tl.dot(K, tl.trans(K), input_precision=PRECISION)  # [N, N]
        QK = tl.dot(Q, tl.trans(K), input_precision=PRECISION)

        # (I + A) U = rhs; T = (I + A)^{-1} by forward substitution over the rows (A strictly lower):
        # T_i = e_i - sum_{l < i} A_il T_l. Padded rows have A = 0 and leave T = I there.
        A = tl.where(strict, beta_n[:, None] * KK * decay, 0.0)
        T = tl.where(rows == cols, 1.0, 0.0).to(acc_ty)
        for i in tl.static_range(1, BLOCK_N):
            a_i = tl.sum(tl.where(rows == i, A, 0.0), 0)  # row i of A, over l
            T = tl.where(rows == i, T - tl.sum(a_i[:, None] * T, 0)[None, :], T)
        rhs = beta_n[:, None] * (V - exp_G[:, None] * KS)
        U = tl.dot(T, rhs, input_precision=PRECISION)  # [N, BLOCK_V]

        O = exp_G[:, None] * QS + tl.dot(QK * decay, U, input_precision=PRECISION)
        tl.store(
            o_ptr + b * s_ob + rows * s_on + hv * s_oh + vv[None, :] * s_od,
            O.to(o_ptr.dtype.element_ty),
            mask=v_mask,
        )


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle of the chunked math)
# --------------------------------------------------------------------------------------------------


def gdn_tree_verify_chunked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parents: torch.Tensor,
    payload: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Pure-torch chunked tree verify in the state's dtype; writes the same payload rows as the kernel.

    Implements the module docstring's system directly (ancestor mask, path decays, forward substitution
    for U), vectorised over requests and heads; it never forms a node state.
    """
    batch, num_nodes, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[2:]
    group = num_v_heads // num_k_heads
    acc = state.dtype
    qf, kf = q.to(acc), k.to(acc)
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf / head_k_dim**0.5 if scale is None else qf * scale
    vf, gf, bf = v.to(acc), g.to(acc), beta.to(acc)
    Q = qf.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, Hv, N, Dk]
    K = kf.repeat_interleave(group, dim=2).transpose(1, 2)
    V = vf.transpose(1, 2)  # [B, Hv, N, Dv]
    g_n, beta_n = gf.transpose(1, 2), bf.transpose(1, 2)  # [B, Hv, N]

    words, _ = build_ancestor_mask_reference(parents)
    node = torch.arange(num_nodes, device=parents.device)
    anc = ((words[:, :, None] >> node) & 1).bool() & (node[None, :] <= node[:, None])  # [B, i, j]
    strict = anc & (node[None, :] < node[:, None])
    anc_f = anc.to(acc)
    G = torch.einsum("bil,bhl->bhi", anc_f, g_n)
    # G_i - G_j over the path nodes strictly below j: anc(i) minus anc(j).
    path_g = torch.einsum("bil,bhl,bjl->bhij", anc_f, g_n, 1 - anc_f)
    anc_h, strict_h = anc[:, None], strict[:, None]
    decay = torch.where(anc_h, torch.exp(torch.where(anc_h, path_g, 0)), 0)

    S0 = state.to(acc)
    exp_G = G.exp()[..., None]
    rhs = beta_n[..., None] * (V - exp_G * (K @ S0))
    A = torch.where(strict_h, beta_n[..., None] * (K @ K.transpose(-1, -2)) * decay, 0)
    U = torch.zeros_like(rhs)
    for i in range(num_nodes):  # forward substitution: U_i = rhs_i - sum_{j < i} A_ij U_j
        U[:, :, i] = rhs[:, :, i] - (A[:, :, i, :, None] * U).sum(dim=-2)
    O = exp_G * (Q @ S0) + ((Q @ K.transpose(-1, -2)) * decay) @ U  # [B, Hv, N, Dv]

    row = torch.cat([kf.reshape(batch, num_nodes, -1), vf.reshape(batch, num_nodes, -1), gf, bf], dim=-1)
    payload[:, :num_nodes].copy_(row)
    return O.transpose(1, 2).contiguous().to(q.dtype)
