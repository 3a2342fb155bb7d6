"""The staged GDN fallback (``replay_ssm=False``): ``gdn_tree_verify_staged`` + ``ssm_commit_staged``.

Every node's scratch row must hold the state a plain float64 chain along the node's root-to-node path
reaches (each root-to-leaf path run as a chain by the independent oracle of test_gdn_tree), rows past N
must stay untouched, the outputs must be exactly the replay op's, and committing the last accepted
node's row must equal decoding the accepted tokens one by one (HF's own decode, bit for bit, on the fp32
CPU path). Kernels run on ``kernel_device``: the Triton interpreter on CPU (so shapes stay small), the device
where CUDA is present; oracles and the ops' reference paths run on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from test_gdn_tree import (
    accepted_paths,
    chain_oracle,
    hf_decode,
    hf_like_inputs,
    leaves,
    make_inputs,
    node_oracle,
    parents_tensor,
    path_to,
    run_verify,
)

import treecompile.ops.gdn_tree as gdn
import treecompile.ops.mamba2_tree as m2
from conftest import poisoned

EXTRA_ROWS = 3  # scratch rows past N: the verify must leave them alone


def run_staged(impl, q, k, v, g, beta, state, parents, scale=None, use_qk_l2norm=True):
    """The staged verify (launcher or op) with a NaN-poisoned scratch of N + EXTRA_ROWS rows and output, made
    on the inputs' device (the launcher's ``kernel_device``)."""
    batch, n, _, dk = q.shape
    hv, dv = v.shape[2:]
    d = q.device
    scratch = poisoned((batch, n + EXTRA_ROWS, hv, dk, dv), state.dtype, d)
    if impl == "kernel":
        o = poisoned((batch, n, hv, dv), q.dtype, d)
        gdn._launch_gdn_tree_verify(
            q, k, v, g, beta, state, parents, scratch, None, o, scale, use_qk_l2norm, staged=True
        )
    else:  # CPU tensors: the reference path
        o = torch.ops.treespec.gdn_tree_verify_staged(q, k, v, g, beta, state, parents, scratch, scale, use_qk_l2norm)
    return o, scratch


# (trees, Hk, Hv): every N the brief names, GQA groups 1 and 2 across them.
TREES = [
    pytest.param([("chain", 1), ("chain", 1)], 1, 1, id="B2-N1-Hv1"),
    pytest.param([("chain", 2), ("star", 2)], 1, 2, id="B2-N2-chain-star-GQA2"),
    pytest.param([("random", 7), ("two_branches", 7)], 2, 2, id="B2-N7-random-fork-Hk2-Hv2"),
    pytest.param([("random", 16), ("star", 16)], 1, 2, id="B2-N16-random-star-GQA2"),
    pytest.param([("two_branches", 33)], 1, 1, id="B1-N33-fork-Hv1"),
    pytest.param([("random", 64)], 1, 2, id="B1-N64-random-GQA2"),
]


@pytest.mark.parametrize("impl", ["kernel", "op"])
@pytest.mark.parametrize("trees,hk,hv", TREES)
def test_staged_states_match_per_path_chains(trees, hk, hv, impl, kernel_device):
    d = kernel_device if impl == "kernel" else "cpu"
    parents = parents_tensor(trees, seed=5)
    batch, n = parents.shape
    inputs = make_inputs(batch, n, hk=hk, hv=hv, dk=8, dv=8, seed=n + hv)
    q, k, v, g, beta, state = (t.to(d) for t in inputs)
    before = state.clone()
    o, scratch = run_staged(impl, q, k, v, g, beta, state, parents.to(d))
    assert torch.equal(state, before)  # verify never writes the state pool
    o, scratch = o.cpu(), scratch.cpu()
    q, k, v, g, beta, state = inputs  # the oracles' (CPU) copies
    assert scratch[:, n:].isnan().all(), "scratch rows past N were written"
    assert not scratch[:, :n].isnan().any(), "some scratch row below N was not written"
    oracle = node_oracle(q, k, v, g, beta, state, parents)
    for b in range(batch):
        for t in range(n):
            want_o, want_s = oracle[(b, t)]
            torch.testing.assert_close(o[b, t], want_o, atol=1e-10, rtol=1e-10, msg=f"o[{b}, {t}]")
            torch.testing.assert_close(scratch[b, t], want_s, atol=1e-10, rtol=1e-10, msg=f"scratch[{b}, {t}]")
    # The outputs are the replay op's (bit for bit on the reference path; the kernel pair is compared
    # bitwise in test_staged_kernel_fp32_agrees_with_replay_commit).
    o_replay, _, _ = run_verify(torch.ops.treespec.gdn_tree_verify, q, k, v, g, beta, state, parents)
    if impl == "op":
        assert torch.equal(o, o_replay)
    else:
        torch.testing.assert_close(o, o_replay, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("impl", ["kernel", "op"])
def test_staged_gqa_odd_dims_strided_inputs(impl, kernel_device):
    """GQA, non-power-of-two head dims, two value blocks, HF-like strided views (on the kernel's device),
    explicit scale, no l2norm."""
    d = kernel_device if impl == "kernel" else "cpu"
    hk, hv, dk, dv = 1, 2, 12, 80
    parents = parents_tensor([("random", 6)], seed=3)
    n = parents.shape[1]
    inputs = hf_like_inputs(hk, hv, dk, dv, n, seed=2, device=d)
    o, scratch = run_staged(impl, *inputs, parents.to(d), 0.2, False)
    o, scratch = o.cpu(), scratch.cpu()
    q, k, v, g, beta, state = (t.cpu() for t in inputs)  # the oracle's copies
    oracle = node_oracle(q, k, v, g, beta, state, parents, scale=0.2, use_qk_l2norm=False)
    for t in range(n):
        want_o, want_s = oracle[(0, t)]
        torch.testing.assert_close(o[0, t], want_o, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(scratch[0, t], want_s, atol=1e-9, rtol=1e-9)
    assert scratch[:, n:].isnan().all()


@pytest.mark.parametrize(
    "trees",
    [
        pytest.param([("chain", 1), ("chain", 1)], id="B2-N1"),
        pytest.param([("random", 33), ("two_branches", 33)], id="B2-N33"),
    ],
)
def test_staged_commit_equals_sequential_decode(trees, kernel_device):
    """ssm_commit_staged (kernel and op) of the last accepted node's row = the accepted tokens as a chain.
    The kernels run on ``kernel_device``; the op on CPU copies (its reference path) of the kernel's scratch."""
    d = kernel_device
    parents = parents_tensor(trees, seed=11)
    batch, n = parents.shape
    q, k, v, g, beta, state = make_inputs(batch, n, hk=1, hv=2, dk=8, dv=8, seed=4)
    _, scratch = run_staged("kernel", *(t.to(d) for t in (q, k, v, g, beta, state, parents)))
    paths, lens = accepted_paths(parents, seed=n)
    by_kernel, by_op = state.to(d).clone(), state.clone()
    m2._launch_ssm_commit_staged(by_kernel, scratch, paths.to(d), lens.to(d))
    by_kernel, scratch = by_kernel.cpu(), scratch.cpu()
    torch.ops.treespec.ssm_commit_staged(by_op, scratch, paths, lens)
    for b in range(batch):
        path = paths[b, : int(lens[b])].tolist()
        if not path:
            assert torch.equal(by_kernel[b], state[b]) and torch.equal(by_op[b], state[b])
            continue
        _, states = chain_oracle(q[b], k[b], v[b], g[b], beta[b], state[b], path)
        torch.testing.assert_close(by_kernel[b], states[-1], atol=1e-10, rtol=1e-10)
        assert torch.equal(by_op[b], by_kernel[b])


def test_staged_reference_fp32_is_bitwise_hf_decode_on_every_path():
    """The CPU path (fp32 state): outputs and the staged commit reproduce HF's decode exactly."""
    parents = parents_tensor([("random", 10), ("two_branches", 10)], seed=5)
    q, k, v, g, beta, state = make_inputs(2, 10, hk=1, hv=2, dk=16, dv=8, dtype=torch.float32)
    o, scratch = run_staged("op", q, k, v, g, beta, state, parents)
    for b, row in enumerate(parents.tolist()):
        for leaf in leaves(row):
            path = path_to(row, leaf)
            outs, final = hf_decode(q[b], k[b], v[b], g[b], beta[b], state[b], path)
            for t, want in zip(path, outs):
                assert torch.equal(o[b, t], want), f"o[{b}, {t}] differs from HF decode"
            commit = state[b : b + 1].clone()
            accepted = torch.tensor([path + [-1] * (10 - len(path))])
            torch.ops.treespec.ssm_commit_staged(commit, scratch[b : b + 1], accepted, torch.tensor([len(path)]))
            assert torch.equal(commit[0], final), f"staged state of path to {leaf} differs from HF decode"


def test_staged_kernel_fp32_agrees_with_replay_commit(kernel_device):
    """fp32 kernels: one staged verify + row copy and one replay verify + replay commit give one state
    (every tensor on ``kernel_device``: kernels against kernels)."""
    d = kernel_device
    parents = parents_tensor([("random", 12), ("star", 12)], seed=9)
    inputs = make_inputs(2, 12, hk=1, hv=2, dk=16, dv=16, dtype=torch.float32)
    q, k, v, g, beta, state = (t.to(d) for t in inputs)
    o_staged, scratch = run_staged("kernel", q, k, v, g, beta, state, parents.to(d))
    o_replay, _, payload = run_verify(gdn._launch_gdn_tree_verify, q, k, v, g, beta, state, parents.to(d))
    assert torch.equal(o_staged, o_replay)
    paths, lens = (t.to(d) for t in accepted_paths(parents, seed=3))
    staged, replayed = state.clone(), state.clone()
    m2._launch_ssm_commit_staged(staged, scratch, paths, lens)
    gdn._launch_gdn_replay_commit(replayed, payload, paths, lens)
    torch.testing.assert_close(staged, replayed, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# Opcheck and bad input
# --------------------------------------------------------------------------------------------------


def small_case(dtype=torch.float32):
    parents = torch.tensor([[-1, 0, 0]])
    q, k, v, g, beta, state = make_inputs(1, 3, hk=1, hv=2, dk=4, dv=4, dtype=dtype)
    scratch = torch.zeros(1, 4, 2, 4, 4, dtype=state.dtype)
    return q, k, v, g, beta, state, parents, scratch


def test_opcheck():
    args = small_case()
    staged = torch.ops.treespec.gdn_tree_verify_staged.default
    torch.library.opcheck(staged, args, {"scale": None, "use_qk_l2norm": True})
    torch.library.opcheck(staged, args, {"scale": 0.5, "use_qk_l2norm": False})
    state, scratch = args[5].clone(), args[7]
    torch.library.opcheck(
        torch.ops.treespec.ssm_commit_staged.default, (state, scratch, torch.tensor([[0, 2, -1]]), torch.tensor([2]))
    )


def test_bad_input_is_refused_before_launch():
    q, k, v, g, beta, state, parents, scratch = small_case()
    op = torch.ops.treespec.gdn_tree_verify_staged

    def verify(**override):
        args = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, parents=parents, scratch=scratch)
        args.update(override)
        return op(*args.values())

    with pytest.raises(ValueError, match="scratch: expected a 5-d tensor"):
        verify(scratch=torch.zeros(1, 3, 2, 4))
    with pytest.raises(ValueError, match=r"scratch: expected \[B=1, >= N=3, Hv=2, Dk=4, Dv=4\]"):
        verify(scratch=torch.zeros(1, 2, 2, 4, 4))  # fewer rows than nodes
    with pytest.raises(ValueError, match=r"scratch: expected \[B=1, >= N=3"):
        verify(scratch=torch.zeros(1, 3, 2, 4, 5))
    with pytest.raises(ValueError, match="scratch: dtype torch.float64 must equal the state dtype"):
        verify(scratch=scratch.double())
    with pytest.raises(ValueError, match="state: the recurrent state must be torch.float32"):
        verify(state=state.bfloat16(), scratch=scratch.bfloat16())
    with pytest.raises(ValueError, match="multiple of the key heads"):
        two_key_heads = torch.zeros(1, 3, 2, 4)
        three_heads = torch.zeros(1, 3, 3)
        verify(q=two_key_heads, k=two_key_heads, v=torch.zeros(1, 3, 3, 4), g=three_heads, beta=three_heads)
    with pytest.raises(ValueError, match="parents: expected dtype torch.int64"):
        verify(parents=parents.int())
    with pytest.raises(ValueError, match=r"1\.\.64 nodes, got 65"):
        big = make_inputs(1, 65, hk=1, hv=2, dk=4, dv=4, dtype=torch.float32)
        op(*big, torch.tensor([[-1] + list(range(64))]), torch.zeros(1, 65, 2, 4, 4))
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        verify(scratch=torch.zeros(1, 3, 2, 4, 4, device="meta"))
