"""Tree attention: the Triton cascade (interpreter on CPU) and the ops against float64 oracles.

The oracle chain: a per-row loop over explicit key lists (``naive_tree_attention``) checks the vectorised
reference, and the reference (float64) checks the kernels. Caches are poisoned (NaN keys, inf values) in
every slot no row may see: the dummy page, unwritten pages and keys past the window.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from treecompile.ops.tree_attention import (
    _launch_tree_attention_paged,
    tree_attention,
    tree_attention_paged_reference,
    tree_attention_reference,
)


def random_tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor masks (self bit included) of a random tree with nodes in topological order: ``int64 [n]``."""
    masks = []
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        own = 1 << i
        masks.append(own | (masks[parent] if parent >= 0 else 0))
    return torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in masks], dtype=torch.int64)


def chain_mask(n: int) -> torch.Tensor:
    return torch.tensor([((1 << (i + 1)) - 1) - ((1 << 64) if i == 63 else 0) for i in range(n)], dtype=torch.int64)


def make_paged(B, R, Hq, Hkv, D, page_size, max_pages, prefix, window, dtype, gen, device="cpu"):
    """A shuffled page table over a cache whose unseen slots hold NaN keys and inf values."""
    num_pages = 1 + B * max_pages + 2  # dummy page, pages in use, two never-mapped pages
    num_slots = num_pages * page_size
    k_cache = torch.full((num_slots, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((num_slots, Hkv, D), float("inf"), dtype=dtype)
    page_table = (1 + torch.randperm(B * max_pages, generator=gen)).view(B, max_pages).to(torch.int32)
    q = torch.randn(B, R, Hq, D, generator=gen).to(dtype)
    for b in range(B):
        for t in range(prefix[b] + window):
            slot = int(page_table[b, t // page_size]) * page_size + t % page_size
            k_cache[slot] = torch.randn(Hkv, D, generator=gen).to(dtype)
            v_cache[slot] = torch.randn(Hkv, D, generator=gen).to(dtype)
    prefix_len = torch.tensor(prefix, dtype=torch.int64)
    mask = torch.stack([random_tree_mask(R, gen) for _ in range(B)])
    dev = lambda t: t.to(device)  # noqa: E731
    return dev(q), dev(k_cache), dev(v_cache), dev(page_table), dev(prefix_len), mask


def naive_tree_attention(q, k, v, ancestor_mask, prefix_len, scale):
    """Per row: gather its visible keys explicitly, softmax, weighted sum (float64)."""
    B, N, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = torch.zeros(B, N, Hq, D, dtype=torch.float64)
    for b in range(B):
        P = int(prefix_len[b])
        for i in range(N):
            word = int(ancestor_mask[b, i]) & ((1 << 64) - 1)
            keys = list(range(P)) + [P + j for j in range(N) if word >> j & 1]
            if not keys:
                continue
            for h in range(Hq):
                kk = k[b, keys, h // G].double()
                s = kk @ q[b, i, h].double() * scale
                out[b, i, h] = torch.softmax(s, 0) @ v[b, keys, h // G].double()
    return out


def test_reference_matches_naive_loop():
    gen = torch.Generator().manual_seed(0)
    B, N, Hq, Hkv, D, L = 2, 7, 4, 2, 16, 20
    q = torch.randn(B, N, Hq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, L, Hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, L, Hkv, D, generator=gen, dtype=torch.float64)
    prefix_len = torch.tensor([0, 9])
    mask = torch.stack([random_tree_mask(N, gen), random_tree_mask(N, gen)])
    mask[0, 3] = 0  # prefix 0 and no window key: sees nothing -> zeros
    k[0, N:] = float("nan")  # past request 0's window
    v[0, N:] = float("nan")
    got = tree_attention_reference(q, k, v, mask, prefix_len)
    want = naive_tree_attention(q, k, v, mask, prefix_len, D**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got[0, 3].abs().max() == 0


CASES = [  # (B, N, Hq, Hkv, page_size, prefix per request) -- odd remainders, page edges, prefix 0 and 1
    (1, 1, 4, 1, 16, [0]),
    (2, 2, 4, 4, 16, [1, 16]),
    (2, 7, 8, 2, 16, [0, 37]),
    (1, 16, 4, 1, 32, [95]),
    (2, 16, 8, 1, 16, [129, 3]),
    (1, 33, 2, 2, 64, [64]),
    (1, 64, 8, 8, 16, [17]),
    (1, 64, 4, 1, 64, [0]),
]


@pytest.mark.parametrize(
    "B,N,Hq,Hkv,page_size,prefix", CASES, ids=[f"B{c[0]}-N{c[1]}-Hq{c[2]}-Hkv{c[3]}-pg{c[4]}-P{c[5]}" for c in CASES]
)
def test_kernel_matches_reference_random_trees(B, N, Hq, Hkv, page_size, prefix, kernel_device):
    gen = torch.Generator().manual_seed(N * 131 + Hq)
    D = 64
    max_pages = -(-(max(prefix) + N) // page_size) + 1
    q, kc, vc, pt, pl, _ = make_paged(B, N, Hq, Hkv, D, page_size, max_pages, prefix, N, torch.float32, gen)
    mask = torch.stack([random_tree_mask(N, gen) for _ in range(B)])
    want = tree_attention_paged_reference(q.double(), kc.double(), vc.double(), pt, pl, mask, page_size, N, D**-0.5)
    dev = kernel_device
    got = _launch_tree_attention_paged(
        q.to(dev), kc.to(dev), vc.to(dev), pt.to(dev), pl.to(dev), mask.to(dev), page_size, N, D**-0.5
    )
    assert got.dtype == torch.float32 and got.shape == (B, N, Hq, D)
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("page_size", [16, 8], ids=lambda p: f"pg{p}")
def test_kernel_follows_strided_metadata(page_size, kernel_device):
    """page_table, prefix_len and ancestor_mask may be views of wider state tables (a column, every other
    page): the kernel follows their strides. It once read them as contiguous, which gave wrong outputs with
    no error (the fused write's slots had the same bug in a GPU decode). page_size 8 < BLOCK_N: the prefix
    tiles then read several page-table entries each."""
    gen = torch.Generator().manual_seed(11)
    B, N, Hq, Hkv, D = 3, 4, 4, 2, 64
    q, kc, vc, pt, pl, mask = make_paged(B, N, Hq, Hkv, D, page_size, 6, [5, 20, 33], N, torch.float32, gen)
    want = tree_attention_paged_reference(q.double(), kc.double(), vc.double(), pt, pl, mask, page_size, N, 0.125)
    d = kernel_device
    pl_table = torch.full((B, 3), -7, dtype=torch.int64)
    pl_table[:, 1] = pl
    pt_wide = torch.full((B, 2 * pt.shape[1]), -3, dtype=pt.dtype)
    pt_wide[:, ::2] = pt
    mask_wide = torch.zeros(B, 2 * N, dtype=torch.int64)
    mask_wide[:, ::2] = mask
    got = _launch_tree_attention_paged(
        q.to(d), kc.to(d), vc.to(d), pt_wide.to(d)[:, ::2], pl_table.to(d)[:, 1], mask_wide.to(d)[:, ::2],
        page_size, N, 0.125,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("num_splits", [1, 3, 8], ids=lambda s: f"splits{s}")
def test_kernel_split_counts_agree(num_splits, kernel_device):
    """The split count is a static choice: any count gives the same result (several pages, odd remainder)."""
    gen = torch.Generator().manual_seed(7)
    B, N, Hq, Hkv, D, page_size, prefix = 1, 5, 4, 2, 64, 16, [300]
    q, kc, vc, pt, pl, _ = make_paged(B, N, Hq, Hkv, D, page_size, 20, prefix, N, torch.float32, gen)
    mask = random_tree_mask(N, gen)[None]
    want = tree_attention_paged_reference(q.double(), kc.double(), vc.double(), pt, pl, mask, page_size, N, 0.1)
    d = kernel_device
    got = _launch_tree_attention_paged(
        q.to(d), kc.to(d), vc.to(d), pt.to(d), pl.to(d), mask.to(d), page_size, N, 0.1, num_splits=num_splits
    )
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-4, atol=2e-4)


VARIANTS = [  # CascadeConfig fields a tuning run may set: TMA tiles (the default) or not, rows and warps a merge
    dict(tma=True),
    dict(tma=False, merge_warps=4),
    dict(merge_rows=2),
    dict(merge_rows=8, merge_warps=2),
    dict(tma=True, merge_rows=4, num_splits=3),
    dict(l2_prefetch=4),  # L2 hints before the dependency wait: GPU only (the interpreter has no inline PTX)
    dict(tma=False, l2_prefetch=2, num_splits=3),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("N,prefix", [(7, [0, 37]), (16, [129, 3])], ids=lambda x: str(x))
def test_kernel_config_variants_match_reference(variant, N, prefix, kernel_device):
    """Every tuning variant computes the same attention: full prefix tiles through TMA descriptors (the
    interpreter emulates them on CPU; tiles of 16 keys so pages of 16 hold whole tiles, with an odd tail tile
    on the pointer path) and merge programs of several rows, B * N * Hq not a multiple of the row count (the
    last program's extra rows must not be written). Poisoned caches: NaN / inf outside what rows see."""
    from treecompile.ops import _tree_attention_kernels as kern

    gen = torch.Generator().manual_seed(N + 5)
    B, Hq, Hkv, D, page_size = 2, 6, 2, 64, 16
    max_pages = -(-(max(prefix) + N) // page_size) + 1
    q, kc, vc, pt, pl, _ = make_paged(B, N, Hq, Hkv, D, page_size, max_pages, prefix, N, torch.float32, gen)
    mask = torch.stack([random_tree_mask(N, gen) for _ in range(B)])
    want = tree_attention_paged_reference(q.double(), kc.double(), vc.double(), pt, pl, mask, page_size, N, 0.1)
    d = kernel_device
    q, kc, vc, pt, pl, mask = (t.to(d) for t in (q, kc, vc, pt, pl, mask))
    variant = dict(variant)
    splits = variant.pop("num_splits", None)
    cfg = kern.choose_config(B, N, Hq, Hkv, D, max_pages * page_size, q.device, splits, itemsize=4, block_n=16,
                             num_stages=2, **variant)  # fmt: skip
    if cfg.tma:  # the TMA path really runs: in the interpreter, or on a Hopper GPU
        hopper = d == "cpu" or torch.cuda.get_device_capability()[0] >= 9
        assert kern._tma_layout_ok(kc, vc, page_size, cfg.block_n) == hopper
    got = kern.launch_cascade(q, kc, vc, pt, pl, mask, page_size, N, 0.1, config=cfg)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-4, atol=2e-4)


def test_tma_needs_whole_tiles_in_a_page_and_a_box_layout():
    """TMA tiles are taken only where a tile is one box of a ``[num_slots, Hkv * D]`` view: pages holding
    whole tiles, heads adjacent, D contiguous. Otherwise the pointer path runs (same results)."""
    from treecompile.ops import _tree_attention_kernels as kern

    if not kern.triton_interpret():
        pytest.skip("the CPU check runs under the interpreter")
    cache = torch.zeros(64, 2, 64)
    assert kern._tma_layout_ok(cache, cache, 16, 16)
    assert not kern._tma_layout_ok(cache, cache, 8, 16)  # a tile spans two pages
    both = torch.zeros(64, 4, 64)  # K and V halves of one cache: slot stride 4 * D
    assert kern._tma_layout_ok(both[:, :2], both[:, 2:], 16, 16)  # heads still adjacent within a slot
    strided_heads = torch.zeros(64, 2, 2, 64)[:, :, 0]  # head stride 128 != D
    assert not kern._tma_layout_ok(strided_heads, strided_heads, 16, 16)
    assert not kern._tma_layout_ok(cache.transpose(1, 2), cache.transpose(1, 2), 16, 16)


def test_merge_takes_eight_rows_a_program_only_where_rows_are_many_and_states_small(monkeypatch):
    """The merge's shape rule (H200-measured at the 8B verify): eight rows on eight warps where a row's states
    are <= 1024 values and the grid has >= 1024 rows; one warp a row where states are <= 4096 values; four
    warps above that. The decode's 32 rows keep one row a program."""
    from treecompile.ops import _tree_attention_kernels as kern

    monkeypatch.delenv(kern.CASCADE_ENV, raising=False)
    cpu = torch.device("cpu")

    def merge(B, R, splits, D=128):  # a capacity that holds every split asked for
        cfg = kern.choose_config(B, R, 32, 8, D, 1 << 16, cpu, num_splits=splits)
        return cfg.merge_rows, cfg.merge_warps

    assert merge(1, 64, 7) == (8, 8)  # 8B verify at 2k: 8 states x 128 = 1024 values, 2048 rows
    assert merge(1, 64, 8) == (1, 1)  # 16 x 128 = 2048 values: one warp a row (8x8 measured slower)
    assert merge(1, 64, 31) == (1, 1)  # 32 x 128 = 4096 values, still one warp
    assert merge(1, 64, 32) == (1, 4)  # 64 x 128 > 4096: four warps
    assert merge(1, 16, 7) == (1, 1)  # 512 rows: too few for eight a program
    assert merge(1, 1, 7) == (1, 1)  # decode
    assert merge(16, 4, 3) == (8, 8)


def test_cascade_env_overrides(monkeypatch):
    """TREECOMPILE_CASCADE sets config fields for A/B runs; anything else is refused by name."""
    from treecompile.ops import _tree_attention_kernels as kern

    monkeypatch.setenv(kern.CASCADE_ENV, "tma=1, merge_rows=4,merge_warps=2")
    cfg = kern.choose_config(1, 16, 8, 2, 64, 1024, torch.device("cpu"))
    assert (cfg.tma, cfg.merge_rows, cfg.merge_warps) == (True, 4, 2)
    assert kern.choose_config(1, 16, 8, 2, 64, 1024, torch.device("cpu"), merge_rows=2).merge_rows == 2
    for bad, word in (("tma", "FIELD=INT"), ("speed=3", "FIELD=INT"), ("pdl=1", "FIELD=INT"), ("merge_rows=x", "integer")):
        monkeypatch.setenv(kern.CASCADE_ENV, bad)
        with pytest.raises(ValueError, match=word):
            kern.choose_config(1, 16, 8, 2, 64, 1024, torch.device("cpu"))
    # l2_prefetch: 0 or a power of two <= 16, checked at launch (the interpreter then runs without the hints)
    monkeypatch.setenv(kern.CASCADE_ENV, "l2_prefetch=4")
    assert kern.choose_config(1, 16, 8, 2, 64, 1024, torch.device("cpu")).l2_prefetch == 4
    gen = torch.Generator().manual_seed(1)
    q, kc, vc, pt, pl, _ = make_paged(1, 3, 2, 1, 16, 16, 3, [20], 3, torch.float32, gen)
    mask = random_tree_mask(3, gen)[None]
    for bad in (3, 32, -1):
        monkeypatch.setenv(kern.CASCADE_ENV, f"l2_prefetch={bad}")
        with pytest.raises(ValueError, match="l2_prefetch must be 0 or a power of two up to 16"):
            kern.launch_cascade(q, kc, vc, pt, pl, mask, 16, 3, 0.1)


@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"D{d}")
def test_kernel_head_dims_fp16(D, kernel_device):
    gen = torch.Generator().manual_seed(D)
    B, N, Hq, Hkv, page_size, prefix = 1, 3, 2, 1, 16, [21]
    q, kc, vc, pt, pl, _ = make_paged(B, N, Hq, Hkv, D, page_size, 3, prefix, N, torch.float16, gen)
    mask = random_tree_mask(N, gen)[None]
    want = tree_attention_paged_reference(q.double(), kc.double(), vc.double(), pt, pl, mask, page_size, N, D**-0.5)
    d = kernel_device
    got = _launch_tree_attention_paged(
        q.to(d), kc.to(d), vc.to(d), pt.to(d), pl.to(d), mask.to(d), page_size, N, D**-0.5
    )
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu().double(), want, rtol=3e-3, atol=3e-3)


def dense_causal(q, k, v, prefix, scale):
    """SDPA with an explicit causal bool mask over the first prefix + N keys (float64), GQA expanded."""
    B, N, Hq, D = q.shape
    G = Hq // k.shape[2]
    L = prefix + N
    kk = k[:, :L].double().repeat_interleave(G, dim=2).transpose(1, 2)
    vv = v[:, :L].double().repeat_interleave(G, dim=2).transpose(1, 2)
    allowed = torch.arange(L)[None, :] < (prefix + 1 + torch.arange(N))[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(1, 2), kk, vv, attn_mask=allowed, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("N,prefix", [(1, 0), (7, 5), (64, 19)], ids=lambda x: str(x))
def test_chain_mask_is_causal_attention(N, prefix, kernel_device):
    """Metamorphic: the chain tree parent[i] = i - 1 is plain causal attention over prefix + window."""
    gen = torch.Generator().manual_seed(N)
    B, Hq, Hkv, D = 1, 4, 2, 64
    L = prefix + N + 3
    q = torch.randn(B, N, Hq, D, generator=gen)
    k = torch.randn(B, L, Hkv, D, generator=gen)
    v = torch.randn(B, L, Hkv, D, generator=gen)
    k[:, prefix + N :] = float("nan")
    v[:, prefix + N :] = float("nan")
    mask = chain_mask(N)[None]
    pl = torch.tensor([prefix])
    want = dense_causal(q, k, v, prefix, D**-0.5)
    torch.testing.assert_close(tree_attention_reference(q.double(), k.double(), v.double(), mask, pl), want)
    d = kernel_device
    pt = torch.zeros(1, 1, dtype=torch.int32, device=d)
    got = _launch_tree_attention_paged(
        q.to(d), k.to(d).reshape(L, Hkv, D), v.to(d).reshape(L, Hkv, D), pt, pl.to(d), mask.to(d), L, N, D**-0.5
    )
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-4, atol=2e-4)


def test_rows_that_see_only_themselves_and_empty_rows(kernel_device):
    """Window = own key only: with prefix 0 the output is exactly that key's value; a row with no bits and
    prefix 0 sees nothing and gets zeros (empty prefix and window states merge to zero)."""
    gen = torch.Generator().manual_seed(3)
    B, N, Hq, Hkv, D = 2, 9, 4, 2, 64
    L = 12
    q = torch.randn(B, N, Hq, D, generator=gen)
    k = torch.randn(B, L, Hkv, D, generator=gen)
    v = torch.randn(B, L, Hkv, D, generator=gen)
    k[1, 3 + N :] = float("nan")
    v[1, 3 + N :] = float("nan")
    mask = torch.tensor([1 << i for i in range(N)], dtype=torch.int64).repeat(B, 1)
    mask[0, 4] = 0
    pl = torch.tensor([0, 3])
    d = kernel_device
    pt = torch.arange(B, dtype=torch.int32, device=d)[:, None]
    got = _launch_tree_attention_paged(
        q.to(d), k.to(d).reshape(B * L, Hkv, D), v.to(d).reshape(B * L, Hkv, D), pt, pl.to(d), mask.to(d), L, N, 0.125
    ).cpu()
    want = tree_attention_reference(q.double(), k.double(), v.double(), mask, pl, scale=0.125)
    torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=2e-4)
    own = v[0, :N].repeat_interleave(Hq // Hkv, dim=1)  # prefix 0: the row's own value, every head
    keep = [i for i in range(N) if i != 4]
    torch.testing.assert_close(got[0, keep], own[keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0, 4], torch.zeros(Hq, D))


def test_paged_equals_contiguous(kernel_device):
    """The same keys through a shuffled page table and through contiguous storage give the same output."""
    gen = torch.Generator().manual_seed(11)
    B, N, Hq, Hkv, D, page_size = 2, 16, 4, 1, 64, 16
    prefix = [45, 70]
    L = 96
    q = torch.randn(B, N, Hq, D, generator=gen)
    k = torch.randn(B, L, Hkv, D, generator=gen)
    v = torch.randn(B, L, Hkv, D, generator=gen)
    mask = torch.stack([random_tree_mask(N, gen) for _ in range(B)])
    pl = torch.tensor(prefix)
    max_pages = L // page_size
    pt = (1 + torch.randperm(B * max_pages, generator=gen)).view(B, max_pages).to(torch.int32)
    kc = torch.full(((1 + B * max_pages) * page_size, Hkv, D), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    for b in range(B):
        for t in range(L):
            slot = int(pt[b, t // page_size]) * page_size + t % page_size
            kc[slot], vc[slot] = k[b, t], v[b, t]
    d = kernel_device
    paged = _launch_tree_attention_paged(
        q.to(d), kc.to(d), vc.to(d), pt.to(d), pl.to(d), mask.to(d), page_size, N, 0.1
    ).cpu()
    contiguous = _launch_tree_attention_paged(
        q.to(d), k.to(d).reshape(B * L, Hkv, D), v.to(d).reshape(B * L, Hkv, D),
        torch.arange(B, dtype=torch.int32, device=d)[:, None], pl.to(d), mask.to(d), L, N, 0.1,
    ).cpu()  # fmt: skip
    torch.testing.assert_close(paged, contiguous, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree_attention(q, k, v, mask, pl, scale=0.1), contiguous, rtol=1e-5, atol=1e-5)


def test_functional_form_float64_cpu():
    """The public functional on CPU is the float64-capable reference: default scale D ** -0.5."""
    gen = torch.Generator().manual_seed(5)
    B, N, Hq, Hkv, D, L = 1, 4, 2, 1, 8, 9
    q = torch.randn(B, N, Hq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, L, Hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, L, Hkv, D, generator=gen, dtype=torch.float64)
    mask = random_tree_mask(N, gen)[None]
    pl = torch.tensor([5])
    got = tree_attention(q, k, v, mask, pl)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, naive_tree_attention(q, k, v, mask, pl, D**-0.5), rtol=1e-12, atol=1e-12)


def test_opcheck_tree_attention_paged():
    gen = torch.Generator().manual_seed(1)
    B, N, Hq, Hkv, D, page_size = 2, 3, 4, 2, 16, 4
    q, kc, vc, pt, pl, mask = make_paged(B, N, Hq, Hkv, D, page_size, 3, [2, 5], N, torch.float32, gen)
    kc = torch.nan_to_num(kc, nan=0.0, posinf=0.0)  # opcheck compares outputs; keep them finite
    vc = torch.nan_to_num(vc, nan=0.0, posinf=0.0)
    torch.library.opcheck(
        torch.ops.treespec.tree_attention_paged.default, (q, kc, vc, pt, pl, mask, page_size, N, 0.25)
    )


# ------------------------------------------------------------------------------------------------------
# Bad input: ValueError at the boundary
# ------------------------------------------------------------------------------------------------------


def _small(N=4, L=10, D=16, Hq=2, Hkv=1, dtype=torch.float32):
    q = torch.randn(1, N, Hq, D, dtype=dtype)
    k = torch.randn(1, L, Hkv, D, dtype=dtype)
    return q, k, k.clone(), chain_mask(min(N, 64))[None].expand(1, N).clone() if N <= 64 else None


def test_bad_input_too_many_nodes():
    q, k, v, _ = _small(N=65, L=80)
    with pytest.raises(ValueError, match="1..64 nodes"):
        tree_attention(q, k, v, torch.zeros(1, 65, dtype=torch.int64), torch.tensor([0]))


def test_bad_input_mask_bits_beyond_window():
    q, k, v, mask = _small(N=4)
    mask[0, 2] |= 1 << 5
    with pytest.raises(ValueError, match="ancestor_mask: bits at or above the window"):
        tree_attention(q, k, v, mask, torch.tensor([0]))


def test_bad_input_prefix_past_l_minus_n():
    q, k, v, mask = _small(N=4, L=10)
    with pytest.raises(ValueError, match="prefix_len: request 0 has prefix_len 7"):
        tree_attention(q, k, v, mask, torch.tensor([7]))


def test_bad_input_unsupported_head_dim_in_kernel():
    q, k, v, mask = _small(D=96)
    pt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head dim 96 is not supported"):
        _launch_tree_attention_paged(q, k[0], v[0], pt, torch.tensor([0]), mask, 10, 4, 0.1)


@pytest.mark.parametrize("which", ["q", "v"])
def test_bad_input_dtype_mismatch(which):
    q, k, v, mask = _small()
    if which == "q":
        q = q.half()
    else:
        v = v.double()
    with pytest.raises(ValueError, match="must equal|must match|shapes must match|dtype"):
        tree_attention(q, k, v, mask, torch.tensor([0]))


def test_bad_input_device_mismatch():
    q, k, v, mask = _small()
    with pytest.raises(ValueError, match="one device"):
        torch.ops.treespec.tree_attention_paged(
            q, k[0], v[0], torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0], device="meta"), mask, 10, 4, 0.1
        )


def test_bad_input_page_table_too_short():
    q, k, v, mask = _small(N=4, L=16)
    kc = k.reshape(16, 1, 16)
    pt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_table: 1 pages x page_size 2 = 2 keys is too short"):
        torch.ops.treespec.tree_attention_paged(q, kc, kc, pt, torch.tensor([0]), mask, 2, 4, 0.1)
    from treecompile.ops.tree_attention import validate_tree_attention_values

    with pytest.raises(ValueError, match="page table is too short"):
        validate_tree_attention_values(torch.tensor([3]), mask, window=4, capacity=6)


def test_bad_input_wrong_dtypes_of_metadata():
    q, k, v, mask = _small()
    with pytest.raises(ValueError, match="ancestor_mask: expected dtype torch.int64"):
        tree_attention(q, k, v, mask.int(), torch.tensor([0]))
    with pytest.raises(ValueError, match="prefix_len: expected dtype torch.int64"):
        tree_attention(q, k, v, mask, torch.tensor([0], dtype=torch.int32))


# ------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("N", [16, 64], ids=lambda n: f"N{n}")
def test_gpu_bf16_benchmark_shape(N):
    gen = torch.Generator().manual_seed(N)
    B, Hq, Hkv, D, page_size, prefix = 2, 32, 8, 128, 64, [3000, 1]
    q, kc, vc, pt, pl, _ = make_paged(B, N, Hq, Hkv, D, page_size, 50, prefix, N, torch.bfloat16, gen)
    mask = torch.stack([random_tree_mask(N, gen) for _ in range(B)])
    want = tree_attention_paged_reference(q.double(), kc.double(), vc.double(), pt, pl, mask, page_size, N, D**-0.5)
    got = torch.ops.treespec.tree_attention_paged(
        q.cuda(), kc.cuda(), vc.cuda(), pt.cuda(), pl.cuda(), mask.cuda(), page_size, N, D**-0.5
    )
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_masks_and_prefixes():
    """Capture once; write new masks and prefix lengths into the bound buffers; each replay matches."""
    gen = torch.Generator().manual_seed(2)
    B, N, Hq, Hkv, D, page_size, max_pages = 2, 16, 8, 2, 128, 16, 40
    q, kc, vc, pt, _, _ = make_paged(B, N, Hq, Hkv, D, page_size, max_pages, [600, 600], N, torch.float16, gen)
    q, kc, vc, pt = q.cuda(), kc.cuda(), vc.cuda(), pt.cuda()
    kc = torch.nan_to_num(kc, nan=0.5)  # every slot up to 616 is written; the rest must stay unread
    vc = torch.nan_to_num(vc, posinf=0.5)
    pl_buf = torch.zeros(B, dtype=torch.int64, device="cuda")
    mask_buf = chain_mask(N)[None].repeat(B, 1).cuda()
    op = torch.ops.treespec.tree_attention_paged
    args = (q, kc, vc, pt, pl_buf, mask_buf, page_size, N, D**-0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(*args)  # warm-up compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*args)
    for prefix in ([0, 1], [37, 600], [599, 256]):
        pl_buf.copy_(torch.tensor(prefix))
        mask_buf.copy_(torch.stack([random_tree_mask(N, gen) for _ in range(B)]))
        graph.replay()
        torch.cuda.synchronize()
        want = tree_attention_paged_reference(
            q.double(), kc.double(), vc.double(), pt, pl_buf, mask_buf, page_size, N, D**-0.5
        )
        torch.testing.assert_close(out.double(), want, rtol=3e-3, atol=3e-3, msg=f"prefix {prefix}")


@pytest.mark.gpu
@pytest.mark.parametrize("N,prefix", [(1, [2000, 5]), (64, [3000, 1])], ids=["decode", "verify"])
def test_gpu_dependent_launch_waits_for_the_kernel_before_it(monkeypatch, N, prefix):
    """TREECOMPILE_PDL=1: both cascade kernels as programmatic dependent launches, in a CUDA graph right after
    a kernel that writes q. Stage 1 must wait before it reads q (else stale rows) and the merge before it
    reads the partials; replayed with new queries, every row matches the float64 reference."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    monkeypatch.setenv("TREECOMPILE_PDL", "1")
    monkeypatch.delenv("TREECOMPILE_CASCADE", raising=False)
    gen = torch.Generator().manual_seed(N)
    B, Hq, Hkv, D, page_size = 2, 32, 8, 128, 64
    q, kc, vc, pt, pl, _ = make_paged(B, N, Hq, Hkv, D, page_size, 50, prefix, N, torch.bfloat16, gen)
    mask = torch.stack([random_tree_mask(N, gen) for _ in range(B)])
    q, kc, vc, pt, pl, mask = (t.cuda() for t in (q, kc, vc, pt, pl, mask))
    src = torch.randn_like(q)
    args = (q, kc, vc, pt, pl, mask, page_size, N, D**-0.5)
    from treecompile.ops._tree_attention_kernels import choose_config

    assert choose_config(B, N, Hq, Hkv, D, 50 * page_size, q.device).pdl
    op = torch.ops.treespec.tree_attention_paged
    op(*args)  # compiles the USE_PDL kernels outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q.copy_(src * 2)  # the kernel before stage 1 writes q
        out = op(*args)
    for _ in range(3):
        src.copy_(torch.randn(src.shape, generator=gen).to(src))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = tree_attention_paged_reference((src * 2).double(), kc.double(), vc.double(), pt, pl, mask,
                                              page_size, N, D**-0.5)  # fmt: skip
        torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_functional_nan_past_window():
    gen = torch.Generator().manual_seed(9)
    B, N, Hq, Hkv, D, L = 2, 33, 16, 4, 64, 200
    q = torch.randn(B, N, Hq, D, generator=gen).bfloat16().cuda()
    k = torch.randn(B, L, Hkv, D, generator=gen).bfloat16().cuda()
    v = torch.randn(B, L, Hkv, D, generator=gen).bfloat16().cuda()
    pl = torch.tensor([100, 0], device="cuda")
    k[0, 100 + N :] = float("nan")
    v[0, 100 + N :] = float("nan")
    k[1, N:] = float("inf")
    v[1, N:] = float("nan")
    mask = torch.stack([random_tree_mask(N, gen) for _ in range(B)]).cuda()
    got = tree_attention(q, k, v, mask, pl)
    want = tree_attention_reference(q.double(), k.double(), v.double(), mask, pl)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_math_sanity_of_helpers():
    """The test helpers themselves: chain masks are prefixes of ones, tree masks contain their own bit."""
    assert [int(x) for x in chain_mask(3)] == [1, 3, 7]
    assert int(chain_mask(64)[63]) == -1
    gen = torch.Generator().manual_seed(0)
    m = random_tree_mask(64, gen)
    assert all((int(m[i]) >> i) & 1 for i in range(64))
    assert math.isclose(64**-0.5, 0.125)


def test_functional_compiles_fullgraph_without_value_checks():
    """Under torch.compile the value checks (host reads) are skipped: no graph break, same result."""
    gen = torch.Generator().manual_seed(4)
    B, N, Hq, Hkv, D, L = 1, 3, 2, 1, 8, 7
    q = torch.randn(B, N, Hq, D, generator=gen)
    k = torch.randn(B, L, Hkv, D, generator=gen)
    v = torch.randn(B, L, Hkv, D, generator=gen)
    mask = chain_mask(N)[None]
    pl = torch.tensor([2])
    compiled = torch.compile(tree_attention, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask, pl), tree_attention(q, k, v, mask, pl))


@pytest.mark.parametrize(
    "B,N,Hq,Hkv,D,capacity",
    [(1, 64, 32, 8, 128, 65600), (1, 64, 32, 8, 128, 4160), (1, 16, 32, 8, 128, 65600), (1, 1, 32, 8, 128, 65600),
     (4, 64, 32, 8, 128, 8192), (3, 33, 28, 4, 128, 4096), (1, 64, 32, 8, 128, 300), (2, 7, 16, 2, 256, 2048),
     (1, 64, 9, 3, 64, 1024), (1, 64, 9, 3, 64, 448), (4, 64, 9, 3, 64, 1024), (1, 64, 32, 8, 128, 2176),
     (1, 1, 32, 8, 128, 2176), (1, 16, 32, 8, 128, 2176)],
    ids=lambda x: str(x),
)  # fmt: skip
def test_split_choice_fills_one_wave(monkeypatch, B, N, Hq, Hkv, D, capacity):
    """The static split count keeps the prefix programs within one wave of what the SMs hold at once (a grid
    just past it runs an almost empty extra wave) and never exceeds the splits of >= min_chunk keys the capacity
    holds. Where a split is only a few tiles long the window programs (one more column) fit that wave too."""
    from treecompile.ops import _tree_attention_kernels as kern

    monkeypatch.setattr(kern, "_num_sms", lambda index: 132)
    cfg = kern.choose_config(B, N, Hq, Hkv, D, capacity, torch.device("cuda", 0))
    nrb = -(-N * (Hq // Hkv) // cfg.block_m)
    programs = B * Hkv * nrb * cfg.num_splits
    slots = kern.resident_ctas_per_sm(cfg.block_m, cfg.num_warps) * 132
    live = -(-capacity // cfg.min_chunk)  # splits a full cache fills
    assert 1 <= cfg.num_splits <= live and cfg.min_chunk % cfg.block_n == 0
    assert programs <= max(slots, B * Hkv * nrb)  # one split is the minimum
    short = -(-capacity // cfg.num_splits) <= kern.SHORT_SPLIT_KEYS
    window = B * Hkv * nrb if short and cfg.num_splits > 1 else 0  # window programs that must share the wave
    assert programs + window <= max(slots, B * Hkv * nrb)
    if cfg.num_splits < live and B * Hkv * nrb <= slots:
        assert programs + window + B * Hkv * nrb > slots  # and the wave is as full as whole splits allow
    if capacity == 2176 and Hkv == 8:  # 8B at ctx 2k: 7 verify splits (7 x 32 + 32 = 256), 32 decode splits
        assert cfg.num_splits == (7 if N == 64 else 32)
    assert cfg.tma  # full tiles through TMA wherever the device and layout allow (checked at launch)
    states = 1 << cfg.num_splits.bit_length()  # next power of two of num_splits + 1
    if states * D <= 1024 and B * N * Hq >= 1024:  # small states, many rows: a warp a row, eight a program
        assert (cfg.merge_rows, cfg.merge_warps) == (8, 8)
    else:  # a row's states in one warp's registers, else four warps
        assert (cfg.merge_rows, cfg.merge_warps) == (1, 1 if states * D <= 4096 else 4)
    if (B, N, capacity) == (1, 64, 2176):  # 8B verify at 2k: 7 splits, 8 x 128 values a row
        assert (cfg.merge_rows, cfg.merge_warps) == (8, 8)
    if (B, N, capacity) in ((1, 64, 65600), (1, 64, 4160)):  # 8B verify: 16 / 8 splits, one-warp merges
        assert cfg.merge_warps == 1
    if (B, N, capacity) == (1, 1, 65600):  # 8B decode: 33 splits, four warps (one lost 1 us a layer)
        assert cfg.merge_warps == 4
    if (B, N, capacity) == (1, 64, 65600):  # long cache: one-warpgroup programs, two per SM
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_splits) == (128, 64, 4, 16)  # 256 of 264 slots
    if (B, N, capacity) == (1, 64, 4160):  # short cache: 64 x 64 one-warpgroup programs, two per SM
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_splits) == (64, 64, 4, 8)  # 256 of 264 slots
    if (B, Hkv) == (1, 8) and N == 64:  # 32 64-row blocks a split: >= 256-key chunks, as before
        assert cfg.min_chunk == max(256, 4 * cfg.block_m)
    if (B, Hkv, N) == (1, 3, 64):  # SmolLM2's verify: 9 programs a split, 128-key chunks, 8 (or 4) splits
        assert cfg.min_chunk == 128 and cfg.num_splits == -(-capacity // 128)
    if (B, Hkv, N) == (4, 3, 64):  # four requests: 36 programs a split
        assert cfg.min_chunk == 256


@pytest.mark.parametrize("B,ordered", [(1, True), (1, False), (2, False)])
def test_cpu_path_shared_plan_follows_every_metadata_change(B, ordered):
    """The CPU path builds its slots / visibility plan once per forward's metadata tensors and reuses it for
    every layer: another layer's cache reuses it, while an in-place write to any metadata tensor (counted by
    its version or not), or fresh tensors (ids recycled), must rebuild it. Unseen slots hold NaN / inf
    throughout (float64 reference)."""
    gen = torch.Generator().manual_seed(21)
    R, Hq, Hkv, D, page_size, max_pages = 7, 4, 2, 16, 8, 6
    prefix = [13, 21][:B]
    q, kc, vc, pt, pl, mask = make_paged(B, R, Hq, Hkv, D, page_size, max_pages, prefix, R, torch.float64, gen)
    if ordered:  # pages in slot order: the CPU path takes K/V as a view of the cache
        pt = torch.arange(1, 1 + max_pages, dtype=torch.int32)[None]
        kc2 = torch.full_like(kc, float("nan"))
        vc2 = torch.full_like(vc, float("inf"))
        for t in range(prefix[0] + R):
            old = int(make_slot(pt, 0, t, page_size))
            kc2[old], vc2[old] = torch.randn(Hkv, D, generator=gen, dtype=torch.float64), torch.randn(
                Hkv, D, generator=gen, dtype=torch.float64)
        kc, vc = kc2, vc2
    op = torch.ops.treespec.tree_attention_paged

    def check(q, kc, vc, pt, pl, mask):
        got = op(q, kc, vc, pt, pl, mask, page_size, R, 0.25)
        want = tree_attention_paged_reference(q, kc, vc, pt, pl, mask, page_size, R, 0.25)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        return got

    first = check(q, kc, vc, pt, pl, mask)
    # Another layer: same metadata objects, other K/V (the plan is shared, the values are not).
    check(q, kc.flip(-1), vc.flip(-1), pt, pl, mask)
    # In-place writes bump version counters, including writes through a view.
    mask[:, 3] = 1 << 3  # row 3 now sees only its own window key (others unseen by it)
    changed = check(q, kc, vc, pt, pl, mask)
    assert not torch.allclose(changed[:, 3], first[:, 3])
    mask[:, :R].copy_(torch.stack([random_tree_mask(R, gen) for _ in range(B)]))
    check(q, kc, vc, pt, pl, mask)
    pl[:1].sub_(2)  # a shorter prefix: two more window-adjacent keys leave every row's view
    check(q, kc, vc, pt, pl, mask)
    # Window bits some rows leave out: keys nobody sees hold NaN and must stay out.
    mask.copy_(torch.tensor([1 << i for i in range(R)], dtype=torch.int64).repeat(B, 1))
    mask[:, 0] = 0
    check(q, kc, vc, pt, pl, mask)
    for _ in range(4):  # fresh tensors each time (CPython may recycle the ids of the dead ones)
        m = torch.stack([random_tree_mask(R, gen) for _ in range(B)])
        check(q, kc, vc, pt.clone(), pl.clone(), m)
    # Writes that bump no version counter, as Inductor's generated kernels make into a buffer it reuses
    # within one graph (``.data`` shares the storage, not the counter): same objects, same versions.
    for t, fresh in ((mask, torch.stack([random_tree_mask(R, gen) for _ in range(B)])), (pl, pl - 3)):
        version = t._version
        before = op(q, kc, vc, pt, pl, mask, page_size, R, 0.25)
        t.data.copy_(fresh)
        assert t._version == version
        after = check(q, kc, vc, pt, pl, mask)
        assert not torch.allclose(after, before)


def make_slot(pt, b, t, page_size):
    return pt[b, t // page_size] * page_size + t % page_size
