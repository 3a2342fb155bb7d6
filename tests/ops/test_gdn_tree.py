"""GDN tree verify and replay commit against per-path chains (float64) and HF's recurrent rule (fp32).

Every root-to-leaf path is run as a plain chain by an independent float64 oracle; each node's output and
each branch point's workspace state must match it. The fp32 reference must equal HF's token-by-token
decode bit for bit (it is the CPU path of lossless speculation). Kernels run on ``kernel_device``: the
Triton interpreter on CPU (so shapes stay small), the device where CUDA is present; oracles run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import treecompile.ops.gdn_tree as gdn
from conftest import poisoned

import transformers.models.qwen3_next.modeling_qwen3_next as hf_gdn  # noqa: E402  (a rename fails here)


# --------------------------------------------------------------------------------------------------
# Trees and inputs
# --------------------------------------------------------------------------------------------------



def hf_like_inputs(hk: int, hv: int, dk: int, dv: int, n: int, seed: int, device="cpu"):
    """float64 inputs as HF's GDN layer hands them over: q, k, v strided views of one mixed_qkv projection
    ``[1, n, H, D]``; g = -rand, beta = rand ``[1, n, hv]``; a random state ``[1, hv, dk, dv]``. Drawn on
    the CPU, the views made on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(1, n, 2 * hk * dk + hv * dv, generator=gen, dtype=torch.float64).to(device)  # HF's mixed_qkv
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(1, n, hk, dk), k.reshape(1, n, hk, dk), v.reshape(1, n, hv, dv)
    assert not q.is_contiguous()
    gb = torch.rand(1, n, 2 * hv, generator=gen, dtype=torch.float64).to(device)
    state = torch.randn(1, hv, dk, dv, generator=gen, dtype=torch.float64).to(device)
    return q, k, v, -gb[..., :hv], gb[..., hv:], state

def make_parents(kind: str, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "star":  # every node a child of the root: each one reloads
        return [-1] + [0] * (n - 1)
    if kind == "two_branches":  # a chain that forks at the root
        half = (n + 1) // 2
        return [-1] + [i - 1 for i in range(1, half)] + [0] + [i - 1 for i in range(half + 1, n)]
    if kind == "random":
        return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    raise AssertionError(kind)


def parents_tensor(kinds_and_n, seed=0) -> torch.Tensor:
    return torch.tensor([make_parents(kind, n, seed + i) for i, (kind, n) in enumerate(kinds_and_n)])


def make_inputs(batch, n, hk, hv, dk, dv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v = rnd(batch, n, hk, dk), rnd(batch, n, hk, dk), rnd(batch, n, hv, dv)
    g = (-torch.rand(batch, n, hv, generator=gen, dtype=torch.float64)).to(dtype)  # log decay < 0
    beta = torch.rand(batch, n, hv, generator=gen, dtype=torch.float64).to(dtype)
    state = rnd(batch, hv, dk, dv) * 0.5
    return q, k, v, g, beta, state


def path_to(parents_row: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents_row[node]
    return path[::-1]


def leaves(parents_row: list[int]) -> list[int]:
    has_child = {p for p in parents_row if p >= 0}
    return [t for t in range(len(parents_row)) if t not in has_child]


def chain_oracle(q, k, v, g, beta, state, path, scale=None, use_qk_l2norm=True):
    """One request's path as a plain float64 chain: per-node outputs [len, Hv, Dv] and states."""
    hk, dk = q.shape[-2:]
    hv = v.shape[-2]
    group = hv // hk
    scale = dk**-0.5 if scale is None else scale
    S = state.to(torch.float64).clone()
    outs, states = [], []
    for t in path:
        qt, kt = q[t].double(), k[t].double()
        if use_qk_l2norm:
            qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
            kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        qt = (qt * scale).repeat_interleave(group, 0)
        kt = kt.repeat_interleave(group, 0)
        S = S * torch.exp(g[t].double())[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", kt, S)
        S = S + torch.einsum("hk,hv->hkv", kt, beta[t].double()[:, None] * (v[t].double() - predicted))
        outs.append(torch.einsum("hk,hkv->hv", qt, S))
        states.append(S.clone())
    return outs, states


def node_oracle(q, k, v, g, beta, state, parents, **kw):
    """Per request and node: (output, state) of the node's root-to-node path run as a chain."""
    result = {}
    for b, row in enumerate(parents.tolist()):
        for leaf in leaves(row):
            path = path_to(row, leaf)
            outs, states = chain_oracle(q[b], k[b], v[b], g[b], beta[b], state[b], path, **kw)
            for t, o, s in zip(path, outs, states):
                result[(b, t)] = (o, s)
    return result


def run_verify(fn, q, k, v, g, beta, state, parents, scale=None, use_qk_l2norm=True):
    """Call ``fn`` (the launcher or the op) with NaN-poisoned workspace, payload and output, made on the
    inputs' device (the launcher's ``kernel_device``)."""
    batch, n, hk, dk = q.shape
    hv, dv = v.shape[2:]
    d = q.device
    workspace = poisoned((batch, n, hv, dk, dv), state.dtype, d)
    payload = poisoned((batch, n, gdn.gdn_payload_width(hk, dk, hv, dv)), state.dtype, d)
    if fn is gdn._launch_gdn_tree_verify:
        o = poisoned((batch, n, hv, dv), q.dtype, d)
        fn(q, k, v, g, beta, state, parents, workspace, payload, o, scale, use_qk_l2norm)
    else:
        o = fn(q, k, v, g, beta, state, parents, workspace, payload, scale, use_qk_l2norm)
    return o, workspace, payload


IMPLS = {
    "kernel": gdn._launch_gdn_tree_verify,
    "op": torch.ops.treespec.gdn_tree_verify,  # CPU tensors: the reference path
}


def check_against_oracle(q, k, v, g, beta, state, parents, o, workspace, payload, atol, **kw):
    oracle = node_oracle(q, k, v, g, beta, state, parents, **kw)
    branch = gdn.gdn_branch_points(parents)
    batch, n = parents.shape
    for b in range(batch):
        for t in range(n):
            want_o, want_s = oracle[(b, t)]
            torch.testing.assert_close(o[b, t].double(), want_o, atol=atol, rtol=atol, msg=f"o[{b}, {t}]")
            if branch[b, t]:
                torch.testing.assert_close(
                    workspace[b, t].double(), want_s, atol=atol, rtol=atol, msg=f"workspace[{b}, {t}]"
                )
            else:  # only branch points are stored: everything else is untouched poison
                assert workspace[b, t].isnan().all(), f"workspace[{b}, {t}] written: not a branch point"
    # payload rows: [l2norm(k) | v | g | beta]
    hk, dk = q.shape[2:]
    kn = k.double()
    if kw.get("use_qk_l2norm", True):
        kn = kn / torch.sqrt((kn * kn).sum(-1, keepdim=True) + 1e-6)
    rows = [kn.reshape(batch, n, -1), v.double().reshape(batch, n, -1), g.double(), beta.double()]
    want = torch.cat(rows, -1)
    torch.testing.assert_close(payload.double(), want, atol=atol, rtol=atol)


# --------------------------------------------------------------------------------------------------
# Verify
# --------------------------------------------------------------------------------------------------

TREES = [
    pytest.param([("chain", 1), ("chain", 1)], id="B2-N1"),
    pytest.param([("chain", 2), ("star", 2)], id="B2-N2-chain-star"),
    pytest.param([("random", 33), ("two_branches", 33)], id="B2-N33-random-fork"),
    pytest.param([("random", 64)], id="B1-N64-random"),
    pytest.param([("star", 9), ("chain", 9)], id="B2-N9-star-chain"),
]


@pytest.mark.parametrize("impl", ["kernel", "op"])
@pytest.mark.parametrize("trees", TREES)
def test_verify_matches_per_path_chains(trees, impl, kernel_device):
    d = kernel_device if impl == "kernel" else "cpu"
    parents = parents_tensor(trees, seed=7)
    batch, n = parents.shape
    q, k, v, g, beta, state = make_inputs(batch, n, hk=1, hv=2, dk=16, dv=8, seed=n)
    o, workspace, payload = run_verify(IMPLS[impl], *(t.to(d) for t in (q, k, v, g, beta, state, parents)))
    check_against_oracle(q, k, v, g, beta, state, parents, o.cpu(), workspace.cpu(), payload.cpu(), atol=1e-10)


@pytest.mark.parametrize("impl", ["kernel", "op"])
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((2, 4, 12, 40), id="Hk2-Hv4-Dk12-Dv40"),
        pytest.param((1, 2, 64, 80), id="Hk1-Hv2-Dk64-Dv80-two-value-blocks"),
    ],
)
def test_verify_gqa_odd_dims_strided_inputs(shape, impl, kernel_device):
    """GQA, non-power-of-two head dims, several value blocks, HF-like strided views (on the kernel's
    device), explicit scale."""
    d = kernel_device if impl == "kernel" else "cpu"
    hk, hv, dk, dv = shape
    parents = parents_tensor([("random", 7)], seed=3)
    n = parents.shape[1]
    inputs = hf_like_inputs(hk, hv, dk, dv, n, seed=1, device=d)
    q, k, v, g, beta, state = (t.cpu() for t in inputs)  # the oracle's copies
    for scale, l2 in ((0.3, True), (0.05, False)):
        o, workspace, payload = run_verify(IMPLS[impl], *inputs, parents.to(d), scale, l2)
        o, workspace, payload = o.cpu(), workspace.cpu(), payload.cpu()
        check_against_oracle(
            q, k, v, g, beta, state, parents, o, workspace, payload, atol=1e-9, scale=scale, use_qk_l2norm=l2
        )


@pytest.mark.parametrize("impl", ["kernel", "op"])
def test_chain_never_touches_workspace(impl, kernel_device):
    d = kernel_device if impl == "kernel" else "cpu"
    parents = parents_tensor([("chain", 33), ("chain", 33)])
    q, k, v, g, beta, state = make_inputs(2, 33, hk=1, hv=1, dk=8, dv=8)
    _, workspace, _ = run_verify(IMPLS[impl], *(t.to(d) for t in (q, k, v, g, beta, state, parents)))
    assert workspace.isnan().all()
    assert not gdn.gdn_branch_points(parents).any()


def test_verify_leaves_state_pool_untouched(kernel_device):
    """The launcher and the op, both on ``kernel_device`` (on CPU the op takes its reference path)."""
    d = kernel_device
    parents = parents_tensor([("random", 12)]).to(d)
    inputs = make_inputs(1, 12, hk=1, hv=2, dk=8, dv=8, dtype=torch.float32)
    q, k, v, g, beta, state = (t.to(d) for t in inputs)
    before = state.clone()
    run_verify(gdn._launch_gdn_tree_verify, q, k, v, g, beta, state, parents)
    run_verify(torch.ops.treespec.gdn_tree_verify, q, k, v, g, beta, state, parents)
    assert torch.equal(state, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_fp32_state_matches_hf_chain(dtype, kernel_device):
    """The kernel with an fp32 state against HF's own recurrent rule on a chain (HF computes in fp32, on the
    CPU)."""
    d = kernel_device
    n = 9
    q, k, v, g, beta, state = make_inputs(2, n, hk=1, hv=2, dk=16, dv=16, dtype=dtype)
    state = state.float()
    g = g.float()
    chains = parents_tensor([("chain", n)] * 2)
    o, _, _ = run_verify(gdn._launch_gdn_tree_verify, *(t.to(d) for t in (q, k, v, g, beta, state, chains)))
    want, _ = hf_gdn.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert o.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(o.cpu().float(), want.float(), atol=tol, rtol=tol)


def hf_decode(q, k, v, g, beta, state, path):
    """HF's single-token decode, token by token along ``path`` (one request): outputs and final state."""
    outs = []
    S = state[None]
    for t in path:
        o, S = hf_gdn.torch_recurrent_gated_delta_rule(
            q[None, t : t + 1], k[None, t : t + 1], v[None, t : t + 1], g[None, t : t + 1],
            beta[None, t : t + 1], initial_state=S, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outs.append(o[0, 0])
    return outs, S[0]


def test_reference_fp32_is_bitwise_hf_decode_on_every_path():
    """The CPU path (fp32 state) must reproduce HF's decode exactly, so greedy stays token-exact."""
    parents = parents_tensor([("random", 10), ("two_branches", 10)], seed=5)
    q, k, v, g, beta, state = make_inputs(2, 10, hk=1, hv=2, dk=16, dv=8, dtype=torch.float32)
    o, workspace, payload = run_verify(torch.ops.treespec.gdn_tree_verify, q, k, v, g, beta, state, parents)
    for b, row in enumerate(parents.tolist()):
        for leaf in leaves(row):
            path = path_to(row, leaf)
            outs, final = hf_decode(q[b], k[b], v[b], g[b], beta[b], state[b], path)
            for t, want in zip(path, outs):
                assert torch.equal(o[b, t], want), f"o[{b}, {t}] differs from HF decode"
            commit = state[b : b + 1].clone()
            accepted = torch.tensor([path + [-1] * (10 - len(path))])
            lens = torch.tensor([len(path)])
            torch.ops.treespec.gdn_replay_commit(commit, payload[b : b + 1], accepted, lens)
            assert torch.equal(commit[0], final), f"replayed state of path to {leaf} differs from HF decode"


# --------------------------------------------------------------------------------------------------
# Replay commit
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
        pytest.param([("random", 64)], id="B1-N64"),
    ],
)
def test_replay_commit_equals_sequential_decode(trees, kernel_device):
    """The kernels on ``kernel_device``; the op on CPU copies (its reference path) of the kernel's payload."""
    d = kernel_device
    parents = parents_tensor(trees, seed=11)
    batch, n = parents.shape
    q, k, v, g, beta, state = make_inputs(batch, n, hk=1, hv=2, dk=16, dv=8, seed=2)
    _, _, payload = run_verify(gdn._launch_gdn_tree_verify, *(t.to(d) for t in (q, k, v, g, beta, state, parents)))
    paths, lens = accepted_paths(parents, seed=n)
    committed = state.to(d).clone()
    gdn._launch_gdn_replay_commit(committed, payload, paths.to(d), lens.to(d))
    committed, payload = committed.cpu(), payload.cpu()
    by_op = state.clone()
    torch.ops.treespec.gdn_replay_commit(by_op, payload, paths, lens)
    for b in range(batch):
        path = paths[b, : int(lens[b])].tolist()
        if not path:
            assert torch.equal(committed[b], state[b]) and torch.equal(by_op[b], state[b])
            continue
        _, states = chain_oracle(q[b], k[b], v[b], g[b], beta[b], state[b], path)
        torch.testing.assert_close(committed[b], states[-1], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(by_op[b], states[-1], atol=1e-10, rtol=1e-10)


def test_replay_commit_zero_length_and_prepacked_rows(kernel_device):
    """accept_len 0 keeps the state bit for bit; rows packed to the front replay with an arange path (every
    tensor on ``kernel_device``: kernels against kernels)."""
    d = kernel_device
    parents = parents_tensor([("random", 6), ("random", 6)], seed=4)
    inputs = make_inputs(2, 6, hk=1, hv=1, dk=8, dv=8, dtype=torch.float32)
    q, k, v, g, beta, state = (t.to(d) for t in inputs)
    _, _, payload = run_verify(gdn._launch_gdn_tree_verify, q, k, v, g, beta, state, parents.to(d))
    path = [path_to(row, 5) for row in parents.tolist()]
    lens = torch.tensor([len(p) for p in path]).to(d)
    padded = torch.tensor([p + [-1] * (6 - len(p)) for p in path]).to(d)
    packed = payload.clone()
    for b in range(2):
        packed[b, : len(path[b])] = payload[b, path[b]]
    front = torch.arange(6).expand(2, 6).contiguous().to(d)
    a, c = state.clone(), state.clone()
    gdn._launch_gdn_replay_commit(a, payload, padded, lens)
    gdn._launch_gdn_replay_commit(c, packed, front, lens)
    assert torch.equal(a, c)
    zero = state.clone()
    gdn._launch_gdn_replay_commit(zero, payload, padded, torch.zeros(2, dtype=torch.int64).to(d))
    assert torch.equal(zero, state)


def every_other_column(t: torch.Tensor) -> torch.Tensor:
    """``t [B, K]`` as every other column of a wider table (strides (2K + 1, 2)), junk in between."""
    table = torch.full((t.shape[0], 2 * t.shape[1] + 1), -7, dtype=t.dtype, device=t.device)
    table[:, 1::2] = t
    return table[:, 1::2]


def test_verify_and_commit_take_views_of_state_tables(kernel_device):
    """A state that is a transposed layer slice of a pool, workspace and payload column slices of wider
    buffers, parents / accepted_path every other column, accept_len a column of a [B, 64] table: the
    kernels follow every stride (kv_write once read its 1-d slots as contiguous)."""
    d = kernel_device
    parents = parents_tensor([("two_branches", 7), ("random", 7), ("chain", 7)], seed=6)
    batch, n = parents.shape
    q, k, v, g, beta, state = make_inputs(batch, n, hk=1, hv=2, dk=8, dv=16, seed=6)
    width = gdn.gdn_payload_width(1, 8, 2, 16)
    pool = torch.full((batch, 3, 2, 16, 8), float("nan"), dtype=torch.float64, device=d)
    state_view = pool[:, 1].transpose(-1, -2)  # [B, Hv, Dk, Dv], Dv the slow dim
    state_view.copy_(state)
    ws_view = poisoned((batch, n + 1, 2, 8, 20), torch.float64, d)[..., 2:18]
    payload_view = poisoned((batch, n + 1, width + 5), torch.float64, d)[:, :, 3 : 3 + width]
    o = poisoned((batch, n, 2, 16), torch.float64, d)
    gdn._launch_gdn_tree_verify(
        q.to(d), k.to(d), v.to(d), g.to(d), beta.to(d), state_view, every_other_column(parents.to(d)),
        ws_view, payload_view, o, None, True,
    )  # fmt: skip
    check_against_oracle(q, k, v, g, beta, state, parents, o.cpu(), ws_view.cpu(), payload_view[:, :n].cpu(), 1e-10)

    paths, lens = accepted_paths(parents, seed=2)
    len_table = torch.full((batch, 64), -7, dtype=torch.int64, device=d)
    len_table[:, 5] = lens
    gdn._launch_gdn_replay_commit(state_view, payload_view, every_other_column(paths.to(d)), len_table[:, 5])
    for b in range(batch):
        path = paths[b, : int(lens[b])].tolist()
        want = chain_oracle(q[b], k[b], v[b], g[b], beta[b], state[b], path)[1][-1] if path else state[b]
        torch.testing.assert_close(state_view[b].cpu(), want, atol=1e-10, rtol=1e-10)
    assert pool[:, 0].isnan().all() and pool[:, 2].isnan().all(), "wrote outside the state's layer"


# --------------------------------------------------------------------------------------------------
# Helpers, opcheck, bad input
# --------------------------------------------------------------------------------------------------


def test_branch_points():
    parents = torch.tensor([[-1, 0, 1, 1, 0, 4], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0]])
    want = torch.tensor(
        [[True, True, False, False, False, False], [False] * 6, [True, False, False, False, False, False]]
    )
    assert torch.equal(gdn.gdn_branch_points(parents), want)
    assert gdn.gdn_payload_width(2, 16, 4, 8) == 2 * 16 + 4 * 8 + 2 * 4


def small_case(dtype=torch.float32):
    parents = torch.tensor([[-1, 0, 0]])
    q, k, v, g, beta, state = make_inputs(1, 3, hk=1, hv=2, dk=4, dv=4, dtype=dtype)
    workspace = torch.zeros(1, 3, 2, 4, 4, dtype=state.dtype)
    payload = torch.zeros(1, 3, gdn.gdn_payload_width(1, 4, 2, 4), dtype=state.dtype)
    return q, k, v, g, beta, state, parents, workspace, payload


def test_opcheck():
    args = small_case()
    verify = torch.ops.treespec.gdn_tree_verify.default
    torch.library.opcheck(verify, args, {"scale": None, "use_qk_l2norm": True})
    torch.library.opcheck(verify, args, {"scale": 0.5, "use_qk_l2norm": False})
    state, payload = args[5].clone(), args[8]
    torch.library.opcheck(
        torch.ops.treespec.gdn_replay_commit.default,
        (state, payload, torch.tensor([[0, 2, -1]]), torch.tensor([2])),
    )


def test_bad_input_is_refused_before_launch():
    q, k, v, g, beta, state, parents, workspace, payload = small_case()
    op = torch.ops.treespec.gdn_tree_verify

    def verify(**override):
        args = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, parents=parents)
        args.update(workspace=workspace, payload=payload)
        args.update(override)
        return op(*args.values())

    big = make_inputs(1, 65, hk=1, hv=2, dk=4, dv=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        op(*big, torch.tensor([[-1] + list(range(64))]), torch.zeros(1, 65, 2, 4, 4), torch.zeros(1, 65, 18))
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match="state: the recurrent state must be torch.float32"):
            verify(state=state.to(dtype), workspace=workspace.to(dtype), payload=payload.to(dtype))
    with pytest.raises(ValueError, match="multiple of the key heads"):
        two_key_heads = torch.zeros(1, 3, 2, 4)
        three_heads = torch.zeros(1, 3, 3)
        verify(q=two_key_heads, k=two_key_heads, v=torch.zeros(1, 3, 3, 4), g=three_heads, beta=three_heads)
    with pytest.raises(ValueError, match="payload: expected"):
        verify(payload=torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="workspace: dtype"):
        verify(workspace=workspace.double())
    with pytest.raises(ValueError, match="workspace: expected"):
        verify(workspace=torch.zeros(1, 2, 2, 4, 4))
    with pytest.raises(ValueError, match="parents: expected dtype torch.int64"):
        verify(parents=parents.int())
    replay = torch.ops.treespec.gdn_replay_commit
    path, lens = torch.tensor([[0, 1, -1]]), torch.tensor([2])
    with pytest.raises(ValueError, match="state: the recurrent state must be torch.float32"):
        replay(state.bfloat16(), payload.bfloat16(), path, lens)
    with pytest.raises(ValueError, match="payload: row width"):
        replay(state, torch.zeros(1, 3, 19), path, lens)
    with pytest.raises(ValueError, match="accept_len: expected"):
        replay(state, payload, path, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        replay(state, torch.zeros(1, 65, 18), torch.zeros(1, 65, dtype=torch.int64), lens)
