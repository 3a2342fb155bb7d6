"""treespec::verify_tree_greedy: Triton kernel and reference against a per-tree Python walk."""

import pytest
import torch
from conftest import poisoned

from treecompile.ops.verify import _launch_verify_tree_greedy, verify_tree_greedy_reference

ODD_SIZES = (1, 2, 3, 8, 33, 63, 64)


def random_parents(batch: int, num_nodes: int, gen: torch.Generator) -> torch.Tensor:
    """Random trees in topological order: uniform, deep (mostly the previous node) or bushy rows."""
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    style = torch.randint(0, 3, (batch,), generator=gen)
    for i in range(1, num_nodes):
        uniform = torch.randint(0, i, (batch,), generator=gen)
        deep = torch.where(torch.rand(batch, generator=gen) < 0.7, i - 1, uniform)
        bushy = uniform % min(i, 3)
        parents[:, i] = torch.where(style == 0, uniform, torch.where(style == 1, deep, bushy))
    return parents


def random_case(batch: int, num_nodes: int, seed: int):
    """Trees with tokens from a tiny vocabulary (2..3 tokens), so walks go deep and ties are common;
    a quarter of the rows plant the target so that every node matches (the walk then takes the
    lowest-index child at every step)."""
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(batch, num_nodes, gen)
    vocab = 2 + (torch.arange(batch) % 2).unsqueeze(1)
    tokens = torch.randint(0, 1 << 20, (batch, num_nodes), generator=gen) % vocab
    target = torch.randint(0, 1 << 20, (batch, num_nodes), generator=gen) % vocab
    planted = torch.rand(batch, generator=gen) < 0.25
    tokens[planted] = 1
    target[planted] = 1
    return parents, tokens, target


def oracle_verify(parents: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor):
    """Walk each tree with Python lists: the lowest-index child carrying the target token wins."""
    paths, lengths, bonuses = [], [], []
    for par, tok, tgt in zip(parents.tolist(), tokens.tolist(), target.tolist()):
        n = len(par)
        children = [[] for _ in range(n)]
        for i in range(1, n):
            children[par[i]].append(i)  # ascending node order
        path, cur = [0], 0
        while True:
            nxt = next((c for c in children[cur] if tok[c] == tgt[cur]), None)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        paths.append(path + [-1] * (n - len(path)))
        lengths.append(len(path))
        bonuses.append(tgt[cur])
    return torch.tensor(paths), torch.tensor(lengths), torch.tensor(bonuses)


def run_launcher(parents, tokens, target, block_b=None):
    batch, num_nodes = parents.shape
    device = parents.device
    outs = (
        poisoned((batch, num_nodes), torch.int64, device),
        poisoned((batch,), torch.int64, device),
        poisoned((batch,), torch.int64, device),
    )
    _launch_verify_tree_greedy(parents, tokens, target, *outs, block_b=block_b)
    return tuple(o.cpu() for o in outs)


def assert_same(got, want):
    for g, w, name in zip(got, want, ("accepted_path", "accept_len", "bonus")):
        assert torch.equal(g, w), f"{name} differs"


@pytest.mark.parametrize("num_nodes", ODD_SIZES, ids=lambda n: f"N{n}")
def test_kernel_matches_oracle(num_nodes, kernel_device):
    case = random_case(160, num_nodes, seed=num_nodes)  # 7 sizes x 160 = 1120 trees
    got = run_launcher(*(t.to(kernel_device) for t in case))
    want = oracle_verify(*case)
    assert_same(got, want)
    if num_nodes >= 33:  # the cases exercise long walks, not only the root
        assert want[1].max() >= 8


@pytest.mark.parametrize("batch,block_b", [(5, 1), (7, 4), (33, 16)], ids=lambda v: str(v))
def test_kernel_partial_programs(batch, block_b, kernel_device):
    case = random_case(batch, 33, seed=batch)
    assert_same(run_launcher(*(t.to(kernel_device) for t in case), block_b=block_b), oracle_verify(*case))


def test_kernel_strided_inputs(kernel_device):
    parents, tokens, target = random_case(10, 40, seed=5)
    stacked = torch.stack([parents, tokens, target], dim=2).to(kernel_device)  # node stride 3
    got = run_launcher(stacked[..., 0], stacked[..., 1], stacked[..., 2])
    assert_same(got, oracle_verify(parents, tokens, target))


@pytest.mark.parametrize("num_nodes", ODD_SIZES, ids=lambda n: f"N{n}")
def test_reference_matches_oracle(num_nodes):
    case = random_case(300, num_nodes, seed=100 + num_nodes)
    assert_same(verify_tree_greedy_reference(*case), oracle_verify(*case))


@pytest.mark.parametrize("num_nodes", (1, 2, 33, 64), ids=lambda n: f"N{n}")
def test_chain_shaped_tree_verifies_like_the_chain(num_nodes, kernel_device):
    """A chain accepts while tokens[i + 1] == target[i]: path 0..L-1, bonus target[L - 1]."""
    batch = 40
    gen = torch.Generator().manual_seed(num_nodes)
    parents = (torch.arange(num_nodes) - 1).expand(batch, num_nodes).contiguous()
    target = torch.randint(0, 5, (batch, num_nodes), generator=gen)
    tokens = torch.randint(0, 5, (batch, num_nodes), generator=gen)
    # Row b agrees on its first b % num_nodes steps, then disagrees (unless the chain ends first).
    for b in range(batch):
        agree = b % num_nodes
        tokens[b, 1 : agree + 1] = target[b, :agree]
        if agree + 1 < num_nodes:
            tokens[b, agree + 1] = target[b, agree] + 1
    lengths = torch.tensor([b % num_nodes + 1 for b in range(batch)])
    nodes = torch.arange(num_nodes)
    want_path = torch.where(nodes < lengths.unsqueeze(1), nodes, -1)
    want_bonus = target.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    want = (want_path, lengths, want_bonus)
    dev = (t.to(kernel_device) for t in (parents, tokens, target))
    assert_same(run_launcher(*dev), want)
    assert_same(verify_tree_greedy_reference(parents, tokens, target), want)


def test_ties_take_lowest_index_without_backtracking(kernel_device):
    # 0 -> {1, 2, 3}; 2 -> {4}; 3 -> {5}. Nodes 2 and 3 both carry target[0] = 7: node 2 wins. Node 2's
    # child misses while node 3's child would match: the walk stops at 2 (no backtracking).
    parents = torch.tensor([[-1, 0, 0, 0, 2, 3]])
    tokens = torch.tensor([[0, 6, 7, 7, 1, 9]])
    target = torch.tensor([[7, 0, 9, 9, 0, 0]])
    want = (torch.tensor([[0, 2, -1, -1, -1, -1]]), torch.tensor([2]), torch.tensor([9]))
    dev = [t.to(kernel_device) for t in (parents, tokens, target)]
    assert_same(run_launcher(*dev), want)
    assert_same(verify_tree_greedy_reference(parents, tokens, target), want)
    assert_same(oracle_verify(parents, tokens, target), want)


def test_deep_tie_between_later_siblings(kernel_device):
    # Two ties on one walk: 1 beats 2 under the root, then 3 beats 5 under node 1; 3's child 6 ends it.
    parents = torch.tensor([[-1, 0, 0, 1, 0, 1, 3]])
    tokens = torch.tensor([[0, 4, 4, 8, 5, 8, 2]])
    target = torch.tensor([[4, 8, 0, 2, 0, 0, 11]])
    want = (torch.tensor([[0, 1, 3, 6, -1, -1, -1]]), torch.tensor([4]), torch.tensor([11]))
    assert_same(run_launcher(*(t.to(kernel_device) for t in (parents, tokens, target))), want)
    assert_same(verify_tree_greedy_reference(parents, tokens, target), want)


def test_nothing_accepted_gives_root_and_its_target(kernel_device):
    parents, tokens, target = random_case(6, 17, seed=9)
    tokens = target.max() + 1 + tokens  # no node can match
    got = run_launcher(parents.to(kernel_device), tokens.to(kernel_device), target.to(kernel_device))
    assert torch.equal(got[0][:, 0], torch.zeros(6, dtype=torch.int64))
    assert torch.equal(got[0][:, 1:], torch.full((6, 16), -1))
    assert torch.equal(got[1], torch.ones(6, dtype=torch.int64))
    assert torch.equal(got[2], target[:, 0])


def test_op_dispatch_cpu_matches_reference():
    case = random_case(64, 33, seed=21)
    got = torch.ops.treespec.verify_tree_greedy(*case)
    assert_same(got, verify_tree_greedy_reference(*case))


def test_opcheck():
    case = random_case(3, 9, seed=2)
    torch.library.opcheck(torch.ops.treespec.verify_tree_greedy.default, case)


def _bad(parents=None, tokens=None, target=None):
    good = torch.zeros(2, 4, dtype=torch.int64)
    return (
        good.clone() if parents is None else parents,
        good.clone() if tokens is None else tokens,
        good.clone() if target is None else target,
    )


@pytest.mark.parametrize(
    "args,match",
    [
        (_bad(tokens=torch.zeros(3, 4, dtype=torch.int64)), "tokens: batch size 3"),
        (_bad(target=torch.zeros(1, 4, dtype=torch.int64)), "target_tokens: batch size 1"),
        (_bad(tokens=torch.zeros(2, 5, dtype=torch.int64)), "tokens: 5 nodes"),
        (_bad(target=torch.zeros(2, 3, dtype=torch.int64)), "target_tokens: 3 nodes"),
        (_bad(parents=torch.zeros(2, 4, dtype=torch.int32)), "parents: expected dtype torch.int64"),
        (_bad(tokens=torch.zeros(2, 4, dtype=torch.int32)), "tokens: expected dtype torch.int64"),
        (_bad(target=torch.zeros(2, 4)), "target_tokens: expected dtype torch.int64"),
        (_bad(tokens=torch.zeros(8, dtype=torch.int64)), "tokens: expected a 2-d"),
        (_bad(*(torch.zeros(2, 65, dtype=torch.int64) for _ in range(3))), "1..64"),
        (_bad(target=torch.zeros(2, 4, dtype=torch.int64, device="meta")), "one device"),
    ],
    ids=[
        "batch-tokens", "batch-target", "nodes-tokens", "nodes-target", "dtype-parents",
        "dtype-tokens", "dtype-target", "dim-tokens", "N65", "device",
    ],
)
def test_op_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.verify_tree_greedy(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("num_nodes", ODD_SIZES, ids=lambda n: f"N{n}")
def test_gpu_op_matches_reference(num_nodes):
    case = random_case(1000, num_nodes, seed=300 + num_nodes)
    got = torch.ops.treespec.verify_tree_greedy(*(t.cuda() for t in case))
    assert_same(tuple(t.cpu() for t in got), verify_tree_greedy_reference(*case))


@pytest.mark.gpu
def test_gpu_opcheck():
    case = tuple(t.cuda() for t in random_case(3, 9, seed=2))
    torch.library.opcheck(torch.ops.treespec.verify_tree_greedy.default, case)


@pytest.mark.parametrize(
    "parents, match",
    [
        pytest.param([[-1, 0, 5]], r"parents\[0, 2\] = 5", id="parent-past-node"),
        pytest.param([[-1, 2, 1]], r"parents\[0, 1\] = 2", id="cycle"),
        pytest.param([[0, 0, 1]], "root's parent must be -1", id="root-not-minus-1"),
        pytest.param([[-1, 1, 1]], r"parents\[0, 1\] = 1", id="self-loop"),
    ],
)
def test_ops_refuse_parents_that_are_not_a_tree_on_cpu(parents, match):
    """On CPU the value check is free, so the ops run it at the boundary: no silent garbage."""
    p = torch.tensor(parents)
    t = torch.zeros_like(p)
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.verify_tree_greedy(p, t, t)
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.build_ancestor_mask(p)


def test_value_checks_on_cuda_are_opt_in(monkeypatch):
    from treecompile.ops._common import values_checkable

    cpu = torch.zeros(2, dtype=torch.int64)
    assert values_checkable(cpu)
    meta = torch.zeros(2, dtype=torch.int64, device="meta")  # stands in for a device tensor
    monkeypatch.delenv("TREECOMPILE_CHECK_VALUES", raising=False)
    assert not values_checkable(meta)
    monkeypatch.setenv("TREECOMPILE_CHECK_VALUES", "1")
    assert values_checkable(meta)
