"""treespec::build_ancestor_mask: Triton kernel and reference against a per-tree Python oracle."""

import pytest
import torch
from conftest import poisoned

from treecompile.ops import tree_mask
from treecompile.ops.tree_mask import (
    _launch_build_ancestor_mask,
    build_ancestor_mask_reference,
    validate_parents,
)

ODD_SIZES = (1, 2, 3, 8, 33, 63, 64)


def random_parents(batch: int, num_nodes: int, seed: int) -> torch.Tensor:
    """[batch, num_nodes] parents of random trees in topological order, mixing three shapes per row:
    uniform (parent anywhere before), deep (mostly the previous node) and bushy (parent among the first
    three nodes)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    style = torch.randint(0, 3, (batch,), generator=gen)
    for i in range(1, num_nodes):
        uniform = torch.randint(0, i, (batch,), generator=gen)
        deep = torch.where(torch.rand(batch, generator=gen) < 0.7, i - 1, uniform)
        bushy = uniform % min(i, 3)
        parents[:, i] = torch.where(style == 0, uniform, torch.where(style == 1, deep, bushy))
    return parents


def to_int64(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def oracle_mask(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Follow each node's parents to the root, one tree and one node at a time."""
    masks, depths = [], []
    for row in parents.tolist():
        mask_row, depth_row = [], []
        for i in range(len(row)):
            word, depth, j = 0, -1, i
            while j != -1:
                word |= 1 << j
                depth += 1
                j = row[j]
            mask_row.append(to_int64(word))
            depth_row.append(depth)
        masks.append(mask_row)
        depths.append(depth_row)
    return torch.tensor(masks, dtype=torch.int64), torch.tensor(depths, dtype=torch.int64)


def run_launcher(parents: torch.Tensor, block_b=None):
    mask = poisoned(parents.shape, torch.int64, parents.device)
    depth = poisoned(parents.shape, torch.int64, parents.device)
    _launch_build_ancestor_mask(parents, mask, depth, block_b=block_b)
    return mask.cpu(), depth.cpu()


@pytest.mark.parametrize("num_nodes", ODD_SIZES, ids=lambda n: f"N{n}")
def test_kernel_matches_oracle(num_nodes, kernel_device):
    parents = random_parents(160, num_nodes, seed=num_nodes)  # 7 sizes x 160 = 1120 trees
    mask, depth = run_launcher(parents.to(kernel_device))
    want_mask, want_depth = oracle_mask(parents)
    torch.testing.assert_close(mask, want_mask, rtol=0, atol=0)
    torch.testing.assert_close(depth, want_depth, rtol=0, atol=0)


@pytest.mark.parametrize(
    "batch,block_b", [(5, 1), (7, 4), (33, 16)], ids=lambda v: str(v)
)
def test_kernel_partial_programs(batch, block_b, kernel_device):
    """One request per program (the GPU default) and a last program with unused request slots."""
    parents = random_parents(batch, 33, seed=batch)
    mask, depth = run_launcher(parents.to(kernel_device), block_b=block_b)
    want_mask, want_depth = oracle_mask(parents)
    assert torch.equal(mask, want_mask)
    assert torch.equal(depth, want_depth)


def test_kernel_strided_inputs_and_outputs(kernel_device):
    wide = random_parents(9, 40, seed=3).to(kernel_device)
    parents = wide[::2, :33]  # row stride 80, not contiguous
    mask = poisoned((33, 5), torch.int64, kernel_device).t()  # column-major output
    depth = poisoned((5, 66), torch.int64, kernel_device)[:, ::2]
    _launch_build_ancestor_mask(parents, mask, depth)
    want_mask, want_depth = oracle_mask(parents.cpu())
    assert torch.equal(mask.cpu(), want_mask)
    assert torch.equal(depth.cpu(), want_depth)


@pytest.mark.parametrize("num_nodes", ODD_SIZES, ids=lambda n: f"N{n}")
def test_reference_matches_oracle(num_nodes):
    parents = random_parents(300, num_nodes, seed=100 + num_nodes)
    mask, depth = build_ancestor_mask_reference(parents)
    want_mask, want_depth = oracle_mask(parents)
    assert torch.equal(mask, want_mask)
    assert torch.equal(depth, want_depth)


@pytest.mark.parametrize("num_nodes", (1, 2, 63, 64), ids=lambda n: f"N{n}")
def test_chain(num_nodes, kernel_device):
    parents = (torch.arange(num_nodes) - 1).expand(3, num_nodes).contiguous()
    words = [to_int64((1 << (i + 1)) - 1) for i in range(num_nodes)]
    want_mask = torch.tensor(words).expand(3, num_nodes)
    want_depth = torch.arange(num_nodes).expand(3, num_nodes)
    for mask, depth in (run_launcher(parents.to(kernel_device)), build_ancestor_mask_reference(parents)):
        assert torch.equal(mask, want_mask)
        assert torch.equal(depth, want_depth)
    if num_nodes == 64:
        assert want_mask[0, 63] == -1  # every bit, the sign bit included


def test_star_sets_sign_bit(kernel_device):
    parents = torch.zeros(2, 64, dtype=torch.int64)
    parents[:, 0] = -1
    mask, depth = run_launcher(parents.to(kernel_device))
    assert mask[0, 0] == 1
    assert mask[0, 63] == to_int64((1 << 63) | 1)
    assert mask[1, 5] == (1 << 5) | 1
    assert torch.equal(depth[:, 1:], torch.ones(2, 63, dtype=torch.int64))


def test_op_dispatch_cpu_matches_reference():
    parents = random_parents(50, 33, seed=7)
    mask, depth = torch.ops.treespec.build_ancestor_mask(parents)
    want_mask, want_depth = build_ancestor_mask_reference(parents)
    assert torch.equal(mask, want_mask) and torch.equal(depth, want_depth)


def test_opcheck():
    torch.library.opcheck(torch.ops.treespec.build_ancestor_mask.default, (random_parents(3, 9, seed=1),))


@pytest.mark.parametrize(
    "parents,match",
    [
        (torch.zeros(2, 65, dtype=torch.int64), "1..64"),
        (torch.zeros(2, 0, dtype=torch.int64), "1..64"),
        (torch.zeros(2, 4, dtype=torch.int32), "int64"),
        (torch.zeros(4, dtype=torch.int64), "2-d"),
    ],
    ids=["N65", "N0", "int32", "1d"],
)
def test_op_rejects_bad_metadata(parents, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.build_ancestor_mask(parents)
    with pytest.raises(ValueError, match=match):
        validate_parents(parents)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([[0, 0, 1]], "root"),
        ([[-1, 0, 1], [-1, 1, 1]], r"parents\[1, 1\] = 1"),  # self loop: parents[i] >= i
        ([[-1, 2, 1]], r"parents\[0, 1\] = 2"),  # cycle 1 <-> 2
        ([[-1, 0, -1]], r"parents\[0, 2\] = -1"),  # second root
        ([[-1, 0, -3]], r"parents\[0, 2\] = -3"),
    ],
    ids=["root-not-minus-1", "self-loop", "cycle", "second-root", "below-minus-1"],
)
def test_validate_parents_rejects_non_trees(rows, match):
    with pytest.raises(ValueError, match=match):
        validate_parents(torch.tensor(rows, dtype=torch.int64), name="parents")


def test_validate_parents_accepts_trees():
    validate_parents(random_parents(64, 64, seed=11))
    validate_parents(torch.full((4, 1), -1, dtype=torch.int64))


def test_requests_per_program_is_power_of_two():
    for batch in (1, 3, 1000, 5000):
        block = tree_mask.requests_per_program(batch)
        assert block >= 1 and block & (block - 1) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("num_nodes", ODD_SIZES, ids=lambda n: f"N{n}")
def test_gpu_op_matches_reference(num_nodes):
    parents = random_parents(1000, num_nodes, seed=200 + num_nodes)
    mask, depth = torch.ops.treespec.build_ancestor_mask(parents.cuda())
    want_mask, want_depth = build_ancestor_mask_reference(parents)
    assert torch.equal(mask.cpu(), want_mask)
    assert torch.equal(depth.cpu(), want_depth)


@pytest.mark.gpu
def test_gpu_opcheck():
    parents = random_parents(3, 9, seed=1).cuda()
    torch.library.opcheck(torch.ops.treespec.build_ancestor_mask.default, (parents,))
