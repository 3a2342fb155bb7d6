"""treespec::page_slots: the reference against a per-element Python oracle, the Triton kernel (interpreter on
CPU, CUDA when present) against it with NaN-free poisoned outputs, the cache's slots() through the op, bad
input, opcheck and a CUDA-graph replay."""

import pytest
import torch

from treecompile.kv_cache import PagedKVCache
from treecompile.ops.page_slots import _launch_page_slots, page_slots_reference

from conftest import poisoned


def oracle(table, positions, page_size, dummy):
    B, T = positions.shape
    capacity = table.shape[1] * page_size
    out = torch.empty(B, T, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            p = int(positions[b, t])
            out[b, t] = int(table[b, p // page_size]) * page_size + p % page_size if 0 <= p < capacity else dummy
    return out


def make(B, T, pages, page_size, seed, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 1000, (B, pages), generator=g).to(dtype)
    capacity = pages * page_size
    positions = torch.randint(-3, capacity + 5, (B, T), generator=g)  # out of range at both ends
    positions[0, 0], positions[-1, -1] = capacity - 1, capacity  # the last slot, one past it
    return table, positions


@pytest.mark.parametrize("B,T,pages,page_size", [(1, 1, 1, 1), (3, 7, 4, 8), (2, 300, 3, 64), (5, 64, 9, 16)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_reference_matches_oracle(B, T, pages, page_size, dtype):
    table, positions = make(B, T, pages, page_size, seed=B * T, dtype=dtype)
    assert torch.equal(page_slots_reference(table, positions, page_size, 3), oracle(table, positions, page_size, 3))


@pytest.mark.parametrize("B,T,pages,page_size", [(1, 1, 1, 1), (3, 7, 4, 8), (2, 300, 3, 64)])
def test_kernel_matches_oracle_with_strided_inputs(B, T, pages, page_size, kernel_device):
    table, positions = make(B, T, pages, page_size, seed=7 + T)
    wide_table = torch.full((B, pages + 3), 77, dtype=table.dtype)  # pages past the view: must not be read
    wide_table[:, 1 : pages + 1] = table
    strided_pos = torch.zeros(T, B, dtype=torch.int64).t()  # [B, T] with strides (1, B)
    strided_pos.copy_(positions)
    out = poisoned((B, T), torch.int64, kernel_device)
    _launch_page_slots(wide_table[:, 1 : pages + 1].to(kernel_device), strided_pos.to(kernel_device), page_size, 5, out)
    assert torch.equal(out.cpu(), oracle(table, positions, page_size, 5))


def test_cache_slots_go_through_the_op():
    cache = PagedKVCache(1, 1, 4, max_batch=2, max_seq_len=20, page_size=8, dtype=torch.float32)
    positions = torch.tensor([[0, 7, 8, 23, 24, -1], [1, 9, 16, 30, 100, 5]])
    want = oracle(cache.page_table, positions, 8, cache.dummy_slot)
    assert torch.equal(cache.slots(positions), want)
    assert torch.equal(cache.slots(positions[:1], rows=torch.tensor([1])), oracle(cache.page_table[1:], positions[:1], 8, 0))


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int64), 4, 0), "page_table: expected a 2-d"),
        ((torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 4, 0), "positions: expected dtype"),
        ((torch.zeros(2, 3, dtype=torch.float32), torch.zeros(2, 1, dtype=torch.int64), 4, 0), "page_table: expected dtype"),
        ((torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int64), 4, 0), "positions: batch size 3"),
        ((torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int64), 0, 0), "page_size: expected a positive"),
        ((torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int64), 4, -1), "dummy_slot: expected"),
    ],
)
def test_bad_input_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.page_slots(*args)


def test_opcheck():
    table, positions = make(3, 5, 4, 8, seed=1)
    torch.library.opcheck(torch.ops.treespec.page_slots.default, (table, positions, 8, 0))


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_positions():
    table, positions = make(4, 33, 6, 16, seed=2)
    table, positions = table.cuda(), positions.cuda()
    out = torch.ops.treespec.page_slots(table, positions, 16, 0)  # warm-up (JIT)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.treespec.page_slots(table, positions, 16, 0)
    for seed in (3, 4):
        _, new = make(4, 33, 6, 16, seed=seed)
        positions.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), oracle(table.cpu(), new, 16, 0))
