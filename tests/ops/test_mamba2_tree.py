"""Mamba2 tree verify, replay commit and the staged fallback against per-path chains of HF's decode step.

Every root-to-leaf path is run as a plain chain of HF's own single-token update
(``mamba2_selective_state_update``) in float64; each node's output, payload row and (staged) state must
match it. The fp32 reference must equal HF's token-by-token decode bit for bit (it is the CPU path of
lossless speculation). Kernels run on ``kernel_device``: the GPU where there is one, else the Triton interpreter
on CPU, so shapes stay small. Oracles and the ops' CPU reference path stay on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import treecompile.ops.mamba2_tree as m2
from conftest import poisoned

import transformers.models.mamba2.modeling_mamba2 as hf_mamba2  # noqa: E402  (a rename fails here)


# --------------------------------------------------------------------------------------------------
# Trees and inputs
# --------------------------------------------------------------------------------------------------


def make_parents(kind: str, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "star":  # every node a child of the root: each one replays the root
        return [-1] + [0] * (n - 1)
    if kind == "two_branches":  # a chain that forks at the root
        half = (n + 1) // 2
        return [-1] + [i - 1 for i in range(1, half)] + [0] + [i - 1 for i in range(half + 1, n)]
    if kind == "deep_fork":  # a long chain whose last nodes branch off deep ancestors: long replays
        spine = max((n + 1) // 2, 2)
        return [i - 1 for i in range(min(spine, n))] + [spine - 2 - i % (spine - 1) for i in range(n - spine)]
    if kind == "random":
        return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    raise AssertionError(kind)


def parents_tensor(kinds_and_n, seed=0) -> torch.Tensor:
    return torch.tensor([make_parents(kind, n, seed + i) for i, (kind, n) in enumerate(kinds_and_n)])


def make_inputs(batch, n, h, g, p, s, dtype=torch.float64, seed=0, with_d=True, with_bias=True):
    """x, dt, A, B, C, D, dt_bias, state in HF's shapes (dt raw, before bias and softplus)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    x, dt = rnd(batch, n, h, p), rnd(batch, n, h)
    A = -torch.rand(h, generator=gen, dtype=torch.float64).to(dtype) * 2 - 0.1  # -exp(A_log) < 0
    B, C = rnd(batch, n, g, s), rnd(batch, n, g, s)
    D = rnd(h) if with_d else None
    dt_bias = rnd(h) if with_bias else None
    state = (rnd(batch, h, p, s) * 0.5).to(torch.float64 if dtype == torch.float64 else torch.float32)
    return x, dt, A, B, C, D, dt_bias, state


def path_to(parents_row: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents_row[node]
    return path[::-1]


def leaves(parents_row: list[int]) -> list[int]:
    has_child = {p for p in parents_row if p >= 0}
    return [t for t in range(len(parents_row)) if t not in has_child]


def hf_step(S, x_t, dt_t, A, B_t, C_t, D, dt_bias, dt_softplus=True):
    """HF's decode step for one request and token, called as ``Mamba2Mixer.forward`` calls it.

    S [1, H, P, S_n] advances in place; x_t [H, P]; dt_t [H]; B_t, C_t [G, S_n]. Returns y [H, P].
    """
    h, p = x_t.shape
    s = S.shape[-1]
    y = hf_mamba2.mamba2_selective_state_update(
        S, x_t[None], dt_t[None, :, None].expand(-1, -1, p), A[:, None, None].expand(-1, p, s),
        B_t[None], C_t[None], None if D is None else D[:, None].expand(-1, p),
        z=None, dt_bias=None if dt_bias is None else dt_bias[:, None].expand(-1, p), dt_softplus=dt_softplus,
    )  # fmt: skip
    return y[0]


def chain_oracle(x, dt, A, B, C, D, dt_bias, state, path, dt_softplus=True, dt_min=None, dt_max=None):
    """One request's path as a float64 chain of HF's decode math: per-node outputs [H, P] and states.

    Written out here rather than calling HF's ``mamba2_selective_state_update`` in float64, because HF
    computes ``exp(dt.float() * A.float())`` in fp32 whatever the dtype (the fp32 tests below compare
    with HF's own function bit for bit).
    """
    h, g = x.shape[-2], B.shape[-2]
    A = A.double()
    S = state.double().clone()
    outs, states = [], []
    for t in path:
        dt_t = dt[t].double() + (0 if dt_bias is None else dt_bias.double())
        dt_t = torch.nn.functional.softplus(dt_t) if dt_softplus else dt_t
        if dt_min is not None or dt_max is not None:
            dt_t = dt_t.clamp(dt_min, dt_max)
        x_t = x[t].double()
        B_t = B[t].double().repeat_interleave(h // g, dim=0)  # [H, S_n]
        C_t = C[t].double().repeat_interleave(h // g, dim=0)
        S = S * torch.exp(dt_t * A)[:, None, None] + torch.einsum("h,hs,hp->hps", dt_t, B_t, x_t)
        y = torch.einsum("hps,hs->hp", S, C_t)
        outs.append(y if D is None else y + D.double()[:, None] * x_t)
        states.append(S.clone())
    return outs, states


def node_oracle(x, dt, A, B, C, D, dt_bias, state, parents, **kw):
    """Per request and node: (output, state) of the node's root-to-node path run as a chain."""
    result = {}
    for b, row in enumerate(parents.tolist()):
        for leaf in leaves(row):
            path = path_to(row, leaf)
            outs, states = chain_oracle(x[b], dt[b], A, B[b], C[b], D, dt_bias, state[b], path, **kw)
            for t, o, s in zip(path, outs, states):
                result[(b, t)] = (o, s)
    return result


def to_device(device, *tensors):
    """The tensors on ``device`` with their strides kept (None stays None; a tensor already there is returned
    itself): ``.to`` would copy a view with gaps, such as HF's split views, into a contiguous tensor."""
    moved = []
    for t in tensors:
        if t is not None and t.device.type != torch.device(device).type:
            t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)
        moved.append(t)
    return tuple(moved)


def device_of(impl: str, kernel_device: str) -> str:
    """Where ``impl`` runs: a kernel on ``kernel_device``; an op or a reference on the CPU (the op's reference
    path there)."""
    return kernel_device if impl.endswith("kernel") else "cpu"


def assert_close(actual, expected, tol, what):
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda report: f"{what}: {report}")


def run_verify(impl, x, dt, A, B, C, D, dt_bias, state, parents, **kw):
    """Call a verify implementation with NaN-poisoned output and buffer on x's device; returns (y, payload or
    scratch) there."""
    batch, n, h, p = x.shape
    g, s = B.shape[2:]
    staged = impl.startswith("staged")
    width = m2.mamba2_payload_width(h, p, g, s)
    buf = poisoned((batch, n, h, p, s) if staged else (batch, n, width), state.dtype, x.device)
    kwargs = dict(dt_softplus=kw.get("dt_softplus", True), dt_min=kw.get("dt_min"), dt_max=kw.get("dt_max"))
    if impl.endswith("kernel"):
        y = poisoned(tuple(x.shape), x.dtype, x.device)
        launch = m2._launch_mamba2_tree_verify
        launch(x, dt, A, B, C, D, dt_bias, state, parents, buf, y, **kwargs, staged=staged)
    else:
        op = torch.ops.treespec.mamba2_tree_verify_staged if staged else torch.ops.treespec.mamba2_tree_verify
        y = op(x, dt, A, B, C, D, dt_bias, state, parents, buf, **kwargs)
    return y, buf


IMPLS = ["kernel", "op", "staged-kernel", "staged-op"]  # "op" on CPU tensors is the reference


def expected_payload(x, dt, A, B, dt_bias, dt_softplus=True, dt_min=None, dt_max=None):
    batch, n = x.shape[:2]
    dtp = dt.double() + (0 if dt_bias is None else dt_bias.double())
    dtp = torch.nn.functional.softplus(dtp) if dt_softplus else dtp
    if dt_min is not None or dt_max is not None:
        dtp = dtp.clamp(dt_min, dt_max)
    rows = [x.double().reshape(batch, n, -1), dtp, dtp * A.double(), B.double().reshape(batch, n, -1)]
    return torch.cat(rows, -1)


def check_against_oracle(impl, inputs, parents, y, buf, atol, **kw):
    x, dt, A, B, C, D, dt_bias, state = inputs
    oracle = node_oracle(x, dt, A, B, C, D, dt_bias, state, parents, **kw)
    batch, n = parents.shape
    for b in range(batch):
        for t in range(n):
            want_y, want_s = oracle[(b, t)]
            assert_close(y[b, t].double(), want_y, atol, f"y[{b}, {t}]")
            if impl.startswith("staged"):
                assert_close(buf[b, t].double(), want_s, atol, f"scratch[{b}, {t}]")
    if not impl.startswith("staged"):
        want = expected_payload(x, dt, A, B, dt_bias, **kw)
        torch.testing.assert_close(buf.double(), want, atol=atol, rtol=atol)


# --------------------------------------------------------------------------------------------------
# Verify
# --------------------------------------------------------------------------------------------------

TREES = [
    pytest.param([("chain", 1), ("chain", 1)], id="B2-N1"),
    pytest.param([("chain", 2), ("star", 2)], id="B2-N2-chain-star"),
    pytest.param([("random", 33), ("two_branches", 33)], id="B2-N33-random-fork"),
    pytest.param([("random", 64)], id="B1-N64-random"),
    pytest.param([("star", 9), ("chain", 9), ("deep_fork", 9)], id="B3-N9-star-chain-deepfork"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("trees", TREES)
def test_verify_matches_per_path_chains(trees, impl, kernel_device):
    d = device_of(impl, kernel_device)
    parents = parents_tensor(trees, seed=7)
    batch, n = parents.shape
    inputs = make_inputs(batch, n, h=2, g=1, p=8, s=16, seed=n)
    y, buf = run_verify(impl, *to_device(d, *inputs, parents))
    check_against_oracle(impl, inputs, parents, y.cpu(), buf.cpu(), atol=1e-10)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((4, 2, 12, 10), id="H4-G2-P12-S10"),
        pytest.param((2, 1, 40, 64), id="H2-G1-P40-S64-two-head-dim-blocks"),
    ],
)
def test_verify_groups_odd_dims_strided_inputs_options(shape, impl, kernel_device):
    """Groups, odd head / state dims, several head-dim blocks, HF's strided split views, every option."""
    d = device_of(impl, kernel_device)
    h, g, p, s = shape
    parents = parents_tensor([("random", 7)], seed=3)
    n = parents.shape[1]
    gen = torch.Generator().manual_seed(1)
    # HF's layout: projected_states -> (gate, xBC, dt); conv output xBC -> (x, B, C), all split views.
    conv_out = torch.randn(1, n, h * p + 2 * g * s, generator=gen, dtype=torch.float64)
    x, B, C = torch.split(conv_out, [h * p, g * s, g * s], dim=-1)
    x, B, C = x.reshape(1, n, h, p), B.reshape(1, n, g, s), C.reshape(1, n, g, s)
    dt = torch.randn(1, n, 3 * h, generator=gen, dtype=torch.float64)[..., h : 2 * h]
    assert not x.is_contiguous() and not dt.is_contiguous()
    A = -torch.rand(h, generator=gen, dtype=torch.float64) - 0.1
    D, dt_bias = torch.randn(2, h, generator=gen, dtype=torch.float64)
    state = torch.randn(1, h, p, s, generator=gen, dtype=torch.float64)
    options = [
        dict(D=D, dt_bias=dt_bias, kw=dict(dt_min=0.25, dt_max=1.5)),  # binding limits (exact in fp32)
        dict(D=None, dt_bias=None, kw=dict(dt_softplus=False)),
        dict(D=D, dt_bias=dt_bias, kw=dict(dt_max=0.5)),
    ]
    for opt in options:
        dt_in = dt if opt["kw"].get("dt_softplus", True) else dt.abs()  # no softplus: keep dt positive
        inputs = (x, dt_in, A, B, C, opt["D"], opt["dt_bias"], state)
        y, buf = run_verify(impl, *to_device(d, *inputs, parents), **opt["kw"])  # the views' strides kept
        check_against_oracle(impl, inputs, parents, y.cpu(), buf.cpu(), atol=1e-9, **opt["kw"])


def test_verify_leaves_state_pool_untouched(kernel_device):
    parents = parents_tensor([("random", 12)])
    inputs = make_inputs(1, 12, h=2, g=1, p=8, s=16, dtype=torch.float32)
    before = inputs[-1].clone()
    for impl in IMPLS:
        *moved, parents_d = to_device(device_of(impl, kernel_device), *inputs, parents)
        run_verify(impl, *moved, parents_d)
        assert torch.equal(moved[-1].cpu(), before), impl


def hf_decode(x, dt, A, B, C, D, dt_bias, state, path):
    """HF's decode token by token along ``path`` (one request, the inputs' dtype): outputs, final state."""
    S = state.clone()[None]
    outs = [hf_step(S, x[t], dt[t], A, B[t], C[t], D, dt_bias) for t in path]
    return outs, S[0]


def test_reference_fp32_is_bitwise_hf_decode_on_every_path():
    """The CPU path (fp32) must reproduce HF's decode exactly, so greedy stays token-exact."""
    parents = parents_tensor([("random", 10), ("two_branches", 10)], seed=5)
    x, dt, A, B, C, D, dt_bias, state = make_inputs(2, 10, h=4, g=2, p=8, s=16, dtype=torch.float32)
    y, payload = run_verify("op", x, dt, A, B, C, D, dt_bias, state, parents)
    scratch_y, scratch = run_verify("staged-op", x, dt, A, B, C, D, dt_bias, state, parents)
    assert torch.equal(y, scratch_y)
    for b, row in enumerate(parents.tolist()):
        for leaf in leaves(row):
            path = path_to(row, leaf)
            outs, final = hf_decode(x[b], dt[b], A, B[b], C[b], D, dt_bias, state[b], path)
            for t, want in zip(path, outs):
                assert torch.equal(y[b, t], want), f"y[{b}, {t}] differs from HF decode by {(y[b, t] - want).abs().max().item():.3g}"
            assert torch.equal(scratch[b, leaf], final), f"scratch state of {leaf} differs from HF decode"
            commit = state[b : b + 1].clone()
            accepted = torch.tensor([path + [-1] * (10 - len(path))])
            lens = torch.tensor([len(path)])
            torch.ops.treespec.mamba2_replay_commit(commit, payload[b : b + 1], accepted, lens)
            assert torch.equal(commit[0], final), f"replayed state of path to {leaf} differs from HF decode"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_fp32_state_matches_hf_decode(dtype, kernel_device):
    """The kernel with an fp32 state against HF's decode on a tree's paths (HF in fp32 inputs' math)."""
    d = kernel_device
    parents = parents_tensor([("random", 9)], seed=2)
    x, dt, A, B, C, D, dt_bias, state = make_inputs(1, 9, h=2, g=1, p=16, s=16, dtype=dtype)
    A, D, dt_bias = A.float(), D.float(), dt_bias.float()  # HF keeps A, D, dt_bias in fp32 parameters
    y, _ = run_verify("kernel", *to_device(d, x, dt, A, B, C, D, dt_bias, state, parents))
    y = y.cpu()
    assert y.dtype == dtype
    row = parents[0].tolist()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for leaf in leaves(row):
        path = path_to(row, leaf)
        xf, dtf, Bf, Cf = x[0].float(), dt[0].float(), B[0].float(), C[0].float()
        outs, _ = hf_decode(xf, dtf, A, Bf, Cf, D, dt_bias, state[0], path)
        for t, want in zip(path, outs):
            assert_close(y[0, t].float(), want, tol, f"y[0, {t}]")


# --------------------------------------------------------------------------------------------------
# Replay commit and the staged commit
# --------------------------------------------------------------------------------------------------


def accepted_paths(parents: torch.Tensor, seed: int):
    """A random root-first path per request (stopping anywhere, possibly empty), padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    paths = torch.full((batch, n), -1, dtype=torch.int64)
    lens = torch.zeros(batch, dtype=torch.int64)
    for b, row in enumerate(parents.tolist()):
        target = int(torch.randint(0, n, (1,), generator=gen))
        path = path_to(row, target)
        cut = int(torch.randint(0, len(path) + 1, (1,), generator=gen)) if b % 2 else len(path)
        paths[b, :cut] = torch.tensor(path[:cut], dtype=torch.int64)
        lens[b] = cut
    return paths, lens


@pytest.mark.parametrize(
    "trees",
    [
        pytest.param([("chain", 1), ("chain", 1)], id="B2-N1"),
        pytest.param([("random", 33), ("two_branches", 33)], id="B2-N33"),
        pytest.param([("random", 64), ("deep_fork", 64)], id="B2-N64"),
    ],
)
def test_replay_and_staged_commit_equal_sequential_decode(trees, kernel_device):
    d = kernel_device
    parents = parents_tensor(trees, seed=11)
    batch, n = parents.shape
    inputs = make_inputs(batch, n, h=2, g=1, p=8, s=16, seed=2)
    x, dt, A, B, C, D, dt_bias, state = inputs
    _, payload = run_verify("op", *inputs, parents)
    _, scratch = run_verify("staged-op", *inputs, parents)
    paths, lens = accepted_paths(parents, seed=n)
    payload_d, scratch_d, paths_d, lens_d = to_device(d, payload, scratch, paths, lens)
    commits = {  # name: (device, commit); the ops take CPU tensors, where they are the reference
        "replay-kernel": (d, lambda s: m2._launch_mamba2_replay_commit(s, payload_d, paths_d, lens_d)),
        "replay-op": ("cpu", lambda s: torch.ops.treespec.mamba2_replay_commit(s, payload, paths, lens)),
        "staged-kernel": (d, lambda s: m2._launch_ssm_commit_staged(s, scratch_d, paths_d, lens_d)),
        "staged-op": ("cpu", lambda s: torch.ops.treespec.ssm_commit_staged(s, scratch, paths, lens)),
    }
    for name, (device, commit) in commits.items():
        committed = state.clone().to(device)
        commit(committed)
        committed = committed.cpu()
        for b in range(batch):
            path = paths[b, : int(lens[b])].tolist()
            if not path:
                assert torch.equal(committed[b], state[b]), f"{name}: accept_len 0 changed request {b}"
                continue
            _, states = chain_oracle(x[b], dt[b], A, B[b], C[b], D, dt_bias, state[b], path)
            assert_close(committed[b], states[-1], 1e-10, f"{name}, request {b}")


def test_staged_commit_equals_replay_commit_fp32(kernel_device):
    """fp32 kernels: the staged state (one verify) and the replayed state agree, and so do the outputs."""
    d = kernel_device
    parents = parents_tensor([("random", 20), ("deep_fork", 20)], seed=9)
    inputs = make_inputs(2, 20, h=2, g=2, p=8, s=16, dtype=torch.float32, seed=4)
    moved = to_device(d, *inputs, parents)
    state = moved[-2]
    y, payload = run_verify("kernel", *moved)
    y_staged, scratch = run_verify("staged-kernel", *moved)
    torch.testing.assert_close(y.cpu(), y_staged.cpu(), atol=1e-6, rtol=1e-6)
    paths, lens = to_device(d, *accepted_paths(parents, seed=3))
    replayed, staged = state.clone(), state.clone()
    m2._launch_mamba2_replay_commit(replayed, payload, paths, lens)
    m2._launch_ssm_commit_staged(staged, scratch, paths, lens)
    torch.testing.assert_close(replayed.cpu(), staged.cpu(), atol=1e-6, rtol=1e-6)


def test_replay_commit_prepacked_rows_and_zero_length(kernel_device):
    """Rows packed to the front replay with an arange path; accept_len 0 keeps the state bit for bit."""
    d = kernel_device
    parents = parents_tensor([("random", 6), ("random", 6)], seed=4)
    inputs = make_inputs(2, 6, h=2, g=1, p=8, s=16, dtype=torch.float32)
    state = inputs[-1]
    _, payload = run_verify("kernel", *to_device(d, *inputs, parents))
    payload = payload.cpu()
    path = [path_to(row, 5) for row in parents.tolist()]
    lens = torch.tensor([len(p) for p in path])
    padded = torch.tensor([p + [-1] * (6 - len(p)) for p in path])
    packed = payload.clone()
    for b in range(2):
        packed[b, : len(path[b])] = payload[b, path[b]]
    front = torch.arange(6).expand(2, 6).contiguous()
    a, c = to_device(d, state.clone(), state.clone())
    m2._launch_mamba2_replay_commit(a, *to_device(d, payload, padded, lens))
    m2._launch_mamba2_replay_commit(c, *to_device(d, packed, front, lens))
    assert torch.equal(a.cpu(), c.cpu())
    zero = torch.zeros(2, dtype=torch.int64)
    for commit, device in ((m2._launch_mamba2_replay_commit, d), (torch.ops.treespec.mamba2_replay_commit, "cpu")):
        kept, *rest = to_device(device, state.clone(), payload, padded, zero)  # the op: its CPU reference path
        commit(kept, *rest)
        assert torch.equal(kept.cpu(), state)


@pytest.mark.parametrize("impl", ["kernel", "op"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(((3, 2, 8, 12), torch.float32, False), id="gdn-shape-B3-Hv2-Dk8-Dv12-fp32"),
        pytest.param(((2, 37), torch.bfloat16, False), id="flat-B2-E37-bf16"),
        pytest.param(((2, 2, 8, 16), torch.float32, True), id="pool-layer-slice-B2-fp32"),
    ],
)
def test_ssm_commit_staged_is_generic(case, impl, kernel_device):
    """Any state shape and dtype: the last accepted node's scratch row, bit for bit; a pool slice works."""
    d = device_of(impl, kernel_device)
    shape, dtype, pool_slice = case
    batch, n = shape[0], 5
    gen = torch.Generator().manual_seed(0)
    if pool_slice:  # state pool [layers, B, ...]: layer 1's [B, ...] has a batch stride, rows contiguous
        pool = torch.randn((3,) + shape, generator=gen).to(dtype).to(d)
        state, untouched = pool[1], (pool[0].clone(), pool[2].clone())
    else:
        state, untouched = torch.randn(shape, generator=gen).to(dtype).to(d), None
    scratch = torch.randn((batch, n + 2) + shape[1:], generator=gen).to(dtype).to(d)
    paths = torch.tensor([[0, 1, 3, -1, -1], [0, 2, -1, -1, -1], [0, 1, 2, 3, 4]])[:batch].to(d)
    lens = torch.tensor([3, 0, 5])[:batch].to(d)
    before = state.clone()
    commit = m2._launch_ssm_commit_staged if impl == "kernel" else torch.ops.treespec.ssm_commit_staged
    commit(state, scratch, paths, lens)
    assert torch.equal(state[0], scratch[0, 3])
    assert torch.equal(state[1], before[1])  # accept_len 0
    if batch > 2:
        assert torch.equal(state[2], scratch[2, 4])
    if untouched is not None:
        assert torch.equal(pool[0], untouched[0]) and torch.equal(pool[2], untouched[1])


def every_other_column(t: torch.Tensor) -> torch.Tensor:
    """``t [B, K]`` as every other column of a wider table (strides (2K + 1, 2)), junk in between."""
    table = torch.full((t.shape[0], 2 * t.shape[1] + 1), -7, dtype=t.dtype, device=t.device)
    table[:, 1::2] = t
    return table[:, 1::2]


def every_other(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with every dim strided (stride 2 over a NaN-filled buffer)."""
    wide = torch.full(tuple(2 * s for s in t.shape), float("nan"), dtype=t.dtype, device=t.device)
    view = wide[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def test_verify_and_commits_take_views_of_state_tables(kernel_device):
    """A state that is a transposed layer slice of a pool, payload / scratch slices of wider buffers,
    strided A, D, dt_bias, parents / accepted_path every other column and accept_len a column of a
    [B, 64] table: the replay and the staged kernels follow every stride (kv_write once read its 1-d
    slots as contiguous)."""
    d = kernel_device
    parents = parents_tensor([("two_branches", 7), ("random", 7), ("chain", 7)], seed=6)
    batch, n = parents.shape
    inputs = make_inputs(batch, n, h=2, g=1, p=8, s=16, seed=6)
    x, dt, A, B, C, D, dt_bias, state = inputs
    width = m2.mamba2_payload_width(2, 8, 1, 16)
    pool = torch.full((batch, 3, 2, 16, 8), float("nan"), dtype=torch.float64, device=d)
    state_view = pool[:, 1].transpose(-1, -2)  # [B, H, P, S_n], P the slow dim
    state_view.copy_(state)
    payload_view = poisoned((batch, n + 1, width + 5), torch.float64, d)[:, :, 3 : 3 + width]
    scratch_view = poisoned((batch, n + 1, 2, 8, 20), torch.float64, d)[..., 2:18]
    y = poisoned((batch, n, 2, 8), torch.float64, d)
    y_staged = poisoned((batch, n, 2, 8), torch.float64, d)
    views = (x.to(d), dt.to(d), every_other(A.to(d)), B.to(d), C.to(d), every_other(D.to(d)),
             every_other(dt_bias.to(d)), state_view, every_other_column(parents.to(d)))  # fmt: skip
    m2._launch_mamba2_tree_verify(*views, payload_view, y, True, None, None, staged=False)
    m2._launch_mamba2_tree_verify(*views, scratch_view, y_staged, True, None, None, staged=True)
    check_against_oracle("kernel", inputs, parents, y.cpu(), payload_view[:, :n].cpu(), 1e-10)
    check_against_oracle("staged-kernel", inputs, parents, y_staged.cpu(), scratch_view.cpu(), 1e-10)

    paths, lens = accepted_paths(parents, seed=2)
    len_table = torch.full((batch, 64), -7, dtype=torch.int64, device=d)
    len_table[:, 5] = lens
    path_view = every_other_column(paths.to(d))
    staged_pool = torch.full((batch, 3, 2 * 8 * 16), float("nan"), dtype=torch.float64, device=d)
    staged_state = staged_pool[:, 1].view(batch, 2, 8, 16)  # a layer slice: rows contiguous, batch stride
    staged_state.copy_(state)
    m2._launch_mamba2_replay_commit(state_view, payload_view, path_view, len_table[:, 5])
    m2._launch_ssm_commit_staged(staged_state, scratch_view.contiguous(), path_view, len_table[:, 5])
    for b in range(batch):
        path = paths[b, : int(lens[b])].tolist()
        want = chain_oracle(x[b], dt[b], A, B[b], C[b], D, dt_bias, state[b], path)[1][-1] if path else state[b]
        assert_close(state_view[b].cpu(), want, 1e-10, f"replayed state {b}")
        assert_close(staged_state[b].cpu(), want, 1e-10, f"staged state {b}")
    assert pool[:, 0].isnan().all() and pool[:, 2].isnan().all(), "wrote outside the state's layer"
    assert staged_pool[:, 0].isnan().all() and staged_pool[:, 2].isnan().all(), "wrote outside the layer"


# --------------------------------------------------------------------------------------------------
# Opcheck and bad input
# --------------------------------------------------------------------------------------------------


def small_case(dtype=torch.float32):
    parents = torch.tensor([[-1, 0, 0]])
    inputs = make_inputs(1, 3, h=2, g=1, p=4, s=4, dtype=dtype)
    payload = torch.zeros(1, 3, m2.mamba2_payload_width(2, 4, 1, 4), dtype=inputs[-1].dtype)
    scratch = torch.zeros(1, 3, 2, 4, 4, dtype=inputs[-1].dtype)
    return inputs, parents, payload, scratch


def test_opcheck():
    inputs, parents, payload, scratch = small_case()
    x, dt, A, B, C, D, dt_bias, state = inputs
    verify = torch.ops.treespec.mamba2_tree_verify.default
    staged = torch.ops.treespec.mamba2_tree_verify_staged.default
    torch.library.opcheck(verify, (*inputs, parents, payload))
    torch.library.opcheck(
        verify, (x, dt, A, B, C, None, None, state, parents, payload),
        {"dt_softplus": False, "dt_min": 0.0, "dt_max": 2.0},
    )  # fmt: skip
    torch.library.opcheck(staged, (*inputs, parents, scratch), {"dt_max": 1.0})
    path, lens = torch.tensor([[0, 2, -1]]), torch.tensor([2])
    replay = torch.ops.treespec.mamba2_replay_commit.default
    torch.library.opcheck(replay, (state.clone(), payload, path, lens))
    torch.library.opcheck(torch.ops.treespec.ssm_commit_staged.default, (state.clone(), scratch, path, lens))


def test_bad_input_is_refused_before_launch():
    inputs, parents, payload, scratch = small_case()
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "state")
    verify_op = torch.ops.treespec.mamba2_tree_verify
    staged_op = torch.ops.treespec.mamba2_tree_verify_staged

    def verify(op=verify_op, buf=payload, **override):
        args = dict(zip(names, inputs), parents=parents)
        args.update(override)
        return op(*args.values(), buf)

    big_inputs = make_inputs(1, 65, h=2, g=1, p=4, s=4, dtype=torch.float32)
    big_parents = torch.tensor([[-1] + list(range(64))])
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        verify_op(*big_inputs, big_parents, torch.zeros(1, 65, m2.mamba2_payload_width(2, 4, 1, 4)))
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        staged_op(*big_inputs, big_parents, torch.zeros(1, 65, 2, 4, 4))
    state = inputs[-1]
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match="state: the recurrent state must be torch.float32"):
            verify(state=state.to(dtype), buf=payload.to(dtype))
        with pytest.raises(ValueError, match="state: the recurrent state must be torch.float32"):
            verify(op=staged_op, buf=scratch.to(dtype), state=state.to(dtype))
    with pytest.raises(ValueError, match="state: expected"):
        verify(state=torch.zeros(1, 2, 4, 5))
    with pytest.raises(ValueError, match="multiple of the groups"):
        verify(B=torch.zeros(1, 3, 3, 4), C=torch.zeros(1, 3, 3, 4))
    with pytest.raises(ValueError, match="C: expected the shape of B"):
        verify(C=torch.zeros(1, 3, 1, 5))
    with pytest.raises(ValueError, match=r"dt: expected \[B=1, N=3, H=2\]"):
        verify(dt=torch.zeros(1, 3, 3))
    with pytest.raises(ValueError, match=r"D: expected \[H=2\]"):
        verify(D=torch.zeros(3))
    with pytest.raises(ValueError, match="x: expected"):
        verify(x=torch.zeros(2, 3, 2, 4))
    with pytest.raises(ValueError, match="parents: expected dtype torch.int64"):
        verify(parents=parents.int())
    with pytest.raises(ValueError, match="payload: expected"):
        verify(buf=torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="payload: dtype"):
        verify(buf=payload.double())
    with pytest.raises(ValueError, match="scratch: expected"):
        verify(op=staged_op, buf=torch.zeros(1, 2, 2, 4, 4))
    with pytest.raises(ValueError, match="scratch: dtype"):
        verify(op=staged_op, buf=scratch.double())
    with pytest.raises(ValueError, match="state size S_n = 300 exceeds"):
        big_s = make_inputs(1, 3, h=2, g=1, p=4, s=300, dtype=torch.float32)
        verify_op(*big_s, parents, torch.zeros(1, 3, m2.mamba2_payload_width(2, 4, 1, 300)))

    replay = torch.ops.treespec.mamba2_replay_commit
    path, lens = torch.tensor([[0, 1, -1]]), torch.tensor([2])
    with pytest.raises(ValueError, match="state: the recurrent state must be torch.float32"):
        replay(state.bfloat16(), payload.bfloat16(), path, lens)
    with pytest.raises(ValueError, match="payload: row width"):
        replay(state, torch.zeros(1, 3, payload.shape[2] + 1), path, lens)
    with pytest.raises(ValueError, match="accept_len: expected"):
        replay(state, payload, path, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="accepted_path: expected dtype torch.int64"):
        replay(state, payload, path.int(), lens)
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        replay(state, torch.zeros(1, 65, payload.shape[2]), torch.zeros(1, 65, dtype=torch.int64), lens)

    commit = torch.ops.treespec.ssm_commit_staged
    with pytest.raises(ValueError, match="scratch: expected a 5-d tensor"):
        commit(state, torch.zeros(1, 3, 2, 4), path, lens)
    with pytest.raises(ValueError, match="scratch: expected"):
        commit(state, torch.zeros(1, 2, 2, 4, 4), path, lens)
    with pytest.raises(ValueError, match="scratch: dtype"):
        commit(state, scratch.double(), path, lens)
    with pytest.raises(ValueError, match="state: each request's state must be contiguous"):
        commit(torch.zeros(1, 2, 4, 8)[..., ::2], scratch, path, lens)
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        commit(state, torch.zeros(1, 65, 2, 4, 4), torch.zeros(1, 65, dtype=torch.int64), lens)


def test_reference_dt_and_decay_do_not_depend_on_position():
    """softplus / exp of one element come out the same wherever it sits in the tensor (HF's decode sees
    it in a tail-free [B, H, P] block; PyTorch's scalar tail loop can differ from the vector one by an ulp)."""
    gen = torch.Generator().manual_seed(3)
    dt = torch.randn(3, 7, 5, generator=gen) * 4  # 105 elements: a tail on every CPU vector width
    bias = torch.randn(5, generator=gen)
    whole = m2._process_dt(dt, bias, True, None, None)
    A = -torch.rand(5, generator=gen) - 0.1
    decay = m2._elementwise_vectorised(torch.exp, whole * A)
    for b in range(3):
        for t in range(7):
            block = (dt[b, t] + bias)[:, None].expand(5, 64).contiguous()  # a tail-free block, as HF's
            want = torch.nn.functional.softplus(block)[:, 0]
            assert torch.equal(whole[b, t], want), (b, t)
            want_decay = torch.exp((want * A)[:, None].expand(5, 64).contiguous())[:, 0]
            assert torch.equal(decay[b, t], want_decay), (b, t)
