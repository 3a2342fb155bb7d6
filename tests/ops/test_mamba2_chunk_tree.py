"""Chunked Mamba2 tree verify (kernel and its chunked reference) against per-path chains of HF's decode.

The oracle is test_mamba2_tree.py's: every root-to-leaf path run as a float64 chain of HF's decode math;
each node's output and payload row must match it. The sequential op (``mamba2_tree_verify``) must agree
with the chunked one, and the chunked payload must replay to the path's state. Kernels run on
``kernel_device``: the GPU where there is one, else the Triton interpreter on CPU, so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

import treecompile.ops.mamba2_chunk_tree as chunked
import treecompile.ops.mamba2_tree as m2
from conftest import poisoned
from test_mamba2_tree import (
    accepted_paths,
    chain_oracle,
    check_against_oracle,
    device_of,
    every_other,
    every_other_column,
    make_inputs,
    parents_tensor,
    path_to,
    to_device,
)


def run_chunked(impl, x, dt, A, B, C, D, dt_bias, state, parents, spare_rows=1, block_p=None, **kw):
    """Call one implementation with NaN-poisoned output and payload on x's device (``spare_rows`` past N must
    stay NaN); returns (y, payload) there."""
    batch, n, h, p = x.shape
    g, s = B.shape[2:]
    payload = poisoned((batch, n + spare_rows, m2.mamba2_payload_width(h, p, g, s)), state.dtype, x.device)
    opts = dict(dt_softplus=kw.get("dt_softplus", True), dt_min=kw.get("dt_min"), dt_max=kw.get("dt_max"))
    if impl == "kernel":
        y = poisoned(tuple(x.shape), x.dtype, x.device)
        chunked._launch_mamba2_tree_verify_chunked(
            x, dt, A, B, C, D, dt_bias, state, parents, payload, y, *opts.values(), block_p=block_p
        )
    elif impl == "reference":
        y = chunked.mamba2_tree_verify_chunked_reference(x, dt, A, B, C, D, dt_bias, state, parents, payload, **opts)
    else:
        y = torch.ops.treespec.mamba2_tree_verify_chunked(x, dt, A, B, C, D, dt_bias, state, parents, payload, **opts)
    assert torch.isnan(payload[:, n:]).all(), f"{impl}: wrote payload rows past N"
    return y, payload[:, :n]


TREES = [
    pytest.param([("chain", 1), ("chain", 1)], id="B2-N1"),
    pytest.param([("chain", 2), ("star", 2)], id="B2-N2-chain-star"),
    pytest.param([("star", 9), ("chain", 9), ("deep_fork", 9)], id="B3-N9-star-chain-deepfork"),
    pytest.param([("random", 17), ("two_branches", 17)], id="B2-N17-random-fork"),
    pytest.param([("random", 33), ("deep_fork", 33)], id="B2-N33"),
    pytest.param([("random", 64), ("chain", 64)], id="B2-N64-random-chain"),
]


@pytest.mark.parametrize("decay", ["weak", "normal"])
@pytest.mark.parametrize("impl", ["reference", "kernel"])
@pytest.mark.parametrize("trees", TREES)
def test_chunked_matches_per_path_chains(trees, impl, decay, kernel_device):
    """float64 reference to 1e-10; the kernel (fp32 on the GPU and in the interpreter alike: fp64 dots are
    not lowered on CUDA) to fp32 rounding. Both against the float64 per-path chains. With weak decays (|A| ~
    1e-3) every ancestor, however far up the path, still contributes visibly to a node's output."""
    d = device_of(impl, kernel_device)
    parents = parents_tensor(trees, seed=7)
    batch, n = parents.shape
    dtype = torch.float64 if impl == "reference" else torch.float32
    x, dt, A, B, C, D, dt_bias, state = make_inputs(batch, n, h=2, g=1, p=16, s=16, seed=n, dtype=dtype)
    if decay == "weak":
        A = A * 1e-3
    inputs = (x, dt, A, B, C, D, dt_bias, state)
    y, payload = run_chunked(impl, *to_device(d, *inputs, parents))
    check_against_oracle(impl, inputs, parents, y.cpu(), payload.cpu(), atol=1e-10 if impl == "reference" else 2e-4)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_chunked_random_forests_fuzz(impl, kernel_device):
    """Fuzz: random forests (extra roots with parent -1) of random sizes, batched with chains and stars."""
    d = device_of(impl, kernel_device)
    gen = torch.Generator().manual_seed(123)
    for trial in range(6 if impl == "kernel" else 12):
        n = int(torch.randint(1, 65, (1,), generator=gen))
        rows = []
        for _ in range(2):
            row = [-1]
            for t in range(1, n):
                r = float(torch.rand((), generator=gen))
                row.append(-1 if r < 0.1 else t - 1 if r < 0.5 else int(torch.randint(0, t, (1,), generator=gen)))
            rows.append(row)
        parents = torch.tensor(rows)
        dtype = torch.float64 if impl == "reference" else torch.float32
        inputs = make_inputs(2, n, h=2, g=2, p=16, s=16, seed=trial, dtype=dtype)
        y, payload = run_chunked(impl, *to_device(d, *inputs, parents))
        check_against_oracle(impl, inputs, parents, y.cpu(), payload.cpu(), atol=1e-10 if impl == "reference" else 2e-4)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_chunked_groups_odd_dims_strided_inputs_options(impl, kernel_device):
    """Groups, odd head / state dims (S_n over one 64-wide chunk), several head-dim blocks, HF's strided
    split views, and every dt option."""
    d = device_of(impl, kernel_device)
    h, g, p, s = 4, 2, 40, 72
    parents = parents_tensor([("random", 11), ("deep_fork", 11)], seed=3)
    batch, n = parents.shape
    gen = torch.Generator().manual_seed(1)
    dtype = torch.float64 if impl == "reference" else torch.float32
    conv_out = torch.randn(batch, n, h * p + 2 * g * s, generator=gen, dtype=torch.float64).to(dtype)
    x, B, C = torch.split(conv_out, [h * p, g * s, g * s], dim=-1)
    x, B, C = x.reshape(batch, n, h, p), B.reshape(batch, n, g, s), C.reshape(batch, n, g, s)
    dt = torch.randn(batch, n, 3 * h, generator=gen, dtype=torch.float64).to(dtype)[..., h : 2 * h]
    assert not x.is_contiguous() and not dt.is_contiguous()
    A = (-torch.rand(h, generator=gen, dtype=torch.float64) - 0.1).to(dtype)
    D, dt_bias = torch.randn(2, h, generator=gen, dtype=torch.float64).to(dtype)
    state = torch.randn(batch, h, p, s, generator=gen, dtype=torch.float64).to(dtype) * 0.2
    options = [
        dict(D=D, dt_bias=dt_bias, kw=dict(dt_min=0.25, dt_max=1.5)),
        dict(D=None, dt_bias=None, kw=dict(dt_softplus=False)),
        dict(D=D, dt_bias=dt_bias, kw=dict(dt_max=0.5)),
    ]
    for opt in options:
        dt_in = dt if opt["kw"].get("dt_softplus", True) else dt.abs()
        inputs = (x, dt_in, A, B, C, opt["D"], opt["dt_bias"], state)
        y, payload = run_chunked(impl, *to_device(d, *inputs, parents), block_p=16, **opt["kw"])  # strides kept
        tol = 1e-10 if impl == "reference" else 5e-4
        check_against_oracle(impl, inputs, parents, y.cpu(), payload.cpu(), atol=tol, **opt["kw"])


def test_kernel_takes_views_of_state_tables(kernel_device):
    """parents every other column of a wider table, strided A, D, dt_bias, the state a transposed layer
    slice of a pool, the payload a column slice of a wider buffer and y a strided view: the kernel follows
    every stride."""
    d = kernel_device
    parents = parents_tensor([("random", 9), ("deep_fork", 9)], seed=8)
    batch, n = parents.shape
    inputs = make_inputs(batch, n, h=2, g=1, p=16, s=16, seed=8, dtype=torch.float32)
    x, dt, A, B, C, D, dt_bias, state = (t.to(d) for t in inputs)
    width = m2.mamba2_payload_width(2, 16, 1, 16)
    state_view = torch.full((batch, 3, 2, 16, 16), float("nan"), device=d)[:, 1].transpose(-1, -2)
    state_view.copy_(state)
    payload_view = poisoned((batch, n, width + 6), torch.float32, d)[:, :, 2 : 2 + width]
    y_view = poisoned((batch, n, 2, 32), torch.float32, d)[..., ::2]
    chunked._launch_mamba2_tree_verify_chunked(
        x, dt, every_other(A), B, C, every_other(D), every_other(dt_bias), state_view,
        every_other_column(parents.to(d)), payload_view, y_view, True, None, None,
    )  # fmt: skip
    check_against_oracle("kernel", inputs, parents, y_view.cpu(), payload_view.cpu(), atol=2e-4)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_chunked_strong_decays_keep_precision(impl, kernel_device):
    """Large dt and |A| (path decays down to e^-600): seg is summed along the path, not as a difference
    of two long cumulative sums, so fp32 keeps the recent terms' precision."""
    d = device_of(impl, kernel_device)
    parents = parents_tensor([("random", 40), ("chain", 40)], seed=5)
    dtype = torch.float64 if impl == "reference" else torch.float32
    x, dt, A, B, C, D, dt_bias, state = make_inputs(2, 40, h=2, g=1, p=16, s=16, seed=9, dtype=dtype)
    dt = dt.abs() * 3 + 1  # softplus keeps it ~1..10
    A = A * 8
    inputs = (x, dt, A, B, C, D, dt_bias, state)
    y, payload = run_chunked(impl, *to_device(d, *inputs, parents))
    check_against_oracle(impl, inputs, parents, y.cpu(), payload.cpu(), atol=1e-10 if impl == "reference" else 2e-4)


def test_kernel_bf16_inputs_fp32_state_matches_sequential_kernel(kernel_device):
    """bf16 activations, fp32 state and parameters (HF's dtypes): the chunked and the sequential kernel
    agree to fp32 rounding, and their payload rows too."""
    d = kernel_device
    parents = parents_tensor([("random", 20), ("two_branches", 20)], seed=2)
    x, dt, A, B, C, D, dt_bias, state = make_inputs(2, 20, h=4, g=2, p=16, s=32, dtype=torch.bfloat16)
    A, D, dt_bias = A.float(), D.float(), dt_bias.float()
    inputs = to_device(d, x, dt, A, B, C, D, dt_bias, state, parents)
    y, payload = run_chunked("kernel", *inputs, spare_rows=0)
    assert y.dtype == torch.bfloat16
    seq_payload = poisoned(tuple(payload.shape), torch.float32, d)
    seq_y = poisoned(tuple(x.shape), x.dtype, d)
    m2._launch_mamba2_tree_verify(*inputs, seq_payload, seq_y, True, None, None, staged=False)
    torch.testing.assert_close(y.float().cpu(), seq_y.float().cpu(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(payload.cpu(), seq_payload.cpu(), atol=1e-6, rtol=1e-6)


def test_op_is_the_chunked_reference_on_cpu():
    parents = parents_tensor([("random", 9), ("star", 9)], seed=6)
    inputs = make_inputs(2, 9, h=2, g=1, p=8, s=16, dtype=torch.float32)
    by_op, op_payload = run_chunked("op", *inputs, parents)
    by_ref, ref_payload = run_chunked("reference", *inputs, parents)
    assert torch.equal(by_op, by_ref) and torch.equal(op_payload, ref_payload)


def test_verify_leaves_state_pool_untouched(kernel_device):
    parents = parents_tensor([("random", 12)])
    inputs = make_inputs(1, 12, h=2, g=1, p=16, s=16, dtype=torch.float32)
    before = inputs[-1].clone()
    for impl in ("kernel", "reference", "op"):
        *moved, parents_d = to_device(device_of(impl, kernel_device), *inputs, parents)
        run_chunked(impl, *moved, parents_d)
        assert torch.equal(moved[-1].cpu(), before), impl


def test_replay_of_chunked_payload_equals_path_state(kernel_device):
    """The payload feeds mamba2_replay_commit: replaying accepted paths gives the paths' chain states."""
    d = kernel_device
    parents = parents_tensor([("random", 30), ("deep_fork", 30)], seed=8)
    inputs = make_inputs(2, 30, h=2, g=1, p=16, s=16, dtype=torch.float32, seed=3)
    x, dt, A, B, C, D, dt_bias, state = inputs
    _, payload = run_chunked("kernel", *to_device(d, *inputs, parents), spare_rows=0)
    paths, lens = accepted_paths(parents, seed=4)
    committed = state.clone().to(d)
    m2._launch_mamba2_replay_commit(committed, payload, *to_device(d, paths, lens))
    committed = committed.cpu()
    for b in range(2):
        path = paths[b, : int(lens[b])].tolist()
        if not path:
            assert torch.equal(committed[b], state[b])
            continue
        _, states = chain_oracle(x[b], dt[b], A, B[b], C[b], D, dt_bias, state[b], path)
        torch.testing.assert_close(committed[b].double(), states[-1], atol=2e-4, rtol=2e-4)
    assert path_to(parents[0].tolist(), 0) == [0]


def test_non_tree_parents_touch_nothing_out_of_bounds(kernel_device):
    """Parents that are not a tree (forward references, out of range) are clamped as in the sequential
    kernel: the kernel and the reference agree and every output is written."""
    parents = torch.tensor([[-1, 5, 99, -7, 2, 3], [4, 0, 1, 1, 3, 3]])
    inputs = make_inputs(2, 6, h=2, g=1, p=16, s=16, dtype=torch.float32)
    y, payload = run_chunked("kernel", *to_device(kernel_device, *inputs, parents))
    y, payload = y.cpu(), payload.cpu()
    y_ref, payload_ref = run_chunked("reference", *inputs, parents)
    assert torch.isfinite(y).all() and torch.isfinite(payload).all()
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(payload, payload_ref)


# --------------------------------------------------------------------------------------------------
# opcheck, bad input
# --------------------------------------------------------------------------------------------------


def small_case(n=3, dtype=torch.float32):
    parents = parents_tensor([("random", n)], seed=1)
    x, dt, A, B, C, D, dt_bias, state = make_inputs(1, n, h=2, g=1, p=4, s=4, dtype=dtype)
    payload = torch.zeros(1, n, m2.mamba2_payload_width(2, 4, 1, 4), dtype=state.dtype)
    return x, dt, A, B, C, D, dt_bias, state, parents, payload


def test_opcheck():
    op = torch.ops.treespec.mamba2_tree_verify_chunked.default
    args = small_case()
    torch.library.opcheck(op, args, {"dt_softplus": True, "dt_min": None, "dt_max": None})
    torch.library.opcheck(op, args[:5] + (None, None) + args[7:], {"dt_softplus": False, "dt_min": 0.1, "dt_max": 2.0})


def test_bad_input_is_refused():
    x, dt, A, B, C, D, dt_bias, state, parents, payload = small_case()
    op = torch.ops.treespec.mamba2_tree_verify_chunked

    def verify(**override):
        args = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, state=state, parents=parents, payload=payload)
        args.update(override)
        return op(*args.values())

    assert verify().shape == (1, 3, 2, 4)  # the unmodified case is accepted
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        op(*small_case(65))
    op(*small_case(64))  # the limit itself is accepted
    with pytest.raises(ValueError, match="parents: expected dtype torch.int64"):
        verify(parents=parents.int())
    with pytest.raises(ValueError, match="state: the recurrent state must be torch.float32"):
        verify(state=state.bfloat16(), payload=payload.bfloat16())
    with pytest.raises(ValueError, match="payload: expected"):
        verify(payload=payload[:, :, :-1])
    with pytest.raises(ValueError, match="payload: expected"):
        verify(payload=payload[:, :2])
    with pytest.raises(ValueError, match="payload: dtype torch.float64 must equal the state dtype"):
        verify(payload=payload.double())
    with pytest.raises(ValueError, match="multiple of the groups"):
        verify(B=torch.zeros(1, 3, 3, 4), C=torch.zeros(1, 3, 3, 4))
    with pytest.raises(ValueError, match="dt: expected"):
        verify(dt=dt[:, :, :1])
    with pytest.raises(ValueError, match="state: expected"):
        verify(state=state[:, :1])
