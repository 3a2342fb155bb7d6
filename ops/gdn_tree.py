"""Gated delta rule (GDN: Qwen3-Next, Qwen3.5) over a draft tree: tree verify, replay commit, and the
staged fallback.

The math is HF's ``torch_recurrent_gated_delta_rule`` per node (value head h, key head h // (Hv // Hk)):

    q, k  <- l2norm(q), l2norm(k)         (when use_qk_l2norm; eps 1e-6 inside the rsqrt, as HF)
    q     <- q * scale                    (scale defaults to Dk ** -0.5, HF's ``q / sqrt(Dk)``)
    S     <- S * exp(g)                   (g: log decay)
    S     <- S + k (x) ((v - k^T S) * beta)
    o     <- q^T S

Node t starts from the state after its parent (node 0, and any node whose parent is -1, from the
committed state). The kernel walks nodes in index order with the state in registers; a node whose parent
is not t - 1 reloads its parent's state from the workspace, where only branch points (nodes with a child
other than the next node) store theirs. A chain therefore never touches the workspace.

Verify never writes the state pool. It writes each node's replay payload row as it reads the inputs;
``gdn_replay_commit`` replays the accepted path's rows from the committed state like a chain and writes
the new state in place, equal to decoding the accepted tokens one by one.

The staged fallback (``replay_ssm=False``) is ``gdn_tree_verify_staged``: the same kernel, but every
node's state goes to a per-layer ``scratch`` (a branch reloads its parent from there; a chain still
never reloads) and no payload is written; ``treespec::ssm_commit_staged`` (ops/mamba2_tree.py, generic
over the state's shape) copies the last accepted node's scratch row into the state pool. It needs no
replay at commit, at the price of one state per node per layer in memory and writes.

Shapes
------
q, k        [B, N, Hk, Dk]   any float dtype, any strides (HF's split views work without a copy)
v           [B, N, Hv, Dv]   Hv % Hk == 0 (GQA: consecutive value heads share a key head, as HF)
g, beta     [B, N, Hv]       log decay and write strength (HF's ``g`` and ``beta = sigmoid(b)``)
state       [B, Hv, Dk, Dv]  committed recurrent state, fp32 (fp64 accepted on CPU); verify reads it only
parents     int64 [B, N]     ``parents[b, 0] == -1``; N <= 64
workspace   [B, >=N, Hv, Dk, Dv]  state dtype; ONE buffer shared by all layers (one layer's worth per
                             node); after verify, row t holds node t's state iff t is a branch point,
                             other rows are untouched
payload     [B, >=N, W]      state dtype, one buffer per layer; row t = [k | v | g | beta] of node t:
                             k (l2-normalised when use_qk_l2norm) [Hk * Dk], v [Hv * Dv], g [Hv],
                             beta [Hv]; W = ``gdn_payload_width(Hk, Dk, Hv, Dv)``
scratch     [B, >=N, Hv, Dk, Dv]  state dtype, staged path only, one buffer per layer; after verify
                             row t = node t's state after its update, rows >= N untouched
o           [B, N, Hv, Dv]   dtype of q (HF returns ``core_attn_out.to(query.dtype)``)
accepted_path int64 [B, N]   accepted node indices, root first, padded with -1
accept_len  int64 [B]        accepted nodes per request (0 leaves the state unchanged)

``torch.ops.treespec.gdn_tree_verify(q, k, v, g, beta, state, parents, workspace, payload, scale,
use_qk_l2norm) -> o`` (mutates workspace, payload)
``torch.ops.treespec.gdn_replay_commit(state, payload, accepted_path, accept_len) -> None``
(mutates state)
``torch.ops.treespec.gdn_tree_verify_staged(q, k, v, g, beta, state, parents, scratch, scale,
use_qk_l2norm) -> o`` (mutates scratch)

Commit reads the accepted rows through ``accepted_path`` (for a chain, rows 0..A-1), which equals
packing them to the front first; a caller that packed them already (``compact_window_rows``) passes
``accepted_path = arange(N)``.

Checks are metadata only (no host sync); parent and path values are clamped in bounds but not checked
(run ``tree_mask.validate_parents`` once outside capture). The references compute in the state's dtype:
with an fp32 state they follow HF's recurrent rule operation for operation, with fp64 they are the oracle.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ._common import (
    HAS_TRITON, check_dim, check_dtype, check_num_nodes, check_same_device, float_pair, use_triton,
)  # fmt: skip

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = [
    "gdn_tree_verify",
    "gdn_tree_verify_reference",
    "gdn_replay_commit",
    "gdn_replay_commit_reference",
    "gdn_tree_verify_staged",
    "gdn_tree_verify_staged_reference",
    "gdn_payload_width",
    "gdn_branch_points",
    "MAX_HEAD_K_DIM",
]

MAX_HEAD_K_DIM = 256  # a program keeps a [Dk, BLOCK_V] state tile in registers
_L2NORM_EPS = 1e-6  # HF's l2norm (and fla's) eps inside the rsqrt
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def gdn_payload_width(num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int) -> int:
    """Elements of one replay payload row ``[k | v | g | beta]``."""
    return num_k_heads * head_k_dim + num_v_heads * head_v_dim + 2 * num_v_heads


def _payload_offsets(num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int):
    v_off = num_k_heads * head_k_dim
    g_off = v_off + num_v_heads * head_v_dim
    return v_off, g_off, g_off + num_v_heads


def gdn_branch_points(parents: torch.Tensor) -> torch.Tensor:
    """``bool [B, N]``: node t has a child other than node t + 1 (its state must be kept for a reload)."""
    batch, num_nodes = parents.shape
    node = torch.arange(num_nodes, device=parents.device)
    reloads = (parents >= 0) & (parents != node - 1)  # child c reloads its parent's state
    target = torch.where(reloads, parents.clamp(0, num_nodes - 1), num_nodes)
    counts = torch.zeros((batch, num_nodes + 1), dtype=torch.int64, device=parents.device)
    counts.scatter_add_(1, target, torch.ones_like(target))
    return counts[:, :num_nodes] > 0


# --------------------------------------------------------------------------------------------------
# The custom ops
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::gdn_tree_verify", mutates_args=("workspace", "payload"))
def gdn_tree_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parents: torch.Tensor,
    workspace: torch.Tensor,
    payload: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Per-node GDN outputs over a tree: ``-> o [B, N, Hv, Dv]`` (see the module docstring)."""
    _check_verify(q, k, v, g, beta, state, parents, workspace, payload)
    if use_triton(q, k, v, g, beta, state, parents, workspace, payload):
        batch, num_nodes = parents.shape
        o = torch.empty((batch, num_nodes, v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
        _launch_gdn_tree_verify(q, k, v, g, beta, state, parents, workspace, payload, o, scale, use_qk_l2norm)
        return o
    return gdn_tree_verify_reference(
        q, k, v, g, beta, state, parents, workspace, payload, scale, use_qk_l2norm
    )


@gdn_tree_verify.register_fake
def _(q, k, v, g, beta, state, parents, workspace, payload, scale=None, use_qk_l2norm=True):
    _check_verify(q, k, v, g, beta, state, parents, workspace, payload)
    return q.new_empty((parents.shape[0], parents.shape[1], v.shape[2], v.shape[3]))


@torch.library.custom_op("treespec::gdn_replay_commit", mutates_args=("state",))
def gdn_replay_commit(
    state: torch.Tensor, payload: torch.Tensor, accepted_path: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """Replay the accepted path's payload rows from ``state`` like a chain, writing ``state`` in place."""
    _check_replay(state, payload, accepted_path, accept_len)
    if use_triton(state, payload, accepted_path, accept_len):
        _launch_gdn_replay_commit(state, payload, accepted_path, accept_len)
    else:
        gdn_replay_commit_reference(state, payload, accepted_path, accept_len)


@gdn_replay_commit.register_fake
def _(state, payload, accepted_path, accept_len) -> None:
    _check_replay(state, payload, accepted_path, accept_len)
    return None


@torch.library.custom_op("treespec::gdn_tree_verify_staged", mutates_args=("scratch",))
def gdn_tree_verify_staged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parents: torch.Tensor,
    scratch: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Per-node GDN outputs, every node's state into ``scratch``: ``-> o [B, N, Hv, Dv]`` (module docstring)."""
    _check_inputs(q, k, v, g, beta, state, parents)
    _check_node_states("scratch", scratch, state, parents.shape[1])
    if use_triton(q, k, v, g, beta, state, parents, scratch):
        batch, num_nodes = parents.shape
        o = torch.empty((batch, num_nodes, v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
        _launch_gdn_tree_verify(
            q, k, v, g, beta, state, parents, scratch, None, o, scale, use_qk_l2norm, staged=True
        )
        return o
    return gdn_tree_verify_staged_reference(q, k, v, g, beta, state, parents, scratch, scale, use_qk_l2norm)


@gdn_tree_verify_staged.register_fake
def _(q, k, v, g, beta, state, parents, scratch, scale=None, use_qk_l2norm=True):
    _check_inputs(q, k, v, g, beta, state, parents)
    _check_node_states("scratch", scratch, state, parents.shape[1])
    return q.new_empty((parents.shape[0], parents.shape[1], v.shape[2], v.shape[3]))


# --------------------------------------------------------------------------------------------------
# Validation (metadata only: no host sync)
# --------------------------------------------------------------------------------------------------


def _check_state(state: torch.Tensor) -> None:
    check_dim("state", state, 4, "[B, Hv, Dk, Dv]")
    if state.dtype == torch.float64 and not state.is_cuda:
        return  # the fp64 reference (oracle) path
    if state.dtype != torch.float32:
        raise ValueError(
            f"state: the recurrent state must be torch.float32 (torch.float64 only on CPU, for the "
            f"reference), got {state.dtype} on {state.device}"
        )
    if state.shape[2] > MAX_HEAD_K_DIM:
        raise ValueError(f"state: key head dim Dk = {state.shape[2]} exceeds the supported {MAX_HEAD_K_DIM}")


def _check_inputs(q, k, v, g, beta, state, parents) -> None:
    """The per-node inputs, the committed state and the tree (shared by both verify ops)."""
    check_dim("q", q, 4, "[B, N, Hk, Dk]")
    check_dim("k", k, 4, "[B, N, Hk, Dk]")
    check_dim("v", v, 4, "[B, N, Hv, Dv]")
    check_dim("g", g, 3, "[B, N, Hv]")
    check_dim("beta", beta, 3, "[B, N, Hv]")
    check_dim("parents", parents, 2, "[B, N]")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_dtype(name, t, *_FLOAT_DTYPES)
    check_dtype("parents", parents, torch.int64)
    _check_state(state)
    batch, num_nodes = parents.shape
    check_num_nodes("parents.shape[1] (tree nodes)", num_nodes)
    _, num_k_heads, head_k_dim = q.shape[1:]
    num_v_heads, head_v_dim = v.shape[2:]
    if tuple(q.shape[:2]) != (batch, num_nodes):
        raise ValueError(f"q: expected [B={batch}, N={num_nodes}, Hk, Dk], got {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (batch, num_nodes):
        raise ValueError(f"v: expected [B={batch}, N={num_nodes}, Hv, Dv], got {tuple(v.shape)}")
    if num_k_heads == 0 or num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"v: value heads Hv = {num_v_heads} must be a multiple of the key heads Hk = {num_k_heads}"
        )
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (batch, num_nodes, num_v_heads):
            raise ValueError(
                f"{name}: expected [B={batch}, N={num_nodes}, Hv={num_v_heads}], got {tuple(t.shape)}"
            )
    if tuple(state.shape) != (batch, num_v_heads, head_k_dim, head_v_dim):
        raise ValueError(
            f"state: expected [B={batch}, Hv={num_v_heads}, Dk={head_k_dim}, Dv={head_v_dim}], "
            f"got {tuple(state.shape)}"
        )
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, parents=parents)


def _check_node_states(name: str, buf: torch.Tensor, state: torch.Tensor, num_nodes: int) -> None:
    """A per-node state buffer (the replay workspace or the staged scratch): ``[B, >=N, Hv, Dk, Dv]``."""
    check_dim(name, buf, 5, "[B, N, Hv, Dk, Dv]")
    batch, num_v_heads, head_k_dim, head_v_dim = state.shape
    if buf.shape[0] != batch or buf.shape[1] < num_nodes or tuple(buf.shape[2:]) != tuple(state.shape[1:]):
        raise ValueError(
            f"{name}: expected [B={batch}, >= N={num_nodes}, Hv={num_v_heads}, Dk={head_k_dim}, "
            f"Dv={head_v_dim}], got {tuple(buf.shape)}"
        )
    if buf.dtype != state.dtype:
        raise ValueError(f"{name}: dtype {buf.dtype} must equal the state dtype {state.dtype}")
    check_same_device(**{name: buf, "state": state})


def _check_verify(q, k, v, g, beta, state, parents, workspace, payload) -> None:
    _check_inputs(q, k, v, g, beta, state, parents)
    batch, num_nodes = parents.shape
    _check_node_states("workspace", workspace, state, num_nodes)
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


def _replay_heads(state: torch.Tensor, payload: torch.Tensor) -> tuple[int, int]:
    """(Hk, Dk) implied by the payload width; raises when the width fits no whole number of key heads."""
    _, num_v_heads, head_k_dim, head_v_dim = state.shape
    key_part = payload.shape[2] - num_v_heads * head_v_dim - 2 * num_v_heads
    if head_k_dim == 0 or key_part <= 0 or key_part % head_k_dim != 0:
        raise ValueError(
            f"payload: row width {payload.shape[2]} is not Hk*Dk + Hv*Dv + 2*Hv for the state "
            f"{tuple(state.shape)}"
        )
    num_k_heads = key_part // head_k_dim
    if num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"payload: implies Hk = {num_k_heads} key heads, which does not divide Hv = {num_v_heads}"
        )
    return num_k_heads, head_k_dim


def _check_replay(state, payload, accepted_path, accept_len) -> None:
    _check_state(state)
    check_dim("payload", payload, 3, "[B, N, W]")
    check_dim("accepted_path", accepted_path, 2, "[B, N]")
    check_dim("accept_len", accept_len, 1, "[B]")
    check_dtype("accepted_path", accepted_path, torch.int64)
    check_dtype("accept_len", accept_len, torch.int64)
    batch, num_nodes = accepted_path.shape
    check_num_nodes("accepted_path.shape[1] (tree nodes)", num_nodes)
    if state.shape[0] != batch:
        raise ValueError(f"state: expected batch B={batch} (from accepted_path), got {tuple(state.shape)}")
    if payload.dtype != state.dtype:
        raise ValueError(f"payload: dtype {payload.dtype} must equal the state dtype {state.dtype}")
    if payload.shape[0] != batch or payload.shape[1] < num_nodes:
        raise ValueError(f"payload: expected [B={batch}, >= N={num_nodes}, W], got {tuple(payload.shape)}")
    _replay_heads(state, payload)
    if tuple(accept_len.shape) != (batch,):
        raise ValueError(f"accept_len: expected [B={batch}], got {tuple(accept_len.shape)}")
    check_same_device(state=state, payload=payload, accepted_path=accepted_path, accept_len=accept_len)


# --------------------------------------------------------------------------------------------------
# Triton launchers and kernels
# --------------------------------------------------------------------------------------------------


def _value_block(head_k_dim: int, head_v_dim: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): the whole key dim, and a value slice keeping the tile near 4k elements."""
    block_k = max(16, triton.next_power_of_2(head_k_dim))
    block_v = min(max(16, triton.next_power_of_2(head_v_dim)), max(16, 4096 // block_k))
    return block_k, block_v


def _launch_gdn_tree_verify(
    q, k, v, g, beta, state, parents, workspace, payload, o, scale, use_qk_l2norm, staged=False
) -> None:
    """Fill ``o``, the branch points' workspace rows and the payload rows; with ``staged``, ``workspace``
    is the scratch, every node's row is written and ``payload`` (None) is not. Grid: (B, Hv, Dv blocks)."""
    batch, num_nodes, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[2:]
    if batch == 0 or num_v_heads == 0 or head_v_dim == 0:
        return
    block_k, block_v = _value_block(head_k_dim, head_v_dim)
    v_off, g_off, beta_off = _payload_offsets(num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    payload_strides = (0, 0, 0) if staged else payload.stride()
    _gdn_tree_verify_kernel[(batch, num_v_heads, triton.cdiv(head_v_dim, block_v))](
        q, k, v, g, beta, state, parents, workspace, workspace if staged else payload, o,
        num_nodes, *float_pair(float(head_k_dim**-0.5 if scale is None else scale)),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        *state.stride(), *parents.stride(), *workspace.stride(), *payload_strides, *o.stride(),
        GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        V_OFF=v_off, G_OFF=g_off, BETA_OFF=beta_off, USE_L2NORM=bool(use_qk_l2norm), STAGED=bool(staged),
        BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_N=max(16, triton.next_power_of_2(num_nodes)),
        num_warps=4 if block_k * block_v >= 2048 else 1,
    )  # fmt: skip


def _launch_gdn_replay_commit(state, payload, accepted_path, accept_len) -> None:
    """Advance ``state`` in place over each request's accepted rows. Grid: (B, Hv, Dv blocks)."""
    batch, num_v_heads, head_k_dim, head_v_dim = state.shape
    if batch == 0 or num_v_heads == 0 or head_v_dim == 0:
        return
    num_k_heads, _ = _replay_heads(state, payload)
    block_k, block_v = _value_block(head_k_dim, head_v_dim)
    v_off, g_off, beta_off = _payload_offsets(num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    _gdn_replay_commit_kernel[(batch, num_v_heads, triton.cdiv(head_v_dim, block_v))](
        state, payload, accepted_path, accept_len,
        accepted_path.shape[1],
        *state.stride(), *payload.stride(), *accepted_path.stride(), accept_len.stride(0),
        GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        V_OFF=v_off, G_OFF=g_off, BETA_OFF=beta_off,
        BLOCK_K=block_k, BLOCK_V=block_v,
        num_warps=4 if block_k * block_v >= 2048 else 1,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _gdn_tree_verify_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, parents_ptr, ws_ptr, payload_ptr, o_ptr,
        num_nodes, scale_head, scale_tail,
        s_qb, s_qn, s_qh, s_qd,
        s_kb, s_kn, s_kh, s_kd,
        s_vb, s_vn, s_vh, s_vd,
        s_gb, s_gn, s_gh,
        s_bb, s_bn, s_bh,
        s_sb, s_sh, s_sk, s_sv,
        s_pb, s_pn,
        s_wb, s_wn, s_wh, s_wk, s_wv,
        s_yb, s_yn, s_yw,
        s_ob, s_on, s_oh, s_od,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        V_OFF: tl.constexpr, G_OFF: tl.constexpr, BETA_OFF: tl.constexpr, USE_L2NORM: tl.constexpr,
        STAGED: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # One program per (request, value head, value slice) walks the nodes in index order with its
        # [Dk, BLOCK_V] state tile in registers, like a chain's fused recurrent decode (idea from fla's
        # fused_recurrent_gated_delta_rule; the branch-point workspace follows SGLang/flashinfer's
        # intermediate_states_buffer, here written only where a reload will read it). With STAGED,
        # ws_ptr is the per-layer scratch: every node's state is stored, no payload row is.
        b = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        hk = hv // GROUP
        kk = tl.arange(0, BLOCK_K)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        km = kk < DK
        vm = vv < DV
        sm = km[:, None] & vm[None, :]
        acc_ty = state_ptr.dtype.element_ty
        scale = (tl.zeros((), acc_ty) + scale_head) + scale_tail  # float64-exact in float64 (_common.float_pair)
        nn = tl.arange(0, BLOCK_N)
        all_parents = tl.load(parents_ptr + b * s_pb + nn * s_pn, mask=nn < num_nodes, other=-1)
        state_tile = state_ptr + b * s_sb + hv * s_sh + kk[:, None] * s_sk + vv[None, :] * s_sv
        ws_tile = ws_ptr + b * s_wb + hv * s_wh + kk[:, None] * s_wk + vv[None, :] * s_wv
        row_ptr = payload_ptr + b * s_yb
        S = tl.zeros((BLOCK_K, BLOCK_V), dtype=acc_ty)
        for t in range(num_nodes):
            parent = tl.load(parents_ptr + b * s_pb + t * s_pn)
            parent = tl.minimum(tl.maximum(parent, -1), num_nodes - 1)  # stay in bounds on non-trees
            if (t == 0) | (parent != t - 1):
                if parent < 0:
                    S = tl.load(state_tile, mask=sm, other=0.0).to(acc_ty)
                else:
                    S = tl.load(ws_tile + parent * s_wn, mask=sm, other=0.0).to(acc_ty)
            q_t = tl.load(q_ptr + b * s_qb + t * s_qn + hk * s_qh + kk * s_qd, mask=km, other=0.0).to(acc_ty)
            k_t = tl.load(k_ptr + b * s_kb + t * s_kn + hk * s_kh + kk * s_kd, mask=km, other=0.0).to(acc_ty)
            v_t = tl.load(v_ptr + b * s_vb + t * s_vn + hv * s_vh + vv * s_vd, mask=vm, other=0.0).to(acc_ty)
            g_t = tl.load(g_ptr + b * s_gb + t * s_gn + hv * s_gh).to(acc_ty)
            beta_t = tl.load(beta_ptr + b * s_bb + t * s_bn + hv * s_bh).to(acc_ty)
            if USE_L2NORM:
                q_t = q_t * (1.0 / tl.sqrt(tl.sum(q_t * q_t, 0) + 1e-6))
                k_t = k_t * (1.0 / tl.sqrt(tl.sum(k_t * k_t, 0) + 1e-6))
            q_t = q_t * scale
            S = S * tl.exp(g_t)
            delta = (v_t - tl.sum(S * k_t[:, None], 0)) * beta_t
            S = S + k_t[:, None] * delta[None, :]
            o_t = tl.sum(S * q_t[:, None], 0)
            tl.store(
                o_ptr + b * s_ob + t * s_on + hv * s_oh + vv * s_od, o_t.to(o_ptr.dtype.element_ty), mask=vm
            )
            n_reloaders = tl.sum(tl.where((all_parents == t) & (nn != t + 1), 1, 0), 0)
            if STAGED:
                tl.store(ws_tile + t * s_wn, S.to(ws_ptr.dtype.element_ty), mask=sm)
                if n_reloaders > 0:
                    # The later reload may be served by other threads of this program: make it visible.
                    tl.debug_barrier()
            else:
                # Replay payload: each element has exactly one writer program.
                row = row_ptr + t * s_yn
                out_ty = payload_ptr.dtype.element_ty
                tl.store(row + (V_OFF + hv * DV + vv) * s_yw, v_t.to(out_ty), mask=vm)
                if vb == 0:
                    if hv % GROUP == 0:
                        tl.store(row + (hk * DK + kk) * s_yw, k_t.to(out_ty), mask=km)
                    tl.store(row + (G_OFF + hv) * s_yw, g_t.to(out_ty))
                    tl.store(row + (BETA_OFF + hv) * s_yw, beta_t.to(out_ty))
                # Keep this state only if some child other than t + 1 will reload it.
                if n_reloaders > 0:
                    tl.store(ws_tile + t * s_wn, S.to(ws_ptr.dtype.element_ty), mask=sm)
                    # The later reload may be served by other threads of this program: make it visible.
                    tl.debug_barrier()
        # (No final state: verify never writes the state pool; commit replays the accepted rows, or
        # with STAGED copies the last accepted node's scratch row.)

    @triton.jit
    def _gdn_replay_commit_kernel(
        state_ptr, payload_ptr, path_ptr, len_ptr,
        num_nodes,
        s_sb, s_sh, s_sk, s_sv,
        s_yb, s_yn, s_yw,
        s_pb, s_pn, s_lb,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        V_OFF: tl.constexpr, G_OFF: tl.constexpr, BETA_OFF: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # The verify kernel's update, fed from the payload rows of the accepted path (already
        # normalised k), so the committed state equals the verified path's state.
        b = tl.program_id(0).to(tl.int64)
        hv = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        hk = hv // GROUP
        kk = tl.arange(0, BLOCK_K)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        km = kk < DK
        vm = vv < DV
        sm = km[:, None] & vm[None, :]
        acc_ty = state_ptr.dtype.element_ty
        state_tile = state_ptr + b * s_sb + hv * s_sh + kk[:, None] * s_sk + vv[None, :] * s_sv
        S = tl.load(state_tile, mask=sm, other=0.0).to(acc_ty)
        accepted = tl.minimum(tl.maximum(tl.load(len_ptr + b * s_lb), 0), num_nodes).to(tl.int32)
        for i in range(0, accepted):
            node = tl.load(path_ptr + b * s_pb + i * s_pn)
            node = tl.minimum(tl.maximum(node, 0), num_nodes - 1)
            row = payload_ptr + b * s_yb + node * s_yn
            k_t = tl.load(row + (hk * DK + kk) * s_yw, mask=km, other=0.0).to(acc_ty)
            v_t = tl.load(row + (V_OFF + hv * DV + vv) * s_yw, mask=vm, other=0.0).to(acc_ty)
            g_t = tl.load(row + (G_OFF + hv) * s_yw).to(acc_ty)
            beta_t = tl.load(row + (BETA_OFF + hv) * s_yw).to(acc_ty)
            S = S * tl.exp(g_t)
            delta = (v_t - tl.sum(S * k_t[:, None], 0)) * beta_t
            S = S + k_t[:, None] * delta[None, :]
        tl.store(state_tile, S.to(state_ptr.dtype.element_ty), mask=sm)


# --------------------------------------------------------------------------------------------------
# References (CPU path and test oracle)
# --------------------------------------------------------------------------------------------------


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # HF's l2norm, operation for operation (bitwise equal with an fp32 state).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _delta_rule_step(S, k_t, v_t, g_t, beta_t):
    """One gated-delta update in HF's operation order. S [B, Hv, Dk, Dv]; k_t [B, Hv, Dk]; v_t [B, Hv, Dv]."""
    S = S * g_t.exp()[..., None, None]
    kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
    delta = (v_t - kv_mem) * beta_t.unsqueeze(-1)
    return S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)


def _tree_states(q, k, v, g, beta, state, parents, scale, use_qk_l2norm):
    """Every node's output and state, plus the processed k, v, g, beta, in the state's dtype.

    Vectorised over requests and heads, sequential over nodes; keeps every node's state (it is the
    oracle, memory is not its concern) and starts each node from its parent's.
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
    q_heads = qf.repeat_interleave(group, dim=2)  # [B, N, Hv, Dk]
    k_heads = kf.repeat_interleave(group, dim=2)
    committed = state.to(acc)
    node_states = torch.zeros((batch, num_nodes) + tuple(state.shape[1:]), dtype=acc, device=state.device)
    out = torch.empty((batch, num_nodes, num_v_heads, head_v_dim), dtype=acc, device=state.device)
    rows = torch.arange(batch, device=state.device)
    for t in range(num_nodes):
        parent = parents[:, t].clamp(-1, num_nodes - 1)
        from_parent = node_states[rows, parent.clamp(min=0)]
        S = torch.where((parent < 0)[:, None, None, None], committed, from_parent)
        S = _delta_rule_step(S, k_heads[:, t], vf[:, t], gf[:, t], bf[:, t])
        node_states[:, t] = S
        out[:, t] = (S * q_heads[:, t].unsqueeze(-1)).sum(dim=-2)
    return out.to(q.dtype), node_states, (kf, vf, gf, bf)


def gdn_tree_verify_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parents: torch.Tensor,
    workspace: torch.Tensor,
    payload: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Pure-torch tree verify in the state's dtype; writes the same workspace rows and payload as the kernel."""
    out, node_states, (kf, vf, gf, bf) = _tree_states(q, k, v, g, beta, state, parents, scale, use_qk_l2norm)
    batch, num_nodes = parents.shape
    keep = gdn_branch_points(parents)[:, :, None, None, None]
    kept = torch.where(keep, node_states.to(workspace.dtype), workspace[:, :num_nodes])
    workspace[:, :num_nodes].copy_(kept)
    row = torch.cat(
        [kf.reshape(batch, num_nodes, -1), vf.reshape(batch, num_nodes, -1), gf, bf], dim=-1
    )
    payload[:, :num_nodes].copy_(row)
    return out


def gdn_tree_verify_staged_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parents: torch.Tensor,
    scratch: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Pure-torch staged verify: outputs, and every node's state into ``scratch[:, :N]``."""
    out, node_states, _ = _tree_states(q, k, v, g, beta, state, parents, scale, use_qk_l2norm)
    scratch[:, : parents.shape[1]].copy_(node_states)
    return out


def gdn_replay_commit_reference(
    state: torch.Tensor, payload: torch.Tensor, accepted_path: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """Pure-torch replay commit in the state's dtype: ``state`` advances over each accepted row, in place."""
    batch, num_v_heads, head_k_dim, head_v_dim = state.shape
    num_k_heads, _ = _replay_heads(state, payload)
    group = num_v_heads // num_k_heads
    num_nodes = accepted_path.shape[1]
    v_off, g_off, beta_off = _payload_offsets(num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    rows = torch.arange(batch, device=state.device)
    S = state.clone()
    for i in range(num_nodes):
        node = accepted_path[:, i].clamp(0, num_nodes - 1)
        row = payload[rows, node]  # [B, W]
        k_t = row[:, :v_off].reshape(batch, num_k_heads, head_k_dim).repeat_interleave(group, dim=1)
        v_t = row[:, v_off:g_off].reshape(batch, num_v_heads, head_v_dim)
        g_t, beta_t = row[:, g_off:beta_off], row[:, beta_off:]
        stepped = _delta_rule_step(S, k_t, v_t, g_t, beta_t)
        S = torch.where((i < accept_len)[:, None, None, None], stepped, S)
    state.copy_(S)
