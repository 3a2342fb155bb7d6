"""Causal depthwise conv1d over a draft tree (the short conv in front of GDN / Mamba2 layers).

In a chain, token t's conv window is the Kw - 1 inputs before it plus its own. In a tree, node t's window
is its own input, then its ancestors' inputs (nearest first), then the committed conv window when the
ancestors run out. Verify reads the committed window and never writes it; after acceptance,
``causal_conv1d_tree_commit`` shifts the accepted path's inputs into it, giving the window a plain decode
of those tokens would leave.

Shapes
------
x            [B, N, C]      the N tree nodes' conv inputs (any strides: HF's ``mixed_qkv.transpose(1, 2)``
                            view works without a copy)
conv_state   [B, C, L]      the committed window, oldest column first, L >= Kw - 1; only the last Kw - 1
                            columns are read (HF's cache keeps L = Kw, the seed's pool L = Kw - 1)
weight       [C, Kw]        depthwise taps, Kw in {2, 3, 4}; ``weight[:, Kw - 1]`` multiplies the node itself
bias         [C] or None
parents      int64 [B, N]   ``parents[b, 0] == -1``; ``-1`` means "the committed frontier"
out          [B, N, C]      ``act(sum_j weight[:, Kw - 1 - j] * window_t[j] + bias)``, window_t[0] = x[t],
                            window_t[j] = j-th ancestor's input, else the committed window; dtype of x
accepted_path int64 [B, N]  node indices root first, padded with -1 (commit only)
accept_len   int64 [B]      number of accepted nodes per request (commit only)

``torch.ops.treespec.causal_conv1d_tree_update(x, conv_state, weight, bias, parents, activation) -> out``
``torch.ops.treespec.causal_conv1d_tree_commit(conv_state, x, accepted_path, accept_len) -> None``
(mutates conv_state)

Both check only metadata. Parent and path values are not checked (that would sync the host): run
``treecompile.ops.tree_mask.validate_parents`` once outside capture. On values that are not a tree the
kernels still stay in bounds (indices are clamped), but the output is unspecified.

Accumulation is fp32 (fp64 when the weight is fp64); the result is rounded once to x's dtype. HF's
``causal_conv1d_update`` computes in the weight's dtype, so bf16 outputs may differ from it by one rounding.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ._common import HAS_TRITON, check_dim, check_dtype, check_num_nodes, check_same_device, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = [
    "causal_conv1d_tree_update",
    "causal_conv1d_tree_update_reference",
    "causal_conv1d_tree_commit",
    "causal_conv1d_tree_commit_reference",
    "SUPPORTED_CONV_WIDTHS",
]

SUPPORTED_CONV_WIDTHS = (2, 3, 4)
_ACTIVATIONS = (None, "silu", "swish")  # HF's ACT2FN maps both names to SiLU
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_MAX_STATE_WIDTH = 8  # the commit kernel holds the whole window in registers


# --------------------------------------------------------------------------------------------------
# The custom ops
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::causal_conv1d_tree_update", mutates_args=())
def causal_conv1d_tree_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    parents: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Each node's conv output over its ancestors' window: ``x [B, N, C] -> [B, N, C]`` (module docstring)."""
    _check_update(x, conv_state, weight, bias, parents, activation)
    tensors = (x, conv_state, weight, parents) + ((bias,) if bias is not None else ())
    if use_triton(*tensors):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch_causal_conv1d_tree_update(x, conv_state, weight, bias, parents, activation, out)
        return out
    return causal_conv1d_tree_update_reference(x, conv_state, weight, bias, parents, activation)


@causal_conv1d_tree_update.register_fake
def _(x, conv_state, weight, bias, parents, activation="silu"):
    _check_update(x, conv_state, weight, bias, parents, activation)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("treespec::causal_conv1d_tree_commit", mutates_args=("conv_state",))
def causal_conv1d_tree_commit(
    conv_state: torch.Tensor, x: torch.Tensor, accepted_path: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """Shift the accepted nodes' inputs into the committed window, in place (module docstring)."""
    _check_commit(conv_state, x, accepted_path, accept_len)
    if use_triton(conv_state, x, accepted_path, accept_len):
        _launch_causal_conv1d_tree_commit(conv_state, x, accepted_path, accept_len)
    else:
        causal_conv1d_tree_commit_reference(conv_state, x, accepted_path, accept_len)


@causal_conv1d_tree_commit.register_fake
def _(conv_state, x, accepted_path, accept_len) -> None:
    _check_commit(conv_state, x, accepted_path, accept_len)
    return None


# --------------------------------------------------------------------------------------------------
# Validation (metadata only: no host sync)
# --------------------------------------------------------------------------------------------------


def _check_update(x, conv_state, weight, bias, parents, activation) -> None:
    check_dim("x", x, 3, "[B, N, C]")
    check_dim("conv_state", conv_state, 3, "[B, C, L]")
    check_dim("weight", weight, 2, "[C, Kw]")
    check_dim("parents", parents, 2, "[B, N]")
    check_dtype("x", x, *_FLOAT_DTYPES)
    check_dtype("conv_state", conv_state, *_FLOAT_DTYPES)
    check_dtype("weight", weight, *_FLOAT_DTYPES)
    check_dtype("parents", parents, torch.int64)
    batch, num_nodes, channels = x.shape
    check_num_nodes("x.shape[1] (tree nodes)", num_nodes)
    width = weight.shape[1]
    if width not in SUPPORTED_CONV_WIDTHS:
        raise ValueError(
            f"weight: conv kernel size Kw = weight.shape[1] must be one of {SUPPORTED_CONV_WIDTHS}, "
            f"got {width}"
        )
    if weight.shape[0] != channels:
        raise ValueError(f"weight: expected [C={channels}, Kw], got {tuple(weight.shape)}")
    if conv_state.shape[0] != batch or conv_state.shape[1] != channels or conv_state.shape[2] < width - 1:
        raise ValueError(
            f"conv_state: expected [B={batch}, C={channels}, L >= Kw - 1 = {width - 1}], "
            f"got {tuple(conv_state.shape)}"
        )
    if tuple(parents.shape) != (batch, num_nodes):
        raise ValueError(f"parents: expected [B={batch}, N={num_nodes}], got {tuple(parents.shape)}")
    if bias is not None:
        check_dim("bias", bias, 1, "[C]")
        check_dtype("bias", bias, *_FLOAT_DTYPES)
        if bias.shape[0] != channels:
            raise ValueError(f"bias: expected [C={channels}], got {tuple(bias.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {_ACTIVATIONS}, got {activation!r}")
    devices = dict(x=x, conv_state=conv_state, weight=weight, parents=parents)
    if bias is not None:
        devices["bias"] = bias
    check_same_device(**devices)


def _check_commit(conv_state, x, accepted_path, accept_len) -> None:
    check_dim("conv_state", conv_state, 3, "[B, C, L]")
    check_dim("x", x, 3, "[B, N, C]")
    check_dim("accepted_path", accepted_path, 2, "[B, N]")
    check_dim("accept_len", accept_len, 1, "[B]")
    check_dtype("conv_state", conv_state, *_FLOAT_DTYPES)
    check_dtype("x", x, *_FLOAT_DTYPES)
    check_dtype("accepted_path", accepted_path, torch.int64)
    check_dtype("accept_len", accept_len, torch.int64)
    batch, num_nodes, channels = x.shape
    check_num_nodes("x.shape[1] (tree nodes)", num_nodes)
    if conv_state.shape[0] != batch or conv_state.shape[1] != channels:
        raise ValueError(
            f"conv_state: expected [B={batch}, C={channels}, L], got {tuple(conv_state.shape)}"
        )
    if not 1 <= conv_state.shape[2] <= _MAX_STATE_WIDTH:
        raise ValueError(
            f"conv_state: window width L = conv_state.shape[2] must be 1..{_MAX_STATE_WIDTH}, "
            f"got {conv_state.shape[2]}"
        )
    if tuple(accepted_path.shape) != (batch, num_nodes):
        raise ValueError(
            f"accepted_path: expected [B={batch}, N={num_nodes}], got {tuple(accepted_path.shape)}"
        )
    if tuple(accept_len.shape) != (batch,):
        raise ValueError(f"accept_len: expected [B={batch}], got {tuple(accept_len.shape)}")
    check_same_device(conv_state=conv_state, x=x, accepted_path=accepted_path, accept_len=accept_len)


# --------------------------------------------------------------------------------------------------
# Triton launchers and kernels
# --------------------------------------------------------------------------------------------------


def _launch_causal_conv1d_tree_update(x, conv_state, weight, bias, parents, activation, out) -> None:
    """Fill ``out [B, N, C]`` (any strides). One program per (request, node, channel block)."""
    batch, num_nodes, channels = x.shape
    if batch == 0 or channels == 0:
        return
    block_c = min(max(16, triton.next_power_of_2(channels)), 256)
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight  # never read when HAS_BIAS is False
    _conv_tree_update_kernel[(batch * num_nodes, triton.cdiv(channels, block_c))](
        x, conv_state, weight, bias_arg, parents, out,
        num_nodes, channels, conv_state.shape[2],
        x.stride(0), x.stride(1), x.stride(2),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1),
        bias.stride(0) if has_bias else 0,
        parents.stride(0), parents.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        KW=weight.shape[1], HAS_BIAS=has_bias, SILU=activation is not None,
        ACC_FP64=weight.dtype == torch.float64, BLOCK_C=block_c,
        num_warps=4 if block_c >= 128 else 1,
    )  # fmt: skip


def _launch_causal_conv1d_tree_commit(conv_state, x, accepted_path, accept_len) -> None:
    """Rewrite ``conv_state [B, C, L]`` in place. One program per (request, channel block)."""
    batch, num_nodes, channels = x.shape
    if batch == 0 or channels == 0:
        return
    block_c = min(max(16, triton.next_power_of_2(channels)), 256)
    width = conv_state.shape[2]
    _conv_tree_commit_kernel[(batch, triton.cdiv(channels, block_c))](
        conv_state, x, accepted_path, accept_len,
        num_nodes, channels,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        x.stride(0), x.stride(1), x.stride(2),
        accepted_path.stride(0), accepted_path.stride(1), accept_len.stride(0),
        L=width, BLOCK_L=triton.next_power_of_2(width), BLOCK_C=block_c,
        num_warps=4 if block_c >= 128 else 1,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _conv_tree_update_kernel(
        x_ptr, state_ptr, w_ptr, bias_ptr, parents_ptr, out_ptr,
        num_nodes, channels, state_width,
        s_xb, s_xn, s_xc,
        s_sb, s_sc, s_sl,
        s_wc, s_wk,
        s_bc,
        s_pb, s_pn,
        s_ob, s_on, s_oc,
        KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC_FP64: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # Nodes are independent here (a window holds inputs, never outputs), so every node gets its own
        # programs; the ancestor walk is at most Kw - 1 scalar parent loads (idea from SGLang's tree
        # conv update, which follows a parent index per step instead of t - 1).
        pid = tl.program_id(0).to(tl.int64)
        b = pid // num_nodes
        t = pid % num_nodes
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < channels
        acc_ty = tl.float64 if ACC_FP64 else tl.float32

        w_last = tl.load(w_ptr + c * s_wc + (KW - 1) * s_wk, mask=cm, other=0.0).to(acc_ty)
        acc = w_last * tl.load(x_ptr + b * s_xb + t * s_xn + c * s_xc, mask=cm, other=0.0).to(acc_ty)
        node = t
        state_col = state_width  # the next committed column to use is state_col - 1
        for j in tl.static_range(1, KW):
            parent = tl.load(parents_ptr + b * s_pb + tl.maximum(node, 0) * s_pn)
            # Once off the tree the walk stays off; clamping keeps non-tree input in bounds.
            node = tl.where(node >= 0, tl.minimum(parent, num_nodes - 1), -1)
            state_col = tl.where(node >= 0, state_col, state_col - 1)
            # A scalar condition broadcast explicitly: the interpreter mis-types scalar & vector masks.
            in_tree = (tl.zeros_like(c) + node) >= 0
            from_x = tl.load(
                x_ptr + b * s_xb + tl.maximum(node, 0) * s_xn + c * s_xc, mask=cm & in_tree, other=0.0
            )
            from_state = tl.load(
                state_ptr + b * s_sb + c * s_sc + tl.maximum(state_col, 0) * s_sl,
                mask=cm & ~in_tree,
                other=0.0,
            )
            tap = tl.load(w_ptr + c * s_wc + (KW - 1 - j) * s_wk, mask=cm, other=0.0).to(acc_ty)
            acc += tap * (from_x.to(acc_ty) + from_state.to(acc_ty))  # exactly one of the two is non-zero
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c * s_bc, mask=cm, other=0.0).to(acc_ty)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + b * s_ob + t * s_on + c * s_oc, acc.to(out_ptr.dtype.element_ty), mask=cm)

    @triton.jit
    def _conv_tree_commit_kernel(
        state_ptr, x_ptr, path_ptr, len_ptr,
        num_nodes, channels,
        s_sb, s_sc, s_sl,
        s_xb, s_xn, s_xc,
        s_pb, s_pn, s_lb,
        L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # New window = last L columns of [old window | x[path[0]], ..., x[path[A - 1]]]: column j comes
        # from old column A + j while that exists, else from accepted node path[A + j - L].
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < channels
        j = tl.arange(0, BLOCK_L).to(tl.int64)
        jm = j < L
        accepted = tl.minimum(tl.maximum(tl.load(len_ptr + b * s_lb), 0), num_nodes)
        src = accepted + j
        from_old = src < L
        path_i = tl.minimum(tl.maximum(src - L, 0), num_nodes - 1)
        node = tl.load(path_ptr + b * s_pb + path_i * s_pn, mask=jm & ~from_old, other=0)
        node = tl.minimum(tl.maximum(node, 0), num_nodes - 1)
        m2 = jm[:, None] & cm[None, :]
        old = tl.load(
            state_ptr + b * s_sb + c[None, :] * s_sc + tl.minimum(src, L - 1)[:, None] * s_sl,
            mask=m2 & from_old[:, None],
            other=0.0,
        )
        new = tl.load(
            x_ptr + b * s_xb + node[:, None] * s_xn + c[None, :] * s_xc,
            mask=m2 & ~from_old[:, None],
            other=0.0,
        )
        out_ty = state_ptr.dtype.element_ty
        window = tl.where(from_old[:, None], old, new.to(out_ty))
        # Threads read columns that other threads of this program overwrite: all reads land first.
        tl.debug_barrier()
        tl.store(
            state_ptr + b * s_sb + c[None, :] * s_sc + j[:, None] * s_sl,
            window,
            mask=m2,
        )


# --------------------------------------------------------------------------------------------------
# References (CPU path and test oracle)
# --------------------------------------------------------------------------------------------------


def _acc_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


def causal_conv1d_tree_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    parents: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Pure-torch tree conv: ``x [B, N, C] -> [B, N, C]``; fp64 math when any input is fp64, else fp32.

    Vectorised over requests, nodes and channels; the only loop is the Kw - 1 step ancestor walk.
    """
    batch, num_nodes, channels = x.shape
    width = weight.shape[1]
    state_width = conv_state.shape[2]
    acc = _acc_dtype(x, conv_state, weight, bias)
    xf = x.to(acc)
    state_cols = conv_state.to(acc).transpose(1, 2)  # [B, L, C]
    w = weight.to(acc)
    node = torch.arange(num_nodes, device=x.device).expand(batch, num_nodes)
    state_col = torch.full_like(node, state_width)
    out = w[:, width - 1] * xf
    for j in range(1, width):
        parent = parents.gather(1, node.clamp(min=0))
        node = torch.where(node >= 0, parent.clamp(max=num_nodes - 1), -1)
        in_tree = node >= 0
        state_col = torch.where(in_tree, state_col, state_col - 1)
        from_x = xf.gather(1, node.clamp(min=0).unsqueeze(-1).expand(-1, -1, channels))
        column = state_col.clamp(0, state_width - 1).unsqueeze(-1).expand(-1, -1, channels)
        from_state = state_cols.gather(1, column)
        out = out + w[:, width - 1 - j] * torch.where(in_tree.unsqueeze(-1), from_x, from_state)
    if bias is not None:
        out = out + bias.to(acc)
    if activation is not None:
        out = torch.nn.functional.silu(out)
    return out.to(x.dtype)


def causal_conv1d_tree_commit_reference(
    conv_state: torch.Tensor, x: torch.Tensor, accepted_path: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """Pure-torch commit: ``conv_state [B, C, L]`` becomes the last L columns of [old | accepted inputs]."""
    batch, num_nodes, channels = x.shape
    width = conv_state.shape[2]
    accepted = accept_len.clamp(0, num_nodes).unsqueeze(1)  # [B, 1]
    src = accepted + torch.arange(width, device=x.device)  # [B, L]
    from_old = src < width
    old = conv_state.gather(2, src.clamp(max=width - 1).unsqueeze(1).expand(-1, channels, -1))  # [B, C, L]
    node = accepted_path.gather(1, (src - width).clamp(0, num_nodes - 1)).clamp(0, num_nodes - 1)
    new = x.gather(1, node.unsqueeze(-1).expand(-1, -1, channels)).transpose(1, 2)  # [B, C, L]
    conv_state.copy_(torch.where(from_old.unsqueeze(1), old, new.to(conv_state.dtype)))
