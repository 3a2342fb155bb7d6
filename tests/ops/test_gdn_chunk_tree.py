"""Chunked GDN tree verify (kernel and its chunked reference) against the sequential tree verify.

The oracle is ``gdn_tree_verify_reference`` in float64 (itself checked against per-path chains in
test_gdn_tree.py): each node's output must match it and each payload row must equal the sequential op's.
Kernels run on ``kernel_device``: the Triton interpreter on CPU (so shapes stay small), the device where CUDA is
present; the references always run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import treecompile.ops.gdn_chunk_tree as chunked
import treecompile.ops.gdn_tree as gdn
from conftest import poisoned

# --------------------------------------------------------------------------------------------------
# Trees and inputs
# --------------------------------------------------------------------------------------------------


def make_parents(kind: str, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "two_roots":  # a second root (parent -1) halfway: starts from the committed state too
        half = n // 2
        return [-1] + [i - 1 for i in range(1, half)] + [-1] + [i - 1 for i in range(half + 1, n)]
    if kind == "random":
        return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    raise AssertionError(kind)


def parents_tensor(kinds_and_n, seed=0) -> torch.Tensor:
    return torch.tensor([make_parents(kind, n, seed + i) for i, (kind, n) in enumerate(kinds_and_n)])


def make_inputs(batch, n, hk, hv, dk, dv, dtype=torch.float64, g_range=(-1.0, 0.0), seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(batch, n, hk, dk), rnd(batch, n, hk, dk), rnd(batch, n, hv, dv)
    lo, hi = g_range
    g = lo + (hi - lo) * torch.rand(batch, n, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, n, hv, generator=gen, dtype=torch.float64)
    state = rnd(batch, hv, dk, dv) * 0.5
    return tuple(t.to(dtype) for t in (q, k, v, g, beta, state))


def sequential(q, k, v, g, beta, state, parents, scale=None, use_qk_l2norm=True):
    """The oracle: the sequential reference in the state's dtype -> (o, payload)."""
    batch, n, hk, dk = q.shape
    hv, dv = v.shape[2:]
    workspace = torch.zeros((batch, n, hv, dk, dv), dtype=state.dtype)
    payload = poisoned((batch, n, gdn.gdn_payload_width(hk, dk, hv, dv)), state.dtype)
    args = (q, k, v, g, beta, state, parents, workspace, payload, scale, use_qk_l2norm)
    return gdn.gdn_tree_verify_reference(*args), payload


def run_chunked(impl, q, k, v, g, beta, state, parents, scale=None, use_qk_l2norm=True, spare_rows=2, **kw):
    """Call the kernel launcher, the chunked reference or the op with NaN-poisoned o and payload.

    o and the payload are made on the inputs' device (the kernel's ``kernel_device``) and come back as CPU
    copies. The payload has ``spare_rows`` rows past N, which must stay NaN.
    """
    batch, n, hk, dk = q.shape
    hv, dv = v.shape[2:]
    d = q.device
    payload = poisoned((batch, n + spare_rows, gdn.gdn_payload_width(hk, dk, hv, dv)), state.dtype, d)
    if impl == "kernel":
        o = poisoned((batch, n, hv, dv), q.dtype, d)
        chunked._launch_gdn_tree_verify_chunked(
            q, k, v, g, beta, state, parents, payload, o, scale, use_qk_l2norm, **kw
        )
    elif impl == "reference":
        o = chunked.gdn_tree_verify_chunked_reference(
            q, k, v, g, beta, state, parents, payload, scale, use_qk_l2norm
        )
    else:
        o = torch.ops.treespec.gdn_tree_verify_chunked(
            q, k, v, g, beta, state, parents, payload, scale, use_qk_l2norm
        )
    o, payload = o.cpu(), payload.cpu()
    assert o.dtype == q.dtype and o.shape == (batch, n, hv, dv)
    assert not o.isnan().any(), "an output element was not written"
    assert not payload[:, :n].isnan().any(), "a payload row < N was not written whole"
    assert payload[:, n:].isnan().all(), "a payload row >= N was written"
    return o, payload[:, :n]


def check(impl, inputs, parents, atol, scale=None, use_qk_l2norm=True, device="cpu", **kw):
    """``impl`` against the float64 sequential oracle (outputs) and the sequential op (payload). The kernel
    runs on ``device`` (the inputs moved there, if not there already); everything else on the CPU."""
    d = device if impl == "kernel" else "cpu"
    q, k, v, g, beta, state = (t.to(d) for t in inputs)
    before = state.clone()
    o, payload = run_chunked(impl, q, k, v, g, beta, state, parents.to(d), scale, use_qk_l2norm, **kw)
    assert torch.equal(state, before), "verify wrote the committed state"
    inputs = tuple(t.cpu() for t in inputs)  # the references' copies
    as64 = [t.double() for t in inputs]
    want_o, want_payload = sequential(*as64, parents, scale, use_qk_l2norm)
    torch.testing.assert_close(o.double(), want_o, atol=atol, rtol=atol)
    torch.testing.assert_close(payload.double(), want_payload, atol=atol, rtol=atol)
    if state.dtype != torch.float64:  # same dtype: the payload is the sequential op's, element for element
        _, same_dtype_payload = sequential(*inputs, parents, scale, use_qk_l2norm)
        torch.testing.assert_close(payload, same_dtype_payload, atol=1e-6, rtol=1e-6)
    return o


# --------------------------------------------------------------------------------------------------
# Fuzzed trees
# --------------------------------------------------------------------------------------------------

TREES = [
    pytest.param([("chain", 1), ("chain", 1)], id="B2-N1"),
    pytest.param([("chain", 2), ("star", 2)], id="B2-N2-chain-star"),
    pytest.param([("random", 7), ("two_roots", 7)], id="B2-N7-random-two-roots"),
    pytest.param([("star", 8), ("random", 8)], id="B2-N8-star-random"),
    pytest.param([("random", 12), ("chain", 12)], id="B2-N12-random-chain"),
    pytest.param([("random", 16), ("star", 16)], id="B2-N16-random-star"),
]
HEADS = [pytest.param((1, 2), id="Hk1-Hv2-gqa"), pytest.param((2, 2), id="Hk2-Hv2")]


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("trees", TREES)
def test_chunked_matches_sequential_float64(trees, heads, impl, kernel_device):
    parents = parents_tensor(trees, seed=3 * trees[0][1])
    batch, n = parents.shape
    hk, hv = heads
    inputs = make_inputs(batch, n, hk, hv, dk=16, dv=32, seed=n + hk)
    check(impl, inputs, parents, atol=1e-11, device=kernel_device)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("n", [8, 16], ids=lambda n: f"N{n}")
def test_chunked_fp32_state_matches_float64_and_fp32_sequential(n, impl, kernel_device):
    parents = parents_tensor([("random", n), ("random", n)], seed=40 + n)
    inputs = make_inputs(2, n, hk=1, hv=2, dk=32, dv=16, dtype=torch.float32, seed=n)
    o = check(impl, inputs, parents, atol=2e-5, device=kernel_device)
    fp32_o, _ = sequential(*inputs, parents)
    torch.testing.assert_close(o, fp32_o, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize(
    "g_range",
    [
        pytest.param((-40.0, -10.0), id="g-strongly-negative"),
        pytest.param((-1e-4, 0.0), id="g-near-zero"),
        pytest.param((0.0, 0.0), id="g-zero"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_chunked_extreme_decays(g_range, dtype, impl, kernel_device):
    """exp(G) underflows to 0 along deep paths, or every decay is 1 (pure delta rule, no forgetting)."""
    parents = parents_tensor([("chain", 16), ("random", 16)], seed=9)
    inputs = make_inputs(2, 16, hk=1, hv=1, dk=16, dv=16, dtype=dtype, g_range=g_range, seed=5)
    o = check(impl, inputs, parents, atol=1e-11 if dtype == torch.float64 else 2e-5, device=kernel_device)
    assert o.isfinite().all()


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_chunked_strided_inputs_odd_dims_value_blocks(impl, kernel_device):
    """HF's split views (non-contiguous), Dk/Dv not powers of two, no l2norm + explicit scale, several
    value blocks per head (the kernel at block_v=16). The kernel's views are made on its device."""
    d = kernel_device if impl == "kernel" else "cpu"
    hk, hv, dk, dv = 1, 2, 12, 20
    parents = parents_tensor([("random", 11)], seed=3)
    n = parents.shape[1]
    gen = torch.Generator().manual_seed(1)
    mixed = torch.randn(1, n, 2 * hk * dk + hv * dv, generator=gen, dtype=torch.float64).to(d)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(1, n, hk, dk), k.reshape(1, n, hk, dk), v.reshape(1, n, hv, dv)
    assert not q.is_contiguous()
    gb = torch.rand(1, n, 2 * hv, generator=gen, dtype=torch.float64).to(d)
    g, beta = -gb[..., :hv], gb[..., hv:]
    state = torch.randn(1, hv, dk, dv, generator=gen, dtype=torch.float64).to(d).transpose(-1, -2)
    state = state.contiguous().transpose(-1, -2)  # a column-major state tile
    kw = {"block_v": 16} if impl == "kernel" else {}
    for scale, l2 in ((0.3, True), (0.05, False)):
        check(impl, (q, k, v, g, beta, state), parents, atol=1e-10, scale=scale, use_qk_l2norm=l2, device=d, **kw)


def test_kernel_takes_views_of_state_tables(kernel_device):
    """parents every other column of a wider table, the payload a column slice of a wider buffer, the
    state a layer slice of a pool, o a strided view: the kernel follows every stride."""
    d = kernel_device
    parents = parents_tensor([("random", 9), ("two_roots", 9)], seed=8)
    batch, n = parents.shape
    inputs = make_inputs(batch, n, hk=1, hv=2, dk=16, dv=16, seed=8)
    q, k, v, g, beta, state = (t.to(d) for t in inputs)
    width = gdn.gdn_payload_width(1, 16, 2, 16)
    parents_table = torch.full((batch, 2 * n + 1), -7, dtype=torch.int64, device=d)
    parents_table[:, 1::2] = parents
    state_view = torch.full((batch, 3, 2, 16, 16), float("nan"), dtype=torch.float64, device=d)[:, 1]
    state_view.copy_(state)
    payload_view = poisoned((batch, n, width + 6), torch.float64, d)[:, :, 2 : 2 + width]
    o_view = poisoned((batch, n, 2, 32), torch.float64, d)[..., ::2]
    chunked._launch_gdn_tree_verify_chunked(
        q, k, v, g, beta, state_view, parents_table[:, 1::2], payload_view, o_view, None, True
    )
    want_o, want_payload = sequential(*inputs, parents)
    torch.testing.assert_close(o_view.cpu(), want_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(payload_view.cpu(), want_payload, atol=1e-10, rtol=1e-10)


def test_chunked_bf16_inputs_fp32_state(kernel_device):
    """bf16 q/k/v/g/beta with an fp32 state (Qwen3-Next's dtypes): o in bf16, math in fp32."""
    d = kernel_device
    parents = parents_tensor([("random", 16)], seed=2)
    inputs = make_inputs(1, 16, hk=1, hv=2, dk=16, dv=16, dtype=torch.bfloat16, seed=3)
    inputs = inputs[:5] + (inputs[5].float(),)
    o, payload = run_chunked("kernel", *(t.to(d) for t in inputs), parents.to(d))
    assert o.dtype == torch.bfloat16
    want_o, want_payload = sequential(*[t.double() for t in inputs], parents)
    torch.testing.assert_close(o.double(), want_o, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(payload.double(), want_payload, atol=1e-6, rtol=1e-6)


def test_op_is_the_chunked_reference_on_cpu():
    parents = parents_tensor([("random", 9), ("star", 9)], seed=6)
    inputs = make_inputs(2, 9, hk=1, hv=2, dk=16, dv=16, dtype=torch.float32)
    by_op, op_payload = run_chunked("op", *inputs, parents)
    by_ref, ref_payload = run_chunked("reference", *inputs, parents)
    assert torch.equal(by_op, by_ref) and torch.equal(op_payload, ref_payload)


def test_replay_of_chunked_payload_equals_path_state(kernel_device):
    """The payload feeds gdn_replay_commit: replaying a root-to-leaf path gives that path's state (the
    kernel's payload, copied back to the CPU, replayed by the reference)."""
    d = kernel_device
    parents = parents_tensor([("random", 12)], seed=8)
    q, k, v, g, beta, state = make_inputs(1, 12, hk=1, hv=2, dk=16, dv=16)
    _, payload = run_chunked("kernel", *(t.to(d) for t in (q, k, v, g, beta, state, parents)), spare_rows=0)
    path = [11]
    while parents[0, path[-1]] >= 0:
        path.append(int(parents[0, path[-1]]))
    path, length = path[::-1], torch.tensor([len(path)])
    committed = state.clone()
    gdn.gdn_replay_commit_reference(committed, payload, torch.tensor([path + [-1] * (12 - len(path))]), length)
    # The same path verified as a plain chain by the sequential reference, then replayed.
    chain = torch.tensor([[-1] + list(range(len(path) - 1))])
    _, chain_payload = sequential(*[t[:, path] for t in (q, k, v, g, beta)], state, chain)
    want = state.clone()
    gdn.gdn_replay_commit_reference(want, chain_payload, torch.arange(len(path))[None], length)
    torch.testing.assert_close(committed, want, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------------------------------
# opcheck, bad input
# --------------------------------------------------------------------------------------------------


def small_case(n=3, dtype=torch.float32):
    parents = parents_tensor([("random", n)], seed=1)
    q, k, v, g, beta, state = make_inputs(1, n, hk=1, hv=2, dk=4, dv=4, dtype=dtype)
    payload = torch.zeros(1, n, gdn.gdn_payload_width(1, 4, 2, 4), dtype=state.dtype)
    return q, k, v, g, beta, state, parents, payload


def test_opcheck():
    op = torch.ops.treespec.gdn_tree_verify_chunked.default
    args = small_case()
    torch.library.opcheck(op, args, {"scale": None, "use_qk_l2norm": True})
    torch.library.opcheck(op, args, {"scale": 0.5, "use_qk_l2norm": False})


def test_bad_input_is_refused():
    q, k, v, g, beta, state, parents, payload = small_case()
    op = torch.ops.treespec.gdn_tree_verify_chunked

    def verify(**override):
        args = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, parents=parents, payload=payload)
        args.update(override)
        return op(*args.values())

    assert verify().shape == (1, 3, 2, 4)  # the unmodified case is accepted
    with pytest.raises(ValueError, match=r"^q: .*1\.\.16 tree nodes, got N = 17"):
        op(*small_case(17))
    op(*small_case(16))  # the limit itself is accepted
    with pytest.raises(ValueError, match="1..64 nodes, got 0"):
        verify(**{name: t[:, :0] for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))},
               parents=parents[:, :0])  # fmt: skip
    with pytest.raises(ValueError, match="parents: expected dtype torch.int64"):
        verify(parents=parents.int())
    with pytest.raises(ValueError, match="q: expected dtype"):
        verify(q=q.to(torch.int32))
    with pytest.raises(ValueError, match="state: the recurrent state must be torch.float32"):
        verify(state=state.bfloat16(), payload=payload.bfloat16())
    with pytest.raises(ValueError, match="payload: dtype torch.float64 must equal the state dtype"):
        verify(payload=payload.double())
    with pytest.raises(ValueError, match="payload: expected"):
        verify(payload=payload[:, :, :-1])
    with pytest.raises(ValueError, match="payload: expected"):
        verify(payload=payload[:, :2])
    with pytest.raises(ValueError, match="multiple of the key heads"):
        two_key_heads = torch.zeros(1, 3, 2, 4)
        three_heads = torch.zeros(1, 3, 3)
        verify(q=two_key_heads, k=two_key_heads, v=torch.zeros(1, 3, 3, 4), g=three_heads, beta=three_heads)
    with pytest.raises(ValueError, match="g: expected"):
        verify(g=g[:, :, :1])
    with pytest.raises(ValueError, match="state: expected"):
        verify(state=state[:, :1])
