"""TreeSpec: the fresh spec is the chain, the two position shifts cancel for any depth buffer, hidden-row
compaction against a per-request Python reference, bound buffers keep their addresses."""

from __future__ import annotations

import random

import pytest
import torch

from treecompile.draft_tree import DraftTree, TreeBatch
from treecompile.tree_spec import TreeSpec, chain_ancestor_mask

NODE_COUNTS = [1, 2, 5, 33, 63, 64]


def _to_int64(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def random_tree(rng: random.Random, N: int):
    """Parents (parents[i] < i), depth and ancestor-mask lists of a random N-node tree."""
    parents, depth, masks = [-1], [0], [1]
    for i in range(1, N):
        # Mix bushy and deep shapes: often attach to the previous node.
        p = i - 1 if rng.random() < 0.5 else rng.randrange(i)
        parents.append(p)
        depth.append(depth[p] + 1)
        masks.append(masks[p] | (1 << i))
    return parents, depth, [_to_int64(m) for m in masks]


def random_path(rng: random.Random, parents):
    """A root path of the tree (greedy-walk shaped): node indices root first."""
    children = {i: [j for j in range(len(parents)) if parents[j] == i] for i in range(len(parents))}
    path = [0]
    while children[path[-1]] and rng.random() < 0.85:
        path.append(rng.choice(children[path[-1]]))
    return path


def random_batch(rng: random.Random, B: int, N: int) -> TreeBatch:
    trees = [random_tree(rng, N) for _ in range(B)]
    as_tensor = lambda k: torch.tensor([t[k] for t in trees], dtype=torch.int64)  # noqa: E731
    return TreeBatch(
        tokens=torch.zeros(B, N, dtype=torch.int64),
        parents=as_tensor(0),
        depth=as_tensor(1),
        ancestor_mask=as_tensor(2),
        candidate=torch.zeros(B, N, dtype=torch.int64),
    )


def _ptrs(spec: TreeSpec):
    return [t.data_ptr() for t in (spec.parents, spec.depth, spec.ancestor_mask, spec.positions)]


@pytest.mark.parametrize("N", NODE_COUNTS, ids=lambda n: f"N{n}")
def test_fresh_spec_is_the_chain(N):
    B = 3
    spec = TreeSpec(B, N)
    node = torch.arange(N)
    assert torch.equal(spec.parents, (node - 1).expand(B, N))
    assert torch.equal(spec.depth, node.expand(B, N))
    assert spec.ancestor_mask[1].tolist() == [_to_int64((1 << (i + 1)) - 1) for i in range(N)]
    assert torch.equal(spec.positions, node.expand(B, N))
    vc = torch.tensor([0, 7, 1000])
    # Graph warm-up replays the forward without step prep: positions come out as the chain's.
    assert torch.equal(spec.load_step(vc), vc[:, None] + node)
    hidden = torch.randn(B, N, 4, dtype=torch.float64)
    before = hidden.clone()
    path = torch.full((B, N), -1, dtype=torch.int64)
    path[:, :N] = node  # a chain accepts its prefix in order: compaction moves nothing
    spec.compact_rows(hidden, path, torch.tensor([N, 1, max(N // 2, 1)]), vc)
    assert torch.equal(hidden, before)
    assert torch.equal(spec.positions, vc[:, None] + node)


@pytest.mark.parametrize("N", NODE_COUNTS, ids=lambda n: f"N{n}")
def test_shifts_cancel_for_any_depth(N):
    B = 4
    rng = random.Random(N)
    g = torch.Generator().manual_seed(N)
    spec = TreeSpec(B, N)
    ptrs = _ptrs(spec)
    node = torch.arange(N)
    for trial in range(100):
        if trial % 2:
            spec.set_tree(random_batch(rng, B, N))
        else:  # any depth buffer at all, tree or not
            spec.depth.copy_(torch.randint(0, 1 << 20, (B, N), generator=g))
        vc = torch.randint(0, 1 << 30, (B,), generator=g)
        positions = spec.load_step(vc)
        assert positions is spec.positions
        assert torch.equal(positions, vc[:, None] + spec.depth)
        path = torch.full((B, N), -1, dtype=torch.int64)
        accept_len = torch.randint(1, N + 1, (B,), generator=g)
        for b in range(B):
            path[b, : accept_len[b]] = torch.randperm(N, generator=g)[: accept_len[b]]
        spec.compact_rows(torch.zeros(B, N, 2), path, accept_len, vc)
        assert torch.equal(spec.positions, vc[:, None] + node)
    assert _ptrs(spec) == ptrs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N, H", [(1, 3), (2, 1), (33, 5), (63, 2), (64, 7)], ids=lambda v: str(v))
def test_compact_rows_moves_the_accepted_path(N, H, dtype):
    B = 5
    rng = random.Random(1000 + N)
    spec = TreeSpec(B, N)
    for _ in range(20):
        tree = random_batch(rng, B, N)
        spec.set_tree(tree)
        vc = torch.tensor([rng.randrange(1 << 20) for _ in range(B)])
        spec.load_step(vc)
        hidden = torch.randn(B, N, H).to(dtype)
        ptr = hidden.data_ptr()
        want = hidden.clone()
        path = torch.full((B, N), -1, dtype=torch.int64)  # padding past accept_len
        accept_len = torch.zeros(B, dtype=torch.int64)
        for b in range(B):
            nodes = random_path(rng, tree.parents[b].tolist())
            path[b, : len(nodes)] = torch.tensor(nodes)
            accept_len[b] = len(nodes)
            for i, node in enumerate(nodes):  # reference reads the original rows: overlap is harmless
                want[b, i] = hidden[b, node]
        spec.compact_rows(hidden, path, accept_len, vc)
        assert hidden.data_ptr() == ptr
        assert torch.equal(hidden, want)
        assert torch.equal(spec.positions, vc[:, None] + torch.arange(N))
        # Row i of the path sits at depth i, so its old position vc + depth equals the new vc + i.
        for b in range(B):
            n = int(accept_len[b])
            assert tree.depth[b, path[b, :n]].tolist() == list(range(n))


def test_compact_rows_handles_overlapping_moves():
    spec = TreeSpec(1, 6)
    spec.set_tree(
        TreeBatch(
            tokens=torch.zeros(1, 6, dtype=torch.int64),
            parents=torch.tensor([[-1, 0, 0, 2, 3, 4]]),
            depth=torch.tensor([[0, 1, 1, 2, 3, 4]]),
            ancestor_mask=torch.tensor([[1, 3, 5, 13, 29, 61]]),
            candidate=torch.zeros(1, 6, dtype=torch.int64),
        )
    )
    hidden = torch.arange(6, dtype=torch.float32).view(1, 6, 1).repeat(1, 1, 2)
    path = torch.tensor([[0, 2, 3, 4, 5, -1]])  # every row shifts down by one, onto its predecessor
    spec.compact_rows(hidden, path, torch.tensor([5]), torch.tensor([10]))
    assert hidden[0, :, 0].tolist() == [0, 2, 3, 4, 5, 5]
    assert spec.positions.tolist() == [[10, 11, 12, 13, 14, 15]]


def test_set_tree_from_draft_tree_then_load_step():
    K, S, N, B = 3, 4, 20, 3
    g = torch.Generator().manual_seed(0)
    tree = DraftTree(K, S, N)
    lanes = tree.begin(-torch.rand(B, K, generator=g), torch.randint(0, 50, (B, K), generator=g))
    for _ in range(S - 1):
        child_tokens = torch.randint(0, 50, (B, K, K), generator=g)
        lanes = tree.expand(lanes, -torch.rand(B, K, K, generator=g), child_tokens)
    batch = tree.select(torch.tensor([1, 2, 3]))
    spec = TreeSpec(B, N)
    ptrs = _ptrs(spec)
    spec.set_tree(batch)
    assert _ptrs(spec) == ptrs
    for name in ("parents", "depth", "ancestor_mask"):
        assert torch.equal(getattr(spec, name), getattr(batch, name))
    vc = torch.tensor([5, 0, 99])
    assert torch.equal(spec.load_step(vc), vc[:, None] + batch.depth)


def test_reset_chain_rows():
    B, N = 4, 9
    rng = random.Random(3)
    spec = TreeSpec(B, N)
    fresh = TreeSpec(B, N)
    ptrs = _ptrs(spec)
    tree = random_batch(rng, B, N)
    names = ("parents", "depth", "ancestor_mask")

    def expect(rows_reset):
        for name in names:
            for b in range(B):
                want = getattr(fresh, name)[b] if b in rows_reset else getattr(tree, name)[b]
                assert torch.equal(getattr(spec, name)[b], want), (name, b)

    spec.set_tree(tree)
    spec.reset_chain(torch.tensor([False, True, False, True]))
    expect({1, 3})
    spec.set_tree(tree)
    spec.reset_chain(torch.tensor([2, 0]))
    expect({0, 2})
    spec.set_tree(tree)
    spec.reset_chain()
    expect(set(range(B)))
    assert _ptrs(spec) == ptrs
    assert torch.equal(spec.ancestor_mask[0], chain_ancestor_mask(N))


@pytest.mark.parametrize(
    "batch_size, num_nodes, match",
    [
        (0, 8, "batch_size: must be >= 1"),
        (2, 0, "num_nodes: the tree must have 1..64"),
        (2, 65, "num_nodes: the tree must have 1..64"),
        (2.0, 8, "batch_size: expected a Python int"),
        (2, True, "num_nodes: expected a Python int"),
    ],
)
def test_bad_config_raises(batch_size, num_nodes, match):
    with pytest.raises(ValueError, match=match):
        TreeSpec(batch_size, num_nodes)


def test_bad_arguments_raise():
    B, N = 2, 5
    spec = TreeSpec(B, N)
    vc = torch.tensor([3, 4])
    hidden = torch.zeros(B, N, 3)
    path = torch.zeros(B, N, dtype=torch.int64)
    alen = torch.ones(B, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"vc: expected \[B=2\]"):
        spec.load_step(vc[:1])
    with pytest.raises(ValueError, match="vc: expected dtype torch.int64"):
        spec.load_step(vc.int())
    with pytest.raises(ValueError, match=r"hidden: expected \[B=2, N=5, H\]"):
        spec.compact_rows(hidden[:, :4], path, alen, vc)
    with pytest.raises(ValueError, match="hidden: expected a 3-d tensor"):
        spec.compact_rows(hidden[0], path, alen, vc)
    with pytest.raises(ValueError, match=r"accepted_path: expected \[B=2, N=5\]"):
        spec.compact_rows(hidden, path[:, :4], alen, vc)
    with pytest.raises(ValueError, match="accept_len: expected dtype torch.int64"):
        spec.compact_rows(hidden, path, alen.int(), vc)
    bad = random_batch(random.Random(0), B, N + 1)
    with pytest.raises(ValueError, match=r"tree.parents: expected \[B=2, N=5\]"):
        spec.set_tree(bad)
    with pytest.raises(ValueError, match="rows: expected a bool mask or int64 indices"):
        spec.reset_chain(torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"rows: expected a \[B=2\] bool mask"):
        spec.reset_chain(torch.tensor([True, False, True]))


def test_round_compiles_fullgraph():
    """load_step and compact_rows trace into one graph (in-place writes, no host syncs)."""
    B, N, H = 3, 17, 4
    rng = random.Random(5)
    spec = TreeSpec(B, N)
    spec.set_tree(random_batch(rng, B, N))

    def step(hidden, path, accept_len, vc):
        positions = spec.load_step(vc).clone()
        spec.compact_rows(hidden, path, accept_len, vc)
        return positions

    path = torch.full((B, N), -1, dtype=torch.int64)
    alen = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        nodes = random_path(rng, spec.parents[b].tolist())
        path[b, : len(nodes)] = torch.tensor(nodes)
        alen[b] = len(nodes)
    vc = torch.tensor([4, 8, 15])
    hidden = torch.randn(B, N, H)
    want_hidden = hidden.clone()
    want_positions = step(want_hidden, path, alen, vc)
    torch._dynamo.reset()
    got_positions = torch.compile(step, backend="eager", fullgraph=True)(hidden, path, alen, vc)
    assert torch.equal(got_positions, want_positions)
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(spec.positions, vc[:, None] + torch.arange(N))


@pytest.mark.gpu
def test_cuda_without_syncs():
    B, N, H = 4, 64, 8
    rng = random.Random(7)
    tree = random_batch(rng, B, N)
    spec = TreeSpec(B, N, device="cuda")
    path = torch.full((B, N), -1, dtype=torch.int64)
    alen = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        nodes = random_path(rng, tree.parents[b].tolist())
        path[b, : len(nodes)] = torch.tensor(nodes)
        alen[b] = len(nodes)
    hidden = torch.randn(B, N, H)
    want = hidden.clone()
    for b in range(B):
        want[b, : alen[b]] = hidden[b, path[b, : alen[b]]]
    fields = (tree.tokens, tree.parents, tree.depth, tree.ancestor_mask, tree.candidate)
    cuda_tree = TreeBatch(*(t.cuda() for t in fields))
    vc = torch.tensor([1, 2, 3, 4], device="cuda")
    hidden, path, alen = hidden.cuda(), path.cuda(), alen.cuda()
    rows = torch.tensor([True, False, True, False], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        spec.set_tree(cuda_tree)
        positions = spec.load_step(vc).clone()
        spec.compact_rows(hidden, path, alen, vc)
        spec.reset_chain(rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(positions.cpu(), vc.cpu()[:, None] + tree.depth)
    assert torch.equal(hidden.cpu(), want)
