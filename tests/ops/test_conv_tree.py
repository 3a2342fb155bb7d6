"""Causal conv1d over a draft tree: each node's window against its root-to-node path run as a chain.

The oracle concatenates the committed window and the path's inputs and runs a float64 ``F.conv1d``
(HF's ``causal_conv1d_update`` math); chains are also checked against HF's function itself, including
the conv state it leaves, which the tree commit must reproduce. Kernels run on ``kernel_device`` (the GPU
where there is one, else the Triton interpreter on CPU); the oracles and the ops' CPU reference path stay on
the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import treecompile.ops.conv_tree as conv
from conftest import poisoned

import transformers.models.qwen3_next.modeling_qwen3_next as hf_qwen3_next  # noqa: E402  (a rename fails here)


def make_parents(kind: str, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "random":
        return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    raise AssertionError(kind)


def path_to(row: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = row[node]
    return path[::-1]


def make_case(kinds, n, channels, width, state_width, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = len(kinds)
    parents = torch.tensor([make_parents(kind, n, seed + b) for b, kind in enumerate(kinds)])
    x = torch.randn(batch, n, channels, generator=gen, dtype=torch.float64).to(dtype)
    conv_state = torch.randn(batch, channels, state_width, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(channels, width, generator=gen, dtype=torch.float64).to(dtype)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64).to(dtype)
    return x, conv_state, weight, bias, parents


def path_oracle(x, conv_state, weight, bias, parents, activation):
    """Node t's output = last output of a float64 conv over [committed window | x[path to t]]."""
    batch, n, channels = x.shape
    out = torch.empty(batch, n, channels, dtype=torch.float64)
    for b, row in enumerate(parents.tolist()):
        for t in range(n):
            seq = torch.cat([conv_state[b].double(), x[b, path_to(row, t)].double().T], dim=-1)
            taps, shift = weight.double()[:, None], None if bias is None else bias.double()
            y = F.conv1d(seq[None], taps, shift, groups=channels)
            y = y[0, :, -1]
            out[b, t] = F.silu(y) if activation else y
    return out


def to_device(device, *tensors):
    """The tensors moved to ``device`` (None stays None)."""
    return tuple(None if t is None else t.to(device) for t in tensors)


def device_of(impl: str, kernel_device: str) -> str:
    """Where ``impl`` runs: the kernel on ``kernel_device``, the op on the CPU (its reference path there)."""
    return kernel_device if impl == "kernel" else "cpu"


def run_update(impl, x, conv_state, weight, bias, parents, activation):
    """The kernel (NaN-poisoned output on x's device) or the op; the output on x's device."""
    if impl == "kernel":
        out = poisoned(x.shape, x.dtype, x.device)
        conv._launch_causal_conv1d_tree_update(x, conv_state, weight, bias, parents, activation, out)
        return out
    return torch.ops.treespec.causal_conv1d_tree_update(x, conv_state, weight, bias, parents, activation)


CASES = [
    pytest.param(["chain", "chain"], 1, 4, 4, True, "silu", id="B2-N1-Kw4-L4-bias-silu"),
    pytest.param(["chain", "star"], 2, 2, 1, False, None, id="B2-N2-Kw2-L1-nobias-linear"),
    pytest.param(["random", "star"], 33, 3, 3, True, "silu", id="B2-N33-Kw3-L3-random-star"),
    pytest.param(["random"], 64, 4, 3, False, "silu", id="B1-N64-Kw4-L3-random"),
    pytest.param(["chain"], 63, 4, 4, True, "swish", id="B1-N63-Kw4-L4-chain"),
]


@pytest.mark.parametrize("impl", ["kernel", "op"])
@pytest.mark.parametrize("kinds,n,width,state_width,with_bias,activation", CASES)
def test_update_matches_per_path_conv(kinds, n, width, state_width, with_bias, activation, impl, kernel_device):
    d = device_of(impl, kernel_device)
    x, conv_state, weight, bias, parents = make_case(kinds, n, 10, width, state_width)
    bias = bias if with_bias else None
    before = conv_state.clone()
    moved = to_device(d, x, conv_state, weight, bias, parents)
    out = run_update(impl, *moved, activation).cpu()
    want = path_oracle(x, conv_state, weight, bias, parents, activation)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    assert torch.equal(moved[1].cpu(), before), "verify must not write the committed window"


@pytest.mark.parametrize("impl", ["kernel", "op"])
def test_update_strided_input_and_channel_blocks(impl, kernel_device):
    """HF hands the conv a [B, C, N] tensor transposed to [B, N, C]; C = 300 spans two channel blocks."""
    d = device_of(impl, kernel_device)
    _, conv_state, weight, bias, parents = make_case(["random"], 5, channels=300, width=4, state_width=4)
    x = torch.randn(1, 300, 5, dtype=torch.float64).transpose(1, 2)
    moved = to_device(d, x, conv_state, weight, bias, parents)
    assert not x.is_contiguous() and not moved[0].is_contiguous()  # .to keeps a dense tensor's strides
    out = run_update(impl, *moved, "silu").cpu()
    want = path_oracle(x, conv_state, weight, bias, parents, "silu")
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_update_low_precision_rounds_once(dtype, kernel_device):
    x, conv_state, weight, bias, parents = make_case(["random", "chain"], 9, 16, 4, 3, dtype=dtype, seed=3)
    moved = to_device(kernel_device, x, conv_state, weight.float(), bias.float(), parents)
    out = run_update("kernel", *moved, "silu").cpu()
    want = path_oracle(x, conv_state, weight.float(), bias.float(), parents, "silu")
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    by_op = run_update("op", x, conv_state, weight.float(), bias.float(), parents, "silu")
    torch.testing.assert_close(by_op.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("state_width", [3, 4], ids=["L3", "L4-hf-cache"])
def test_chain_matches_hf_causal_conv1d_update_and_commit(state_width, kernel_device):
    """A chain through the tree op and commit equals HF's decode-time conv, output and window alike."""
    d = kernel_device
    n, channels = 6, 12
    x, conv_state, weight, bias, parents = make_case(["chain", "chain"], n, channels, 4, state_width, seed=9)
    hf_state = conv_state.clone()
    want = hf_qwen3_next.causal_conv1d_update(x.transpose(1, 2), hf_state, weight, bias, "silu")
    want = want.transpose(1, 2)
    for impl in ("kernel", "op"):
        moved = to_device(device_of(impl, d), x, conv_state, weight, bias, parents)
        torch.testing.assert_close(run_update(impl, *moved, "silu").cpu(), want)
    path = torch.arange(n).expand(2, n).contiguous()
    lens = torch.full((2,), n)
    committed = conv_state.clone().to(d)
    conv._launch_causal_conv1d_tree_commit(committed, *to_device(d, x, path, lens))
    assert torch.equal(committed.cpu(), hf_state)
    committed = conv_state.clone()
    torch.ops.treespec.causal_conv1d_tree_commit(committed, x, path, lens)
    assert torch.equal(committed, hf_state)


@pytest.mark.parametrize("impl", ["kernel", "op"])
@pytest.mark.parametrize("state_width", [1, 3, 4], ids=["L1", "L3", "L4"])
def test_commit_shifts_accepted_inputs_in(state_width, impl, kernel_device):
    d = device_of(impl, kernel_device)
    n, channels = 7, 20
    kinds = ["random", "random", "chain", "chain"]
    x, conv_state, _, _, parents = make_case(kinds, n, channels, 4, state_width)
    lens = torch.tensor([0, 1, 2, 5])  # shorter and longer than the window
    paths = torch.full((4, n), -1, dtype=torch.int64)
    for b, row in enumerate(parents.tolist()):
        deepest = max(range(n), key=lambda t: len(path_to(row, t)))
        path = path_to(row, deepest)[: int(lens[b])]
        assert len(path) == int(lens[b])
        paths[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
    committed = conv_state.clone().to(d)
    if impl == "kernel":
        conv._launch_causal_conv1d_tree_commit(committed, *to_device(d, x, paths, lens))
    else:
        torch.ops.treespec.causal_conv1d_tree_commit(committed, x, paths, lens)
    committed = committed.cpu()
    for b in range(4):
        accepted = paths[b, : int(lens[b])]
        want = torch.cat([conv_state[b], x[b, accepted].T], dim=-1)[:, -state_width:]
        assert torch.equal(committed[b], want), f"request {b}"


def every_other_column(t: torch.Tensor) -> torch.Tensor:
    """``t [B, K]`` as every other column of a wider table (strides (2K + 1, 2)), junk in between."""
    table = torch.full((t.shape[0], 2 * t.shape[1] + 1), -7, dtype=t.dtype, device=t.device)
    table[:, 1::2] = t
    return table[:, 1::2]


def test_kernels_take_views_of_state_tables(kernel_device):
    """The window a slice of a wider conv buffer, parents / accepted_path / accept_len views of wider
    per-request tables, weight and bias columns: the kernels follow every stride."""
    d = kernel_device
    n, channels = 6, 20
    x, conv_state, weight, bias, parents = make_case(["random", "chain", "random"], n, channels, 4, 3, seed=4)
    lens = torch.tensor([3, 0, 6])
    paths = torch.full((3, n), -1, dtype=torch.int64)
    for b, row in enumerate(parents.tolist()):
        path = path_to(row, n - 1)[: int(lens[b])]
        lens[b] = len(path)
        paths[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
    wide_state = torch.full((3, channels, 6), float("nan"), dtype=torch.float64, device=d)
    state_view = wide_state[:, :, 2:5]
    state_view.copy_(conv_state)
    taps = torch.full((channels, 3, 4), float("nan"), dtype=torch.float64, device=d)
    taps[:, 1] = weight
    shifts = torch.full((channels, 2), float("nan"), dtype=torch.float64, device=d)
    shifts[:, 0] = bias
    len_table = torch.full((3, 64), -7, dtype=torch.int64, device=d)
    len_table[:, 9] = lens

    out = poisoned(x.shape, x.dtype, d)
    conv._launch_causal_conv1d_tree_update(
        x.to(d), state_view, taps[:, 1], shifts[:, 0], every_other_column(parents.to(d)), "silu", out
    )
    torch.testing.assert_close(out.cpu(), path_oracle(x, conv_state, weight, bias, parents, "silu"))

    conv._launch_causal_conv1d_tree_commit(state_view, x.to(d), every_other_column(paths.to(d)), len_table[:, 9])
    for b in range(3):
        want = torch.cat([conv_state[b], x[b, paths[b, : int(lens[b])]].T], dim=-1)[:, -3:]
        assert torch.equal(state_view[b].cpu(), want), f"request {b}"
    assert wide_state[:, :, :2].isnan().all() and wide_state[:, :, 5:].isnan().all(), "wrote outside the window"


def test_opcheck():
    x, conv_state, weight, bias, parents = make_case(["random"], 5, 6, 4, 3, dtype=torch.float32)
    update = torch.ops.treespec.causal_conv1d_tree_update.default
    torch.library.opcheck(update, (x, conv_state, weight, bias, parents, "silu"))
    torch.library.opcheck(update, (x, conv_state, weight, None, parents, None))
    torch.library.opcheck(
        torch.ops.treespec.causal_conv1d_tree_commit.default,
        (conv_state.clone(), x, torch.tensor([[0, 1, -1, -1, -1]]), torch.tensor([2])),
    )


def test_bad_input_is_refused_before_launch():
    x, conv_state, weight, bias, parents = make_case(["random"], 5, 6, 4, 3, dtype=torch.float32)
    update = torch.ops.treespec.causal_conv1d_tree_update
    for width in (1, 5):
        message = rf"conv kernel size Kw = weight.shape\[1\] must be one of \(2, 3, 4\), got {width}"
        with pytest.raises(ValueError, match=message):
            update(x, torch.zeros(1, 6, 4), torch.zeros(6, width), None, parents, "silu")
    x65 = torch.zeros(1, 65, 6)
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        update(x65, conv_state, weight, None, torch.full((1, 65), -1), "silu")
    with pytest.raises(ValueError, match=r"conv_state: expected \[B=1, C=6, L >= Kw - 1 = 3\]"):
        update(x, conv_state[..., :2], weight, None, parents, "silu")
    with pytest.raises(ValueError, match="activation"):
        update(x, conv_state, weight, None, parents, "gelu")
    with pytest.raises(ValueError, match="parents: expected dtype torch.int64"):
        update(x, conv_state, weight, None, parents.int(), "silu")
    with pytest.raises(ValueError, match="bias: expected"):
        update(x, conv_state, weight, bias[:3], parents, "silu")
    commit = torch.ops.treespec.causal_conv1d_tree_commit
    with pytest.raises(ValueError, match="accept_len: expected"):
        commit(conv_state, x, torch.zeros(1, 5, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        commit(conv_state, x65, torch.zeros(1, 65, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
