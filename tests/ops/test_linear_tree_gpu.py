"""The tree conv, GDN (replay and staged) and Mamba2 ops on CUDA (compiled Triton) against their float64
references on CPU.

The interpreter accepts code compiled Triton rejects, so the kernel tests in test_conv_tree.py and
test_gdn_tree.py are not enough: this file runs the CUDA path at Qwen3-Next-like head shapes.
"""

import pytest
import torch

import treecompile.ops.conv_tree  # noqa: F401
import treecompile.ops.gdn_tree as gdn
from conftest import poisoned

pytestmark = pytest.mark.gpu


def random_parents(batch, n, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        kind = b % 3
        if kind == 0:
            rows.append([i - 1 for i in range(n)])
        elif kind == 1:
            rows.append([-1] + [0] * (n - 1))
        else:
            rows.append([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
    return torch.tensor(rows, dtype=torch.int64)


def accepted_chain(parents, accept_len):
    """A valid accepted path per request: the first ``accept_len`` nodes of the path to the last node."""
    batch, n = parents.shape
    path = torch.full((batch, n), -1, dtype=torch.int64)
    lens = accept_len.clone()
    for b in range(batch):
        node, nodes = n - 1, []
        while node >= 0:
            nodes.append(node)
            node = int(parents[b, node])
        nodes = nodes[::-1][: int(accept_len[b])]
        lens[b] = len(nodes)
        path[b, : len(nodes)] = torch.tensor(nodes)
    return path, lens


@pytest.mark.parametrize("n", [1, 2, 16, 33, 64], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("kw", [2, 4], ids=lambda k: f"Kw{k}")
def test_conv_tree_update_and_commit_on_cuda(n, kw):
    batch, channels = 3, 384
    gen = torch.Generator().manual_seed(n * 10 + kw)
    x = torch.randn(batch, n, channels, generator=gen, dtype=torch.float64)
    state = torch.randn(batch, channels, kw - 1, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, kw, generator=gen, dtype=torch.float64)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    parents = random_parents(batch, n, n)
    want = torch.ops.treespec.causal_conv1d_tree_update(x, state, weight, bias, parents, "silu")
    got = torch.ops.treespec.causal_conv1d_tree_update(
        x.float().cuda(), state.float().cuda(), weight.float().cuda(), bias.float().cuda(), parents.cuda(), "silu"
    )
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4)

    path, accept_len = accepted_chain(parents, torch.tensor([min(n, 3), 1, n]))
    want_state = state.clone()
    torch.ops.treespec.causal_conv1d_tree_commit(want_state, x, path, accept_len)
    got_state = state.float().cuda()
    torch.ops.treespec.causal_conv1d_tree_commit(got_state, x.float().cuda(), path.cuda(), accept_len.cuda())
    torch.testing.assert_close(got_state.cpu().double(), want_state, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 16, 33, 64], ids=lambda n: f"N{n}")
def test_gdn_tree_verify_and_replay_on_cuda(n):
    batch, hk, hv, dk, dv = 3, 2, 4, 128, 128
    gen = torch.Generator().manual_seed(n)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(batch, n, hk, dk), rnd(batch, n, hk, dk), rnd(batch, n, hv, dv)
    g = -torch.rand(batch, n, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, n, hv, generator=gen, dtype=torch.float64)
    state = rnd(batch, hv, dk, dv) * 0.5
    parents = random_parents(batch, n, n + 1)
    width = gdn.gdn_payload_width(hk, dk, hv, dv)

    ws64 = poisoned((batch, n, hv, dk, dv), torch.float64)
    pl64 = poisoned((batch, n, width), torch.float64)
    want = torch.ops.treespec.gdn_tree_verify(q, k, v, g, beta, state, parents, ws64, pl64, None, True)

    cu = lambda t: t.float().cuda()  # noqa: E731
    ws = poisoned((batch, n, hv, dk, dv), torch.float32, "cuda")
    pl = poisoned((batch, n, width), torch.float32, "cuda")
    state_cu = cu(state)
    got = torch.ops.treespec.gdn_tree_verify(
        cu(q), cu(k), cu(v), cu(g), cu(beta), state_cu, parents.cuda(), ws, pl, None, True
    )
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(state_cu.cpu().double(), state.float().double())  # verify never writes it
    branch = gdn.gdn_branch_points(parents)
    torch.testing.assert_close(ws.cpu().double()[branch], ws64[branch], atol=2e-3, rtol=2e-3)
    assert ws.cpu()[~branch].isnan().all()
    torch.testing.assert_close(pl.cpu().double(), pl64, atol=1e-5, rtol=1e-5)

    path, accept_len = accepted_chain(parents, torch.tensor([n, 1, min(n, 2)]))
    want_state = state.clone()
    torch.ops.treespec.gdn_replay_commit(want_state, pl64, path, accept_len)
    torch.ops.treespec.gdn_replay_commit(state_cu, pl, path.cuda(), accept_len.cuda())
    torch.testing.assert_close(state_cu.cpu().double(), want_state, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("n", [1, 2, 16, 33, 64], ids=lambda n: f"N{n}")
def test_gdn_tree_verify_staged_and_commit_on_cuda(n):
    """The staged GDN path (replay_ssm=False): every node's scratch row, untouched rows past N, outputs of
    the replay kernel, and ssm_commit_staged equal to the float64 replay commit."""
    batch, hk, hv, dk, dv = 3, 2, 4, 128, 128
    gen = torch.Generator().manual_seed(100 + n)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(batch, n, hk, dk), rnd(batch, n, hk, dk), rnd(batch, n, hv, dv)
    g = -torch.rand(batch, n, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, n, hv, generator=gen, dtype=torch.float64)
    state = rnd(batch, hv, dk, dv) * 0.5
    parents = random_parents(batch, n, n + 3)
    extra = 2  # scratch rows past N must stay untouched

    sc64 = poisoned((batch, n + extra, hv, dk, dv), torch.float64)
    want = torch.ops.treespec.gdn_tree_verify_staged(q, k, v, g, beta, state, parents, sc64, None, True)

    cu = lambda t: t.float().cuda()  # noqa: E731
    state_cu = cu(state)
    sc = poisoned((batch, n + extra, hv, dk, dv), torch.float32, "cuda")
    got = torch.ops.treespec.gdn_tree_verify_staged(
        cu(q), cu(k), cu(v), cu(g), cu(beta), state_cu, parents.cuda(), sc, None, True
    )
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(state_cu.cpu().double(), state.float().double())  # verify never writes it
    torch.testing.assert_close(sc.cpu().double()[:, :n], sc64[:, :n], atol=2e-3, rtol=2e-3)
    assert sc.cpu()[:, n:].isnan().all()

    ws = poisoned((batch, n, hv, dk, dv), torch.float32, "cuda")
    pl = poisoned((batch, n, gdn.gdn_payload_width(hk, dk, hv, dv)), torch.float32, "cuda")
    replay_o = torch.ops.treespec.gdn_tree_verify(
        cu(q), cu(k), cu(v), cu(g), cu(beta), state_cu, parents.cuda(), ws, pl, None, True
    )
    torch.testing.assert_close(got, replay_o, atol=1e-5, rtol=1e-5)

    path, accept_len = accepted_chain(parents, torch.tensor([n, 1, min(n, 2)]))
    pl64 = poisoned((batch, n, pl.shape[2]), torch.float64)
    ws64 = poisoned((batch, n, hv, dk, dv), torch.float64)
    torch.ops.treespec.gdn_tree_verify(q, k, v, g, beta, state, parents, ws64, pl64, None, True)
    want_state = state.clone()
    torch.ops.treespec.gdn_replay_commit(want_state, pl64, path, accept_len)
    staged = state_cu.clone()
    torch.ops.treespec.ssm_commit_staged(staged, sc, path.cuda(), accept_len.cuda())
    torch.testing.assert_close(staged.cpu().double(), want_state, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("n", [1, 2, 16, 33, 64], ids=lambda n: f"N{n}")
def test_mamba2_tree_verify_and_commits_on_cuda(n):
    import treecompile.ops.mamba2_tree as m2

    batch, h, g, p, s = 3, 8, 2, 64, 128
    gen = torch.Generator().manual_seed(n)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, dt = rnd(batch, n, h, p), rnd(batch, n, h)
    A = -torch.rand(h, generator=gen, dtype=torch.float64) * 2 - 0.1
    B, C = rnd(batch, n, g, s), rnd(batch, n, g, s)
    D, dt_bias = rnd(h), rnd(h)
    state = rnd(batch, h, p, s) * 0.5
    parents = random_parents(batch, n, n + 2)
    width = m2.mamba2_payload_width(h, p, g, s)

    pl64 = poisoned((batch, n, width), torch.float64)
    want = torch.ops.treespec.mamba2_tree_verify(x, dt, A, B, C, D, dt_bias, state, parents, pl64)
    sc64 = poisoned((batch, n, h, p, s), torch.float64)
    torch.ops.treespec.mamba2_tree_verify_staged(x, dt, A, B, C, D, dt_bias, state, parents, sc64)

    cu = lambda t: t.float().cuda()  # noqa: E731
    state_cu = cu(state)
    pl = poisoned((batch, n, width), torch.float32, "cuda")
    got = torch.ops.treespec.mamba2_tree_verify(
        cu(x), cu(dt), cu(A), cu(B), cu(C), cu(D), cu(dt_bias), state_cu, parents.cuda(), pl
    )
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(state_cu.cpu().double(), state.float().double())
    sc = poisoned((batch, n, h, p, s), torch.float32, "cuda")
    got_staged = torch.ops.treespec.mamba2_tree_verify_staged(
        cu(x), cu(dt), cu(A), cu(B), cu(C), cu(D), cu(dt_bias), state_cu, parents.cuda(), sc
    )
    torch.testing.assert_close(got_staged.cpu().double(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(sc.cpu().double(), sc64, atol=2e-3, rtol=2e-3)

    path, lens = accepted_chain(parents, torch.tensor([n, 1, min(n, 2)]))
    want_state = state.clone()
    torch.ops.treespec.mamba2_replay_commit(want_state, pl64, path, lens)
    replayed = state_cu.clone()
    torch.ops.treespec.mamba2_replay_commit(replayed, pl, path.cuda(), lens.cuda())
    torch.testing.assert_close(replayed.cpu().double(), want_state, atol=2e-3, rtol=2e-3)
    staged = state_cu.clone()
    torch.ops.treespec.ssm_commit_staged(staged, sc, path.cuda(), lens.cuda())
    torch.testing.assert_close(staged.cpu().double(), want_state, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 9, 33, 64], ids=lambda n: f"N{n}")
def test_mamba2_tree_verify_chunked_on_cuda_and_in_a_graph(n, dtype):
    """Mamba2-2.7B-like heads (P=64, S_n=128, one group; 16 of its 80 heads): the chunked kernel against the
    float64 sequential reference, its payload replayed, then captured in a CUDA graph and replayed with a
    new tree and new inputs written into the bound buffers. fp32 inputs check the tf32x3 products at fp32
    accuracy (one TF32 product would miss 1e-4)."""
    import treecompile.ops.mamba2_tree as m2

    batch, h, g, p, s = 3, 16, 1, 64, 128
    gen = torch.Generator().manual_seed(100 + n)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def case():
        A = -torch.exp(rnd(h) * 0.5)
        return dict(x=rnd(batch, n, h, p), dt=rnd(batch, n, h), A=A, B=rnd(batch, n, g, s), C=rnd(batch, n, g, s),
                    D=rnd(h), dt_bias=rnd(h) * 0.5, state=rnd(batch, h, p, s) * 0.5)  # fmt: skip

    def oracle(c, parents):
        pl = poisoned((batch, n, m2.mamba2_payload_width(h, p, g, s)), torch.float64)
        y = torch.ops.treespec.mamba2_tree_verify(*c.values(), parents, pl)
        return y, pl

    first, parents = case(), random_parents(batch, n, n + 5)
    bound = {k: (v.to(dtype) if k in ("x", "dt", "B", "C") else v.float()).cuda() for k, v in first.items()}
    tol = dict(atol=3e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    rounded = {k: v.cpu().double() for k, v in bound.items()}  # what the kernel really reads
    parents_cu = parents.cuda()
    pl = poisoned((batch, n, m2.mamba2_payload_width(h, p, g, s)), torch.float32, "cuda")
    y = torch.ops.treespec.mamba2_tree_verify_chunked(*bound.values(), parents_cu, pl)
    want_y, want_pl = oracle(rounded, parents)
    assert y.dtype == dtype
    torch.testing.assert_close(y.cpu().double(), want_y, **tol)
    torch.testing.assert_close(pl.cpu().double(), want_pl, atol=1e-5, rtol=1e-5)
    path, lens = accepted_chain(parents, torch.tensor([n, 1, min(n, 3)]))
    replayed, want_state = bound["state"].clone(), rounded["state"].clone()
    torch.ops.treespec.mamba2_replay_commit(replayed, pl, path.cuda(), lens.cuda())
    torch.ops.treespec.mamba2_replay_commit(want_state, want_pl, path, lens)
    torch.testing.assert_close(replayed.cpu().double(), want_state, atol=2e-3, rtol=2e-3)

    # Capture once, replay with a new tree and new inputs copied into the same buffers.
    out = poisoned(tuple(y.shape), dtype, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(torch.ops.treespec.mamba2_tree_verify_chunked(*bound.values(), parents_cu, pl))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.ops.treespec.mamba2_tree_verify_chunked(*bound.values(), parents_cu, pl))
    second, parents2 = case(), random_parents(batch, n, n + 77).flip(0)
    for k, v in second.items():
        bound[k].copy_(v)
    parents_cu.copy_(parents2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want_y2, _ = oracle({k: v.cpu().double() for k, v in bound.items()}, parents2)
    torch.testing.assert_close(out.cpu().double(), want_y2, **tol)
