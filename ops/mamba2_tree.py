"""Mamba2 selective-state update over a draft tree: tree verify, replay commit, and the staged fallback.

The math is HF's single-token decode (``mamba2_selective_state_update``) per node, head h, group
g = h // (H // G) (consecutive heads share a group, as HF's expand of B and C):

    dt  <- dt + dt_bias                   (when dt_bias is given)
    dt  <- softplus(dt)                   (when dt_softplus; torch's threshold 20)
    dt  <- clamp(dt, dt_min, dt_max)      (only the limits given; HF's decode applies none, its chunked
                                           prefill clamps to ``time_step_limit``)
    a   <- dt * A                         (log decay; HF's ``dA = exp(dt * A)``)
    S   <- S * exp(a) + (dt * B) (x) x    (S [P, S_n]: state[p, n] += dt * B[n] * x[p])
    y   <- S C + D * x                    (when D is given)

Node t starts from the state after its parent (node 0, and any node whose parent is -1, from the
committed state). The kernel walks nodes in index order with the state tile in registers. Mamba2 keeps
no state workspace: at a branch point (parent != t - 1) the program re-reads the committed state and
replays the parent's ancestors, root to parent, over it. The update is elementwise, so a replayed step
costs one node's input loads, cheaper than storing and reloading a whole state; and because the replay
runs the same operations in the same order as a chain, every node sees exactly the state a chain along
its path would have.

Verify never writes the state pool. It writes each node's replay payload row; ``mamba2_replay_commit``
replays the accepted path's rows from the committed state like a chain and writes the new state in
place, equal to decoding the accepted tokens one by one.

The staged fallback (``replay_ssm=False``, or a kernel that cannot replay) is
``mamba2_tree_verify_staged``: it stores every node's state in a per-node scratch (a branch reloads its
parent from there) and ``ssm_commit_staged`` copies the last accepted node's scratch row into the state
pool. ``ssm_commit_staged`` is generic over the state's shape and dtype (GDN can use it too).

Shapes
------
x           [B, N, H, P]     conv output split into heads (HF's ``hidden_states.view``); any float dtype,
                             any strides (HF's split views of ``hidden_states_B_C`` work without a copy)
dt          [B, N, H]        raw time step (before dt_bias and softplus), any strides
A           [H]              ``-exp(A_log)``
B, C        [B, N, G, S_n]   H % G == 0
D, dt_bias  [H] or None
state       [B, H, P, S_n]   committed recurrent state (HF's cache layout), fp32 (fp64 accepted on CPU);
                             verify reads it only
parents     int64 [B, N]     ``parents[b, 0] == -1``; N <= 64
payload     [B, >=N, W]      state dtype, one buffer per layer; row t = [x | dt | a | B] of node t:
                             x [H * P], dt [H] (after bias, softplus and limits), a = dt * A [H],
                             B [G * S_n]; W = ``mamba2_payload_width(H, P, G, S_n)``. C is not stored:
                             a replay produces no output.
scratch     [B, >=N, H, P, S_n]  state dtype, staged path only; row t = node t's state after verify
y           [B, N, H, P]     dtype of x (HF returns ``out.to(hidden_states.dtype)``)
accepted_path int64 [B, N]   accepted node indices, root first, padded with -1
accept_len  int64 [B]        accepted nodes per request (0 leaves the state unchanged)

``torch.ops.treespec.mamba2_tree_verify(x, dt, A, B, C, D, dt_bias, state, parents, payload,
dt_softplus, dt_min, dt_max) -> y`` (mutates payload)
``torch.ops.treespec.mamba2_replay_commit(state, payload, accepted_path, accept_len) -> None``
(mutates state)
``torch.ops.treespec.mamba2_tree_verify_staged(x, dt, A, B, C, D, dt_bias, state, parents, scratch,
dt_softplus, dt_min, dt_max) -> y`` (mutates scratch)
``torch.ops.treespec.ssm_commit_staged(state, scratch, accepted_path, accept_len) -> None``
(mutates state; state [B, ...] of any shape and dtype, scratch [B, >=N, ...] alike)

Replay commit reads the accepted rows through ``accepted_path`` (for a chain, rows 0..A-1), which equals
packing them to the front first; a caller that packed them already (``compact_window_rows``) passes
``accepted_path = arange(N)``.

Checks are metadata only (no host sync); parent and path values are clamped in bounds (a parent is
clamped to [-1, t - 1]) but not checked (run ``tree_mask.validate_parents`` once outside capture). The
references compute in the state's dtype: with an fp32 state and fp32 inputs they follow HF's decode
operation for operation, with fp64 they are the oracle. The kernels compute in the state's dtype too;
with bf16 inputs HF computes dt, dt * B and the output in bf16, so results may differ from it by
roundings there.
"""

from __future__ import annotations

import logging
import math
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
    "mamba2_tree_verify",
    "mamba2_tree_verify_reference",
    "mamba2_replay_commit",
    "mamba2_replay_commit_reference",
    "mamba2_tree_verify_staged",
    "mamba2_tree_verify_staged_reference",
    "ssm_commit_staged",
    "ssm_commit_staged_reference",
    "mamba2_payload_width",
    "MAX_STATE_SIZE",
]

MAX_STATE_SIZE = 256  # a program keeps a [BLOCK_P, S_n] state tile in registers
_SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: above it softplus(x) = x
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def mamba2_payload_width(num_heads: int, head_dim: int, n_groups: int, state_size: int) -> int:
    """Elements of one replay payload row ``[x | dt | a | B]``."""
    return num_heads * head_dim + 2 * num_heads + n_groups * state_size


def _payload_offsets(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    dt_off = num_heads * head_dim
    return dt_off, dt_off + num_heads, dt_off + 2 * num_heads


# --------------------------------------------------------------------------------------------------
# The custom ops
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::mamba2_tree_verify", mutates_args=("payload",))
def mamba2_tree_verify(
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
    """Per-node Mamba2 outputs over a tree, replay payload rows: ``-> y [B, N, H, P]`` (module docstring)."""
    _check_inputs(x, dt, A, B, C, D, dt_bias, state, parents)
    _check_payload(payload, x, B, state)
    tensors = _present(x, dt, A, B, C, D, dt_bias, state, parents, payload)
    if use_triton(*tensors):
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch_mamba2_tree_verify(
            x, dt, A, B, C, D, dt_bias, state, parents, payload, y, dt_softplus, dt_min, dt_max, staged=False
        )
        return y
    return mamba2_tree_verify_reference(
        x, dt, A, B, C, D, dt_bias, state, parents, payload, dt_softplus, dt_min, dt_max
    )


@mamba2_tree_verify.register_fake
def _(x, dt, A, B, C, D, dt_bias, state, parents, payload, dt_softplus=True, dt_min=None, dt_max=None):
    _check_inputs(x, dt, A, B, C, D, dt_bias, state, parents)
    _check_payload(payload, x, B, state)
    return x.new_empty(x.shape)


@torch.library.custom_op("treespec::mamba2_replay_commit", mutates_args=("state",))
def mamba2_replay_commit(
    state: torch.Tensor, payload: torch.Tensor, accepted_path: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """Replay the accepted path's payload rows from ``state`` like a chain, writing ``state`` in place."""
    _check_replay(state, payload, accepted_path, accept_len)
    if use_triton(state, payload, accepted_path, accept_len):
        _launch_mamba2_replay_commit(state, payload, accepted_path, accept_len)
    else:
        mamba2_replay_commit_reference(state, payload, accepted_path, accept_len)


@mamba2_replay_commit.register_fake
def _(state, payload, accepted_path, accept_len) -> None:
    _check_replay(state, payload, accepted_path, accept_len)
    return None


@torch.library.custom_op("treespec::mamba2_tree_verify_staged", mutates_args=("scratch",))
def mamba2_tree_verify_staged(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    state: torch.Tensor,
    parents: torch.Tensor,
    scratch: torch.Tensor,
    dt_softplus: bool = True,
    dt_min: Optional[float] = None,
    dt_max: Optional[float] = None,
) -> torch.Tensor:
    """Per-node outputs, every node's state into ``scratch``: ``-> y [B, N, H, P]`` (module docstring)."""
    _check_inputs(x, dt, A, B, C, D, dt_bias, state, parents)
    _check_scratch(scratch, state, parents.shape[1])
    tensors = _present(x, dt, A, B, C, D, dt_bias, state, parents, scratch)
    if use_triton(*tensors):
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch_mamba2_tree_verify(
            x, dt, A, B, C, D, dt_bias, state, parents, scratch, y, dt_softplus, dt_min, dt_max, staged=True
        )
        return y
    return mamba2_tree_verify_staged_reference(
        x, dt, A, B, C, D, dt_bias, state, parents, scratch, dt_softplus, dt_min, dt_max
    )


@mamba2_tree_verify_staged.register_fake
def _(x, dt, A, B, C, D, dt_bias, state, parents, scratch, dt_softplus=True, dt_min=None, dt_max=None):
    _check_inputs(x, dt, A, B, C, D, dt_bias, state, parents)
    _check_scratch(scratch, state, parents.shape[1])
    return x.new_empty(x.shape)


@torch.library.custom_op("treespec::ssm_commit_staged", mutates_args=("state",))
def ssm_commit_staged(
    state: torch.Tensor, scratch: torch.Tensor, accepted_path: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """``state[b] = scratch[b, accepted_path[b, accept_len[b] - 1]]`` where ``accept_len[b] > 0``."""
    _check_commit_staged(state, scratch, accepted_path, accept_len)
    if use_triton(state, scratch, accepted_path, accept_len):
        _launch_ssm_commit_staged(state, scratch, accepted_path, accept_len)
    else:
        ssm_commit_staged_reference(state, scratch, accepted_path, accept_len)


@ssm_commit_staged.register_fake
def _(state, scratch, accepted_path, accept_len) -> None:
    _check_commit_staged(state, scratch, accepted_path, accept_len)
    return None


def _present(*tensors: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in tensors if t is not None)


# --------------------------------------------------------------------------------------------------
# Validation (metadata only: no host sync)
# --------------------------------------------------------------------------------------------------


def _check_state(state: torch.Tensor) -> None:
    check_dim("state", state, 4, "[B, H, P, S_n]")
    if state.dtype == torch.float64 and not state.is_cuda:
        return  # the fp64 reference (oracle) path
    if state.dtype != torch.float32:
        raise ValueError(
            f"state: the recurrent state must be torch.float32 (torch.float64 only on CPU, for the "
            f"reference), got {state.dtype} on {state.device}"
        )
    if state.shape[3] > MAX_STATE_SIZE:
        raise ValueError(f"state: state size S_n = {state.shape[3]} exceeds the supported {MAX_STATE_SIZE}")


def _check_inputs(x, dt, A, B, C, D, dt_bias, state, parents) -> None:
    check_dim("x", x, 4, "[B, N, H, P]")
    check_dim("dt", dt, 3, "[B, N, H]")
    check_dim("A", A, 1, "[H]")
    check_dim("B", B, 4, "[B, N, G, S_n]")
    check_dim("C", C, 4, "[B, N, G, S_n]")
    check_dim("parents", parents, 2, "[B, N]")
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_dtype(name, t, *_FLOAT_DTYPES)
    check_dtype("parents", parents, torch.int64)
    _check_state(state)
    batch, num_nodes = parents.shape
    check_num_nodes("parents.shape[1] (tree nodes)", num_nodes)
    _, _, num_heads, head_dim = x.shape
    n_groups, state_size = B.shape[2:]
    if tuple(x.shape[:2]) != (batch, num_nodes):
        raise ValueError(f"x: expected [B={batch}, N={num_nodes}, H, P], got {tuple(x.shape)}")
    if tuple(dt.shape) != (batch, num_nodes, num_heads):
        raise ValueError(f"dt: expected [B={batch}, N={num_nodes}, H={num_heads}], got {tuple(dt.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and tuple(t.shape) != (num_heads,):
            raise ValueError(f"{name}: expected [H={num_heads}], got {tuple(t.shape)}")
    if tuple(B.shape[:2]) != (batch, num_nodes):
        raise ValueError(f"B: expected [B={batch}, N={num_nodes}, G, S_n], got {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C: expected the shape of B {tuple(B.shape)}, got {tuple(C.shape)}")
    if n_groups == 0 or num_heads % n_groups != 0:
        raise ValueError(f"B: heads H = {num_heads} must be a multiple of the groups G = {n_groups}")
    if tuple(state.shape) != (batch, num_heads, head_dim, state_size):
        raise ValueError(
            f"state: expected [B={batch}, H={num_heads}, P={head_dim}, S_n={state_size}], "
            f"got {tuple(state.shape)}"
        )
    check_same_device(
        **dict(x=x, dt=dt, A=A, B=B, C=C, state=state, parents=parents),
        **({"D": D} if D is not None else {}),
        **({"dt_bias": dt_bias} if dt_bias is not None else {}),
    )


def _check_payload(payload, x, B, state) -> None:
    check_dim("payload", payload, 3, "[B, N, W]")
    batch, num_nodes, num_heads, head_dim = x.shape
    n_groups, state_size = B.shape[2:]
    width = mamba2_payload_width(num_heads, head_dim, n_groups, state_size)
    if payload.shape[0] != batch or payload.shape[1] < num_nodes or payload.shape[2] != width:
        raise ValueError(
            f"payload: expected [B={batch}, >= N={num_nodes}, W={width}] (W = H*P + 2*H + G*S_n), "
            f"got {tuple(payload.shape)}"
        )
    if payload.dtype != state.dtype:
        raise ValueError(f"payload: dtype {payload.dtype} must equal the state dtype {state.dtype}")
    check_same_device(payload=payload, state=state)


def _check_scratch(scratch, state, num_nodes) -> None:
    check_dim("scratch", scratch, 5, "[B, N, H, P, S_n]")
    batch = state.shape[0]
    if scratch.shape[0] != batch or scratch.shape[1] < num_nodes or scratch.shape[2:] != state.shape[1:]:
        raise ValueError(
            f"scratch: expected [B={batch}, >= N={num_nodes}, {', '.join(map(str, state.shape[1:]))}], "
            f"got {tuple(scratch.shape)}"
        )
    if scratch.dtype != state.dtype:
        raise ValueError(f"scratch: dtype {scratch.dtype} must equal the state dtype {state.dtype}")
    check_same_device(scratch=scratch, state=state)


def _replay_groups(state: torch.Tensor, payload: torch.Tensor) -> int:
    """G implied by the payload width; raises when the width fits no whole number of groups."""
    _, num_heads, head_dim, state_size = state.shape
    group_part = payload.shape[2] - num_heads * head_dim - 2 * num_heads
    if state_size == 0 or group_part <= 0 or group_part % state_size != 0:
        raise ValueError(
            f"payload: row width {payload.shape[2]} is not H*P + 2*H + G*S_n for the state "
            f"{tuple(state.shape)}"
        )
    n_groups = group_part // state_size
    if num_heads % n_groups != 0:
        raise ValueError(f"payload: implies G = {n_groups} groups, which does not divide H = {num_heads}")
    return n_groups


def _check_path(accepted_path, accept_len, batch) -> int:
    check_dim("accepted_path", accepted_path, 2, "[B, N]")
    check_dim("accept_len", accept_len, 1, "[B]")
    check_dtype("accepted_path", accepted_path, torch.int64)
    check_dtype("accept_len", accept_len, torch.int64)
    num_nodes = accepted_path.shape[1]
    check_num_nodes("accepted_path.shape[1] (tree nodes)", num_nodes)
    if accepted_path.shape[0] != batch:
        raise ValueError(
            f"accepted_path: expected [B={batch}, N] (B from state), got {tuple(accepted_path.shape)}"
        )
    if tuple(accept_len.shape) != (batch,):
        raise ValueError(f"accept_len: expected [B={batch}], got {tuple(accept_len.shape)}")
    return num_nodes


def _check_replay(state, payload, accepted_path, accept_len) -> None:
    _check_state(state)
    check_dim("payload", payload, 3, "[B, N, W]")
    batch = state.shape[0]
    num_nodes = _check_path(accepted_path, accept_len, batch)
    if payload.dtype != state.dtype:
        raise ValueError(f"payload: dtype {payload.dtype} must equal the state dtype {state.dtype}")
    if payload.shape[0] != batch or payload.shape[1] < num_nodes:
        raise ValueError(f"payload: expected [B={batch}, >= N={num_nodes}, W], got {tuple(payload.shape)}")
    _replay_groups(state, payload)
    check_same_device(state=state, payload=payload, accepted_path=accepted_path, accept_len=accept_len)


def _rows_contiguous(t: torch.Tensor, lead: int) -> bool:
    """Whether each ``t[i_0, .., i_{lead-1}]`` is one contiguous block (size-1 dims may have any stride)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[lead:], t.stride()[lead:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_commit_staged(state, scratch, accepted_path, accept_len) -> None:
    if state.dim() < 2:
        raise ValueError(f"state: expected a [B, ...] state with at least 2 dims, got {tuple(state.shape)}")
    check_dim("scratch", scratch, state.dim() + 1, f"[B, N, {', '.join(map(str, state.shape[1:]))}]")
    batch = state.shape[0]
    num_nodes = _check_path(accepted_path, accept_len, batch)
    if scratch.shape[0] != batch or scratch.shape[1] < num_nodes or scratch.shape[2:] != state.shape[1:]:
        raise ValueError(
            f"scratch: expected [B={batch}, >= N={num_nodes}, {', '.join(map(str, state.shape[1:]))}], "
            f"got {tuple(scratch.shape)}"
        )
    if scratch.dtype != state.dtype:
        raise ValueError(f"scratch: dtype {scratch.dtype} must equal the state dtype {state.dtype}")
    # The kernel copies each request's state as one flat block (a layer slice of a pool is fine).
    if not _rows_contiguous(state, 1):
        raise ValueError(f"state: each request's state must be contiguous, got strides {state.stride()}")
    if not _rows_contiguous(scratch, 2):
        raise ValueError(f"scratch: each node's state row must be contiguous, got strides {scratch.stride()}")
    check_same_device(state=state, scratch=scratch, accepted_path=accepted_path, accept_len=accept_len)


# --------------------------------------------------------------------------------------------------
# Triton launchers and kernels
# --------------------------------------------------------------------------------------------------


def _state_blocks(head_dim: int, state_size: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_S): the whole state dim, and a head-dim slice keeping the tile near 2k elements."""
    block_s = max(16, triton.next_power_of_2(state_size))
    block_p = min(max(16, triton.next_power_of_2(head_dim)), max(16, 2048 // block_s))
    return block_p, block_s


def _limits(dt_min: Optional[float], dt_max: Optional[float]) -> tuple[float, float, float, float]:
    """The dt clamp's limits as kernel arguments: ``float_pair`` of each (-inf / inf where absent)."""
    lo = -math.inf if dt_min is None else float(dt_min)
    hi = math.inf if dt_max is None else float(dt_max)
    return (*float_pair(lo), *float_pair(hi))


def _launch_mamba2_tree_verify(
    x, dt, A, B, C, D, dt_bias, state, parents, buf, y, dt_softplus, dt_min, dt_max, staged
) -> None:
    """Fill ``y`` and ``buf`` (the payload rows, or with ``staged`` every node's scratch state).

    Grid: (B, H, P blocks).
    """
    batch, num_nodes, num_heads, head_dim = x.shape
    n_groups, state_size = B.shape[2:]
    if batch == 0 or num_heads == 0 or head_dim == 0:
        return
    block_p, block_s = _state_blocks(head_dim, state_size)
    dt_off, a_off, b_off = _payload_offsets(num_heads, head_dim)
    buf_strides = buf.stride() if staged else (*buf.stride(), 0, 0)
    has_d, has_bias = D is not None, dt_bias is not None
    _mamba2_tree_verify_kernel[(batch, num_heads, triton.cdiv(head_dim, block_p))](
        x, dt, A, B, C, D if has_d else A, dt_bias if has_bias else A, state, parents, buf, y,
        num_nodes, *_limits(dt_min, dt_max),
        *x.stride(), *dt.stride(), A.stride(0), *B.stride(), *C.stride(),
        D.stride(0) if has_d else 0, dt_bias.stride(0) if has_bias else 0,
        *state.stride(), *parents.stride(), *buf_strides, *y.stride(),
        GROUP=num_heads // n_groups, P=head_dim, SN=state_size,
        DT_OFF=dt_off, A_OFF=a_off, B_OFF=b_off,
        HAS_D=has_d, HAS_DT_BIAS=has_bias, SOFTPLUS=bool(dt_softplus), STAGED=bool(staged),
        BLOCK_P=block_p, BLOCK_S=block_s, BLOCK_N=max(16, triton.next_power_of_2(num_nodes)),
        num_warps=4 if block_p * block_s >= 2048 else 1,
    )  # fmt: skip


def _launch_mamba2_replay_commit(state, payload, accepted_path, accept_len) -> None:
    """Advance ``state`` in place over each request's accepted rows. Grid: (B, H, P blocks)."""
    batch, num_heads, head_dim, state_size = state.shape
    if batch == 0 or num_heads == 0 or head_dim == 0:
        return
    n_groups = _replay_groups(state, payload)
    block_p, block_s = _state_blocks(head_dim, state_size)
    dt_off, a_off, b_off = _payload_offsets(num_heads, head_dim)
    _mamba2_replay_commit_kernel[(batch, num_heads, triton.cdiv(head_dim, block_p))](
        state, payload, accepted_path, accept_len,
        accepted_path.shape[1],
        *state.stride(), *payload.stride(), *accepted_path.stride(), accept_len.stride(0),
        GROUP=num_heads // n_groups, P=head_dim, SN=state_size,
        DT_OFF=dt_off, A_OFF=a_off, B_OFF=b_off,
        BLOCK_P=block_p, BLOCK_S=block_s,
        num_warps=4 if block_p * block_s >= 2048 else 1,
    )  # fmt: skip


def _launch_ssm_commit_staged(state, scratch, accepted_path, accept_len) -> None:
    """Copy one scratch row per request into ``state``. Grid: (B, row blocks)."""
    batch = state.shape[0]
    row = math.prod(state.shape[1:])
    if batch == 0 or row == 0:
        return
    block = min(triton.next_power_of_2(row), 4096)
    _ssm_commit_staged_kernel[(batch, triton.cdiv(row, block))](
        state, scratch, accepted_path, accept_len,
        accepted_path.shape[1], row,
        state.stride(0), scratch.stride(0), scratch.stride(1),
        accepted_path.stride(0), accepted_path.stride(1), accept_len.stride(0),
        BLOCK=block, num_warps=4,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _softplus(z):
        # torch's softplus (threshold 20); log1p(e) by Kahan's trick, accurate where e is tiny.
        e = tl.exp(z)
        u = 1.0 + e
        small = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        return tl.where(z > 20.0, z, small)

    @triton.jit
    def _node_inputs(
        x_ptr, dt_ptr, B_ptr, t, s_xn, s_xp, s_dn, s_Bn, s_Bs, pp, ss, pm, sm,
        A_h, bias_h, dt_lo, dt_hi, SOFTPLUS: tl.constexpr,
    ):  # fmt: skip
        # What node t contributes to head h: x [BLOCK_P], processed dt, log decay a = dt * A, B [BLOCK_S].
        # Pointers come pre-offset to (request, head / group); everything in A_h's (the state's) dtype.
        x_t = tl.load(x_ptr + t * s_xn + pp * s_xp, mask=pm, other=0.0).to(A_h.dtype)
        B_t = tl.load(B_ptr + t * s_Bn + ss * s_Bs, mask=sm, other=0.0).to(A_h.dtype)
        dt_t = tl.load(dt_ptr + t * s_dn).to(A_h.dtype) + bias_h
        if SOFTPLUS:
            dt_t = _softplus(dt_t)
        # where, not min/max: a NaN dt stays NaN, as torch.clamp leaves it
        dt_t = tl.where(dt_t < dt_lo, dt_lo, dt_t)
        dt_t = tl.where(dt_t > dt_hi, dt_hi, dt_t)
        return x_t, dt_t, dt_t * A_h, B_t

    @triton.jit
    def _mamba2_tree_verify_kernel(
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, parents_ptr, buf_ptr, y_ptr,
        num_nodes, dt_lo_head, dt_lo_tail, dt_hi_head, dt_hi_tail,
        s_xb, s_xn, s_xh, s_xp,
        s_db, s_dn, s_dh,
        s_ah,
        s_Bb, s_Bn, s_Bg, s_Bs,
        s_Cb, s_Cn, s_Cg, s_Cs,
        s_Dh, s_biash,
        s_sb, s_sh, s_sp, s_ss,
        s_pb, s_pn,
        s_fb, s_fn, s_f2, s_f3, s_f4,
        s_yb, s_yn, s_yh, s_yp,
        GROUP: tl.constexpr, P: tl.constexpr, SN: tl.constexpr,
        DT_OFF: tl.constexpr, A_OFF: tl.constexpr, B_OFF: tl.constexpr,
        HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, STAGED: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # One program per (request, head, head-dim slice) walks the nodes in index order with its
        # [BLOCK_P, S_n] state tile in registers, like a chain's selective-state decode. At a branch it
        # rebuilds the parent's state by replaying the parent's ancestors over the committed state (idea
        # from SGLang's Mamba tree verify, which follows parent_indices; here without any per-node
        # state unless STAGED). buf: the payload rows ([b, n, w] strides s_fb, s_fn, s_f2), or with
        # STAGED the scratch ([b, n, h, p, s] strides s_fb .. s_f4).
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        pb = tl.program_id(2)
        g = h // GROUP
        pp = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        ss = tl.arange(0, BLOCK_S)
        pm = pp < P
        sm = ss < SN
        tm = pm[:, None] & sm[None, :]
        acc_ty = state_ptr.dtype.element_ty
        dt_lo = (tl.zeros((), acc_ty) + dt_lo_head) + dt_lo_tail  # float64-exact in float64 (_common.float_pair)
        dt_hi = (tl.zeros((), acc_ty) + dt_hi_head) + dt_hi_tail
        A_h = tl.load(A_ptr + h * s_ah).to(acc_ty)
        bias_h = tl.zeros((), dtype=acc_ty)
        if HAS_DT_BIAS:
            bias_h = tl.load(bias_ptr + h * s_biash).to(acc_ty)
        x_head = x_ptr + b * s_xb + h * s_xh
        dt_head = dt_ptr + b * s_db + h * s_dh
        B_group = B_ptr + b * s_Bb + g * s_Bg
        C_group = C_ptr + b * s_Cb + g * s_Cg
        state_tile = state_ptr + b * s_sb + h * s_sh + pp[:, None] * s_sp + ss[None, :] * s_ss
        scratch_tile = buf_ptr + b * s_fb + h * s_f2 + pp[:, None] * s_f3 + ss[None, :] * s_f4
        nn = tl.arange(0, BLOCK_N)
        all_parents = tl.load(parents_ptr + b * s_pb + nn * s_pn, mask=nn < num_nodes, other=-1)
        ancestors = tl.zeros((BLOCK_N,), dtype=tl.int64)  # bit j of word t: node j is t or its ancestor
        one = tl.full((), 1, tl.int64)
        S = tl.load(state_tile, mask=tm, other=0.0).to(acc_ty)
        for t in range(num_nodes):
            parent = tl.load(parents_ptr + b * s_pb + t * s_pn)
            parent = tl.minimum(tl.maximum(parent, -1), t - 1)  # stay in bounds and acyclic on non-trees
            path_word = tl.sum(tl.where(nn == parent, ancestors, 0), 0)  # 0 when parent is -1
            if parent != t - 1:
                if STAGED:
                    if parent < 0:
                        S = tl.load(state_tile, mask=tm, other=0.0).to(acc_ty)
                    else:
                        S = tl.load(scratch_tile + parent * s_fn, mask=tm, other=0.0).to(acc_ty)
                else:
                    # Replay root .. parent in index order (ancestors precede descendants), exactly
                    # the steps a chain along this path takes.
                    S = tl.load(state_tile, mask=tm, other=0.0).to(acc_ty)
                    for j in range(0, (parent + 1).to(tl.int32)):
                        if ((path_word >> j) & 1) != 0:
                            x_j, dt_j, a_j, B_j = _node_inputs(
                                x_head, dt_head, B_group, j, s_xn, s_xp, s_dn, s_Bn, s_Bs,
                                pp, ss, pm, sm, A_h, bias_h, dt_lo, dt_hi, SOFTPLUS,
                            )  # fmt: skip
                            S = S * tl.exp(a_j) + (dt_j * B_j)[None, :] * x_j[:, None]
            x_t, dt_t, a_t, B_t = _node_inputs(
                x_head, dt_head, B_group, t, s_xn, s_xp, s_dn, s_Bn, s_Bs,
                pp, ss, pm, sm, A_h, bias_h, dt_lo, dt_hi, SOFTPLUS,
            )  # fmt: skip
            S = S * tl.exp(a_t) + (dt_t * B_t)[None, :] * x_t[:, None]
            C_t = tl.load(C_group + t * s_Cn + ss * s_Cs, mask=sm, other=0.0).to(acc_ty)
            y_t = tl.sum(S * C_t[None, :], 1)
            if HAS_D:
                y_t = y_t + x_t * tl.load(D_ptr + h * s_Dh).to(acc_ty)
            y_out = y_ptr + b * s_yb + t * s_yn + h * s_yh + pp * s_yp
            tl.store(y_out, y_t.to(y_ptr.dtype.element_ty), mask=pm)
            ancestors = tl.where(nn == t, path_word | (one << t), ancestors)
            if STAGED:
                tl.store(scratch_tile + t * s_fn, S.to(buf_ptr.dtype.element_ty), mask=tm)
                if tl.sum(tl.where((all_parents == t) & (nn != t + 1), 1, 0), 0) > 0:
                    # A later reload may be served by other threads of this program: make it visible.
                    tl.debug_barrier()
            else:
                # Replay payload: each element has exactly one writer program.
                row = buf_ptr + b * s_fb + t * s_fn
                out_ty = buf_ptr.dtype.element_ty
                tl.store(row + (h * P + pp) * s_f2, x_t.to(out_ty), mask=pm)
                if pb == 0:
                    tl.store(row + (DT_OFF + h) * s_f2, dt_t.to(out_ty))
                    tl.store(row + (A_OFF + h) * s_f2, a_t.to(out_ty))
                    if h % GROUP == 0:
                        tl.store(row + (B_OFF + g * SN + ss) * s_f2, B_t.to(out_ty), mask=sm)
        # (No final state: verify never writes the state pool.)

    @triton.jit
    def _mamba2_replay_commit_kernel(
        state_ptr, payload_ptr, path_ptr, len_ptr,
        num_nodes,
        s_sb, s_sh, s_sp, s_ss,
        s_yb, s_yn, s_yw,
        s_pb, s_pn, s_lb,
        GROUP: tl.constexpr, P: tl.constexpr, SN: tl.constexpr,
        DT_OFF: tl.constexpr, A_OFF: tl.constexpr, B_OFF: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        # The verify kernel's update fed from the accepted rows (dt and a already processed), so the
        # committed state is the verified path's state.
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        pb = tl.program_id(2)
        g = h // GROUP
        pp = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        ss = tl.arange(0, BLOCK_S)
        pm = pp < P
        sm = ss < SN
        tm = pm[:, None] & sm[None, :]
        acc_ty = state_ptr.dtype.element_ty
        state_tile = state_ptr + b * s_sb + h * s_sh + pp[:, None] * s_sp + ss[None, :] * s_ss
        S = tl.load(state_tile, mask=tm, other=0.0).to(acc_ty)
        accepted = tl.minimum(tl.maximum(tl.load(len_ptr + b * s_lb), 0), num_nodes).to(tl.int32)
        for i in range(0, accepted):
            node = tl.load(path_ptr + b * s_pb + i * s_pn)
            node = tl.minimum(tl.maximum(node, 0), num_nodes - 1)
            row = payload_ptr + b * s_yb + node * s_yn
            x_t = tl.load(row + (h * P + pp) * s_yw, mask=pm, other=0.0).to(acc_ty)
            dt_t = tl.load(row + (DT_OFF + h) * s_yw).to(acc_ty)
            a_t = tl.load(row + (A_OFF + h) * s_yw).to(acc_ty)
            B_t = tl.load(row + (B_OFF + g * SN + ss) * s_yw, mask=sm, other=0.0).to(acc_ty)
            S = S * tl.exp(a_t) + (dt_t * B_t)[None, :] * x_t[:, None]
        tl.store(state_tile, S.to(state_ptr.dtype.element_ty), mask=tm)

    @triton.jit
    def _ssm_commit_staged_kernel(
        state_ptr, scratch_ptr, path_ptr, len_ptr,
        num_nodes, row,
        s_sb, s_fb, s_fn,
        s_pb, s_pn, s_lb,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        om = offs < row
        accepted = tl.minimum(tl.load(len_ptr + b * s_lb), num_nodes)
        if accepted > 0:
            node = tl.load(path_ptr + b * s_pb + (accepted - 1) * s_pn)
            node = tl.minimum(tl.maximum(node, 0), num_nodes - 1)
            values = tl.load(scratch_ptr + b * s_fb + node * s_fn + offs, mask=om)
            tl.store(state_ptr + b * s_sb + offs, values, mask=om)


# --------------------------------------------------------------------------------------------------
# References (CPU path and test oracle)
# --------------------------------------------------------------------------------------------------


# PyTorch's CPU elementwise loops run whole blocks of 2 * vector-width elements through the vectorised
# (SLEEF) exp / log1p and the leftover tail through the scalar libm ones, and the two may differ by an
# ulp. HF's decode applies softplus to [B, H, P] and exp to [B, H, P, S] tensors, which for real models
# (H * P a multiple of 32) have no tail; ours are [B, N, H] and [B, H], which usually do, so an element
# in the tail came out one ulp off HF's on AVX-512 machines. Padding the flattened input to a multiple
# of _VECTOR_BLOCK keeps every element on the vectorised path, as HF's are.
_VECTOR_BLOCK = 64  # >= 2 * 16 fp32 lanes (AVX-512), the widest CPU vector PyTorch builds for


def _elementwise_vectorised(fn, t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` with every element on PyTorch's vectorised CPU path (see above); CUDA runs it as is."""
    if t.device.type != "cpu" or t.numel() == 0:
        return fn(t)
    flat = t.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % _VECTOR_BLOCK))
    return fn(padded)[: flat.numel()].view(t.shape)


def _process_dt(dt, dt_bias, dt_softplus, dt_min, dt_max):
    # HF's order: bias, softplus; the limits only where given (HF's decode applies none).
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = _elementwise_vectorised(torch.nn.functional.softplus, dt)
    if dt_min is not None or dt_max is not None:
        dt = dt.clamp(dt_min, dt_max)
    return dt


def _ssm_step(S, x_t, dt_t, a_t, B_t):
    """One update in HF's operation order.

    S [B, H, P, S_n]; x_t [B, H, P]; dt_t, a_t [B, H]; B_t [B, H, S_n].
    """
    dA = _elementwise_vectorised(torch.exp, a_t)[..., None, None]
    dB = dt_t[..., None, None] * B_t[:, :, None, :]
    return S * dA + dB * x_t[..., None]


def _ssm_output(S, C_t, x_t, D):
    """HF's readout: ``bmm(S, C) + x * D``. S [B, H, P, S_n]; C_t [B, H, S_n]; x_t [B, H, P]."""
    batch, num_heads, head_dim, state_size = S.shape
    y = torch.bmm(S.reshape(-1, head_dim, state_size), C_t.reshape(-1, state_size, 1))
    y = y.view(batch, num_heads, head_dim)
    if D is not None:
        y = y + x_t * D.to(S.dtype)[:, None]
    return y


def _tree_states(x, dt, A, B, C, D, dt_bias, state, parents, dt_softplus, dt_min, dt_max):
    """Every node's state and output, plus the processed inputs; vectorised over requests and heads."""
    batch, num_nodes, num_heads, head_dim = x.shape
    group = num_heads // B.shape[2]
    acc = state.dtype
    xf = x.to(acc)
    dtf = _process_dt(dt.to(acc), dt_bias, dt_softplus, dt_min, dt_max)  # [B, N, H]
    af = dtf * A.to(acc)
    B_heads = B.to(acc).repeat_interleave(group, dim=2)  # [B, N, H, S_n]
    C_heads = C.to(acc).repeat_interleave(group, dim=2)
    node_states = torch.zeros((batch, num_nodes) + tuple(state.shape[1:]), dtype=acc, device=state.device)
    out = torch.empty((batch, num_nodes, num_heads, head_dim), dtype=acc, device=state.device)
    rows = torch.arange(batch, device=state.device)
    for t in range(num_nodes):
        parent = parents[:, t].clamp(-1, t - 1)
        from_parent = node_states[rows, parent.clamp(min=0)]
        S = torch.where((parent < 0)[:, None, None, None], state, from_parent)
        S = _ssm_step(S, xf[:, t], dtf[:, t], af[:, t], B_heads[:, t])
        node_states[:, t] = S
        out[:, t] = _ssm_output(S, C_heads[:, t], xf[:, t], D)
    return out.to(x.dtype), node_states, (xf, dtf, af)


def mamba2_tree_verify_reference(
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
    """Pure-torch tree verify in the state's dtype; writes the same payload rows as the kernel.

    Sequential over nodes; keeps every node's state (it is the oracle, memory is not its concern) and
    starts each node from its parent's.
    """
    y, _, (xf, dtf, af) = _tree_states(
        x, dt, A, B, C, D, dt_bias, state, parents, dt_softplus, dt_min, dt_max
    )
    batch, num_nodes = parents.shape
    B_rows = B.to(state.dtype).reshape(batch, num_nodes, -1)
    row = torch.cat([xf.reshape(batch, num_nodes, -1), dtf, af, B_rows], dim=-1)
    payload[:, :num_nodes].copy_(row)
    return y


def mamba2_tree_verify_staged_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    state: torch.Tensor,
    parents: torch.Tensor,
    scratch: torch.Tensor,
    dt_softplus: bool = True,
    dt_min: Optional[float] = None,
    dt_max: Optional[float] = None,
) -> torch.Tensor:
    """Pure-torch staged verify: outputs, and every node's state into ``scratch[:, :N]``."""
    y, node_states, _ = _tree_states(x, dt, A, B, C, D, dt_bias, state, parents, dt_softplus, dt_min, dt_max)
    scratch[:, : parents.shape[1]].copy_(node_states)
    return y


def mamba2_replay_commit_reference(
    state: torch.Tensor, payload: torch.Tensor, accepted_path: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """Pure-torch replay commit in the state's dtype: ``state`` advances over each accepted row, in place."""
    batch, num_heads, head_dim, state_size = state.shape
    n_groups = _replay_groups(state, payload)
    group = num_heads // n_groups
    num_nodes = accepted_path.shape[1]
    dt_off, a_off, b_off = _payload_offsets(num_heads, head_dim)
    rows = torch.arange(batch, device=state.device)
    S = state.clone()
    for i in range(num_nodes):
        node = accepted_path[:, i].clamp(0, num_nodes - 1)
        row = payload[rows, node]  # [B, W]
        x_t = row[:, :dt_off].reshape(batch, num_heads, head_dim)
        dt_t, a_t = row[:, dt_off:a_off], row[:, a_off:b_off]
        B_t = row[:, b_off:].reshape(batch, n_groups, state_size).repeat_interleave(group, dim=1)
        stepped = _ssm_step(S, x_t, dt_t, a_t, B_t)
        S = torch.where((i < accept_len)[:, None, None, None], stepped, S)
    state.copy_(S)


def ssm_commit_staged_reference(
    state: torch.Tensor, scratch: torch.Tensor, accepted_path: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """Pure-torch staged commit: ``state[b] = scratch[b, path[b, len[b] - 1]]`` where ``len[b] > 0``."""
    num_nodes = accepted_path.shape[1]
    last = (accept_len.clamp(max=num_nodes) - 1).clamp(min=0)
    node = accepted_path.gather(1, last[:, None]).squeeze(1).clamp(0, num_nodes - 1)
    chosen = scratch[torch.arange(state.shape[0], device=state.device), node]
    keep = (accept_len > 0).view((-1,) + (1,) * (state.dim() - 1))
    state.copy_(torch.where(keep, chosen, state))
