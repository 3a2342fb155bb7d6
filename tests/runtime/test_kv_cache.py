"""PagedKVCache: layout, slot mapping (dummy slot for anything out of range), reset, write + attention."""

import pytest
import torch

from treecompile.kv_cache import PagedKVCache
from treecompile.ops.tree_attention import tree_attention_reference


def test_layout_and_static_page_table():
    c = PagedKVCache(num_layers=2, num_kv_heads=3, head_dim=8, max_batch=2, max_seq_len=10, page_size=4,
                     dtype=torch.float32)
    assert c.pages_per_request == 3 and c.capacity == 12
    assert c.num_slots == (1 + 2 * 3) * 4
    assert len(c.k) == 2 and c.k[1].shape == (c.num_slots, 3, 8) and c.v[0].dtype == torch.float32
    assert c.page_table.tolist() == [[1, 2, 3], [4, 5, 6]]  # page 0 is the dummy page
    assert c.lengths.tolist() == [0, 0]
    assert {name for name, _ in c.named_buffers()} >= {"k0", "v1", "page_table", "lengths"}


def test_slots_map_positions_and_send_out_of_range_to_dummy():
    c = PagedKVCache(1, 1, 8, max_batch=3, max_seq_len=8, page_size=4, dtype=torch.float32)
    pos = torch.tensor([[0, 3, 4, 7, -1, 8], [0, 5, 100, -7, 2, 1]])
    got = c.slots(pos)
    assert got.tolist() == [[4, 7, 8, 11, 0, 0], [12, 17, 0, 0, 14, 13]]
    assert c.slots(pos[:1], rows=torch.tensor([2])).tolist() == [[20, 23, 24, 27, 0, 0]]
    with pytest.raises(ValueError, match="positions: expected int64"):
        c.slots(pos.int())
    with pytest.raises(ValueError, match="exceeds max_batch"):
        c.slots(torch.zeros(4, 1, dtype=torch.int64))


def test_reset_clears_lengths_only_of_given_rows():
    c = PagedKVCache(1, 1, 8, max_batch=3, max_seq_len=8, page_size=4, dtype=torch.float32)
    c.lengths.copy_(torch.tensor([5, 6, 7]))
    c.reset([1])
    assert c.lengths.tolist() == [5, 0, 7]
    c.reset()
    assert c.lengths.tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_write_then_attention_matches_contiguous(dtype):
    """Write a prefix and a tree window through slots(); attention over the cache equals the dense form,
    and stale (NaN) contents of slots past the window never leak."""
    gen = torch.Generator().manual_seed(0)
    B, N, Hq, Hkv, D, page_size = 2, 5, 4, 2, 16, 4
    prefix = [6, 9]
    c = PagedKVCache(1, Hkv, D, max_batch=B, max_seq_len=20, page_size=page_size, dtype=dtype)
    c.k0.fill_(float("nan"))
    c.v0.fill_(float("nan"))
    L = c.capacity
    k = torch.randn(B, L, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, L, Hkv, D, generator=gen).to(dtype)
    q = torch.randn(B, N, Hq, D, generator=gen).to(dtype)
    T = max(prefix) + N
    pos = torch.arange(T).repeat(B, 1)
    pos[0, prefix[0] + N :] = -1  # padding -> dummy slot
    c.write(0, k[:, :T], v[:, :T], c.slots(pos))
    c.lengths[:B] = torch.tensor(prefix)
    mask = torch.tensor([[1, 3, 5, 9, 17], [1, 2, 4, 9, 16]], dtype=torch.int64)
    got = c.attention(0, q, mask, window=N, scale=D**-0.5)
    want = tree_attention_reference(q.double(), k.double(), v.double(), mask, c.lengths[:B])
    tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 3e-2)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_bad_construction():
    with pytest.raises(ValueError, match="page_size: must be a positive int"):
        PagedKVCache(1, 1, 8, 1, 8, page_size=0)
    with pytest.raises(ValueError, match="dtype: storage dtype"):
        PagedKVCache(1, 1, 8, 1, 8, dtype=torch.int8)
