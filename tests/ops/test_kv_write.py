"""kv_write: the Triton kernel (interpreter on CPU) and the reference store rows at slots, in place."""

import pytest
import torch

from treecompile.ops.kv_write import _launch_kv_write, kv_write_reference


def _case(T, H, D, num_slots, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=gen).to(dtype)
    v = torch.randn(T, H, D, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:T].to(torch.int64)
    return k, v, slots


@pytest.mark.parametrize(
    "T,H,D,dtype",
    [(1, 1, 64, torch.float32), (33, 2, 64, torch.float16), (63, 3, 128, torch.bfloat16), (64, 8, 24, torch.float32)],
    ids=lambda x: str(x).replace("torch.", ""),
)
def test_kernel_writes_rows_and_nothing_else(T, H, D, dtype, kernel_device):
    num_slots = 80
    k, v, slots = _case(T, H, D, num_slots, dtype, seed=T)
    kc = torch.full((num_slots, H, D), float("nan"), dtype=dtype)
    vc = torch.full((num_slots, H, D), float("nan"), dtype=dtype)
    want_k, want_v = kc.clone(), vc.clone()
    kv_write_reference(want_k, want_v, k, v, slots)
    d = kernel_device
    kc_d, vc_d = kc.to(d), vc.to(d)
    _launch_kv_write(kc_d, vc_d, k.to(d), v.to(d), slots.to(d))
    assert torch.equal(kc_d.cpu()[slots], k) and torch.equal(vc_d.cpu()[slots], v)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert kc_d.cpu()[untouched].isnan().all() and vc_d.cpu()[untouched].isnan().all()
    torch.testing.assert_close(kc_d.cpu(), want_k, equal_nan=True, rtol=0, atol=0)


def test_out_of_range_slots_are_skipped_and_dummy_absorbs_padding(kernel_device):
    T, H, D, num_slots = 6, 2, 64, 10
    k, v, _ = _case(T, H, D, num_slots, torch.float32)
    slots = torch.tensor([3, -1, 10, 0, 0, 9])  # -1 and 10 are out of range; two padded rows hit dummy slot 0
    d = kernel_device
    for launch in (_launch_kv_write, kv_write_reference):
        kc = torch.full((num_slots, H, D), float("nan"), device=d)
        vc = torch.full((num_slots, H, D), float("nan"), device=d)
        launch(kc, vc, k.to(d), v.to(d), slots.to(d))
        kc, vc = kc.cpu(), vc.cpu()
        assert torch.equal(kc[3], k[0]) and torch.equal(kc[9], k[5]) and torch.equal(vc[9], v[5])
        # Two padded rows race for the dummy slot: its contents are never read, so any interleaving of
        # the two rows is fine, but nothing else may land there.
        assert ((kc[0] == k[3]) | (kc[0] == k[4])).all() and ((vc[0] == v[3]) | (vc[0] == v[4])).all()
        rest = [s for s in range(num_slots) if s not in (0, 3, 9)]
        assert kc[rest].isnan().all() and vc[rest].isnan().all()


def test_op_mutates_in_place_and_opcheck():
    k, v, slots = _case(5, 2, 16, 12, torch.float32)
    kc = torch.zeros(12, 2, 16)
    vc = torch.zeros(12, 2, 16)
    ptr = kc.data_ptr()
    torch.ops.treespec.kv_write(kc, vc, k, v, slots)
    assert kc.data_ptr() == ptr and torch.equal(kc[slots], k) and torch.equal(vc[slots], v)
    fresh = (torch.zeros(12, 2, 16), torch.zeros(12, 2, 16), k, v, slots)
    torch.library.opcheck(torch.ops.treespec.kv_write.default, fresh)


def test_float64_reference_path():
    k, v, slots = _case(4, 1, 8, 6, torch.float64)
    kc = torch.zeros(6, 1, 8, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    torch.ops.treespec.kv_write(kc, vc, k, v, slots)
    assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)


@pytest.mark.parametrize(
    "bad,match",
    [
        ("dtype", "k: dtype torch.float16 must equal the cache dtype"),
        ("slots_dtype", "slots: expected dtype torch.int64"),
        ("slots_len", r"slots: expected \[4\]"),
        ("heads", r"k, v: expected \[T, 2, 16\]"),
        ("device", "one device"),
        ("v_cache", "v_cache: must match k_cache"),
        ("cache_head_stride", r"k_cache: the head dim must be contiguous \(stride 1\)"),
    ],
    ids=lambda x: x if isinstance(x, str) and " " not in x else "",
)
def test_bad_input(bad, match):
    kc = torch.zeros(12, 2, 16)
    vc = torch.zeros(12, 2, 16)
    k, v, slots = _case(4, 2, 16, 12, torch.float32)
    if bad == "dtype":
        k = k.half()
    elif bad == "slots_dtype":
        slots = slots.int()
    elif bad == "slots_len":
        slots = slots[:3]
    elif bad == "heads":
        k, v = k[:, :1], v[:, :1]
    elif bad == "device":
        slots = slots.to("meta")
    elif bad == "v_cache":
        vc = torch.zeros(12, 2, 8)
    elif bad == "cache_head_stride":  # the kernel stores D contiguous elements per head
        kc, vc = torch.zeros(12, 2, 32)[:, :, ::2], torch.zeros(12, 2, 32)[:, :, ::2]
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.kv_write(kc, vc, k, v, slots)


@pytest.mark.gpu
def test_gpu_kv_write_in_cuda_graph():
    kc = torch.zeros(100, 8, 128, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    k = torch.zeros(16, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    slots = torch.zeros(16, dtype=torch.int64, device="cuda")
    torch.ops.treespec.kv_write(kc, vc, k, v, slots)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.treespec.kv_write(kc, vc, k, v, slots)
    k.copy_(torch.randn_like(k))
    v.copy_(torch.randn_like(v))
    slots.copy_(torch.arange(16, device="cuda") * 3 + 5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)


def test_strided_slots_as_the_pass_flattens_them(kernel_device):
    """The FX pass flattens a [B, 1] column of the [max_B, 64] slot buffer: a view of stride 64. The
    kernel must follow the stride (it once read slots[t] as if contiguous: plain decode broke for B > 1)."""
    B, H, D, num_slots = 3, 2, 64, 200
    k, v, _ = _case(B, H, D, num_slots, torch.float32)
    table = torch.full((B, 64), -1, dtype=torch.int64)
    table[:, 0] = torch.tensor([17, 5, 130])
    slots = table[:, :1].reshape(-1)
    assert slots.stride(0) == 64
    d = kernel_device
    kc = torch.full((num_slots, H, D), float("nan"), device=d)
    vc = torch.full((num_slots, H, D), float("nan"), device=d)
    _launch_kv_write(kc, vc, k.to(d), v.to(d), slots.to(d))
    assert torch.equal(kc.cpu()[slots], k) and torch.equal(vc.cpu()[slots], v)
    assert kc.cpu().isnan().sum() == (num_slots - B) * H * D


def test_strided_rows_and_cache_halves(kernel_device):
    """k, v views with every dim strided, written into the K and V halves of one [num_slots, 2, H, D] cache
    (row stride 2 * H * D): the kernel follows the rows' strides and the caches' slot and head strides."""
    T, H, D, num_slots = 5, 2, 16, 40
    k, v, slots = _case(T, H, D, num_slots, torch.float32, seed=2)
    d = kernel_device
    k_wide = torch.full((T, 2 * H, 2 * D), float("nan"), device=d)
    k_wide[:, ::2, ::2] = k
    v_wide = torch.full((T, H, 3 * D), float("nan"), device=d)
    v_wide[:, :, 5 : 5 + D] = v
    kv = torch.full((num_slots, 2, H, D), float("nan"), device=d)
    _launch_kv_write(kv[:, 0], kv[:, 1], k_wide[:, ::2, ::2], v_wide[:, :, 5 : 5 + D], slots.to(d))
    assert torch.equal(kv[:, 0].cpu()[slots], k) and torch.equal(kv[:, 1].cpu()[slots], v)
    assert kv.cpu().isnan().sum() == (num_slots - T) * 2 * H * D
