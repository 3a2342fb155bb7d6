"""treespec::tree_attention_paged_write: the cache write folded into the attention's window programs.

Oracle: ``kv_write`` then ``tree_attention_paged`` (the float64 reference), the op's own CPU path. The window
slots hold stale poison (NaN keys, inf values) before the call, so a window program that reads the cache where
it should read a new row fails; padding rows go to the dummy slot and are seen by no other row (the op's
contract, as the speculator lays rows out). The caches after the call must equal kv_write's bit for bit.
"""

import pytest
import torch

from test_tree_attention import make_paged, random_tree_mask
from treecompile.ops.kv_write import kv_write_reference
from treecompile.ops.tree_attention import _launch_tree_attention_paged, tree_attention_paged_reference


def new_rows_case(B, R, Hq, Hkv, D, page_size, max_pages, prefix, valid, dtype, seed):
    """A paged cache whose window slots are stale, the R new rows of each request (rows past ``valid[b]``
    are padding: dummy slot 0, masks that see the prefix only) and their slots."""
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, pt, pl, _ = make_paged(B, R, Hq, Hkv, D, page_size, max_pages, prefix, 0, dtype, gen)
    k = torch.randn(B * R, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B * R, Hkv, D, generator=gen).to(dtype)
    slots = torch.zeros(B * R, dtype=torch.int64)  # padding rows: the dummy slot
    masks = torch.zeros(B, R, dtype=torch.int64)
    for b in range(B):
        n = valid[b]
        for t in range(R):
            slot = int(pt[b, (prefix[b] + t) // page_size]) * page_size + (prefix[b] + t) % page_size
            kc[slot], vc[slot] = float("nan"), float("inf")  # stale: must be overwritten, never read
            if t < n:
                slots[b * R + t] = slot
        if n:
            masks[b, :n] = random_tree_mask(n, gen)
    return q, kc, vc, k, v, slots, pt, pl, masks


def sequential(q, kc, vc, k, v, slots, pt, pl, masks, page_size, R, scale):
    kc, vc = kc.clone(), vc.clone()
    kv_write_reference(kc, vc, k, v, slots)
    out = tree_attention_paged_reference(q.double(), kc.double(), vc.double(), pt, pl, masks, page_size, R, scale)
    return out, kc, vc


@pytest.mark.parametrize(
    "B,R,prefix,valid,num_splits",
    [(1, 1, [37], [1], None), (2, 7, [0, 40], [7, 4], None), (2, 16, [33, 70], [16, 16], 3), (1, 64, [90], [60], 2)],
    ids=["decode", "ragged-padded", "splits3", "R64"],
)
def test_fused_write_equals_kv_write_then_attention(B, R, prefix, valid, num_splits, kernel_device):
    Hq, Hkv, D, page_size = 4, 2, 64, 16
    case = new_rows_case(B, R, Hq, Hkv, D, page_size, 12, prefix, valid, torch.float32, seed=R)
    q, kc, vc, k, v, slots, pt, pl, masks = case
    want, want_k, want_v = sequential(*case, page_size, R, 0.125)
    d = kernel_device
    kc_d, vc_d = kc.to(d), vc.to(d)
    got = _launch_tree_attention_paged(
        q.to(d), kc_d, vc_d, pt.to(d), pl.to(d), masks.to(d), page_size, R, 0.125, num_splits=num_splits,
        new_rows=(k.to(d), v.to(d), slots.to(d)),
    )  # fmt: skip
    rows = torch.tensor([t < valid[b] for b in range(B) for t in range(R)]).view(B, R)
    # Padding rows see the prefix only: finite too. Every row is compared.
    assert rows.any()
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-4, atol=2e-4)
    # Several padding rows write the dummy slot 0, in no order (the GPU's programs race; kv_write_reference's last
    # row wins): each head there must hold some padding row's; every other slot is kv_write's bit for bit.
    pad = slots == 0
    assert pad.sum() == sum(R - n for n in valid)
    for name, a, b, new in (("k_cache", kc_d.cpu(), want_k, k), ("v_cache", vc_d.cpu(), want_v, v)):
        assert torch.equal(a[1:].nan_to_num(7.0, 8.0, 9.0), b[1:].nan_to_num(7.0, 8.0, 9.0)), name
        if pad.any():
            for h in range(Hkv):
                assert (new[pad, h] == a[0, h]).all(dim=-1).any(), f"{name}: dummy slot, head {h}"
        else:
            assert torch.equal(a[0].nan_to_num(7.0, 8.0, 9.0), b[0].nan_to_num(7.0, 8.0, 9.0)), name


def test_strided_slots_and_masks(kernel_device):
    """The speculator hands the op a column of its slot table (stride > 1) and rows of a wider mask buffer:
    the kernel must follow their strides (a decode with B > 1 read the wrong slots when it assumed stride 1)."""
    B, R, Hq, Hkv, D, page_size = 3, 1, 4, 2, 64, 16
    case = list(new_rows_case(B, R, Hq, Hkv, D, page_size, 4, [0, 19, 5], [1, 1, 1], torch.float32, seed=5))
    want, want_k, want_v = sequential(*case, page_size, R, 0.125)
    q, kc, vc, k, v, slots, pt, pl, masks = case
    d = kernel_device
    slot_table = torch.full((B * R, 8), -5, dtype=torch.int64)
    slot_table[:, 3] = slots
    mask_rows = torch.zeros(B, R + 5, dtype=torch.int64)
    mask_rows[:, :R] = masks
    kc_d, vc_d = kc.to(d), vc.to(d)
    got = _launch_tree_attention_paged(
        q.to(d), kc_d, vc_d, pt.to(d), pl.to(d), mask_rows.to(d)[:, :R], page_size, R, 0.125,
        new_rows=(k.to(d), v.to(d), slot_table.to(d)[:, 3]),
    )  # fmt: skip
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-4, atol=2e-4)
    assert torch.equal(kc_d.cpu().nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(vc_d.cpu().nan_to_num(7.0, 8.0), want_v.nan_to_num(7.0, 8.0))


def test_fp16_and_an_out_of_range_slot_is_skipped(kernel_device):
    """kv_write's semantics: a slot outside the cache is skipped, not written out of bounds."""
    B, R, Hq, Hkv, D, page_size = 1, 5, 2, 1, 64, 16
    case = list(new_rows_case(B, R, Hq, Hkv, D, page_size, 4, [20], [4], torch.float16, seed=3))
    case[5] = case[5].clone()
    case[5][4] = case[1].shape[0] + 5  # the padding row: past the cache
    want, want_k, want_v = sequential(*case, page_size, R, D**-0.5)
    q, kc, vc, k, v, slots, pt, pl, masks = case
    d = kernel_device
    kc_d, vc_d = kc.to(d), vc.to(d)
    got = _launch_tree_attention_paged(q.to(d), kc_d, vc_d, pt.to(d), pl.to(d), masks.to(d), page_size, R,
                                       D**-0.5, new_rows=(k.to(d), v.to(d), slots.to(d)))  # fmt: skip
    torch.testing.assert_close(got.cpu().double(), want, rtol=3e-3, atol=3e-3)
    assert torch.equal(kc_d.cpu().nan_to_num(7.0), want_k.nan_to_num(7.0))


@pytest.mark.parametrize("step", [1, 2, 3])
def test_a_lane_step_writes_its_columns_and_reads_the_earlier_ones(step, kernel_device):
    """A draft lane step: K new rows are columns [(step - 1) K, step K) of a (S - 1) K-key lane window
    (``window_offset``). Earlier columns come from the cache (written by earlier steps); the step's own
    columns hold stale poison until the call writes them; later columns are unwritten poison no mask sees.
    Lane i sees its own column and a random subset of the earlier ones, as a tree's lanes do."""
    from treecompile.ops import _tree_attention_kernels as kern

    B, K, S, Hq, Hkv, D, page_size = 2, 4, 4, 4, 2, 64, 16
    W, off, prefix = (S - 1) * K, (step - 1) * K, [21, 50]
    gen = torch.Generator().manual_seed(step)
    q, kc, vc, pt, pl, _ = make_paged(B, K, Hq, Hkv, D, page_size, 6, prefix, off, torch.float32, gen)
    k = torch.randn(B * K, Hkv, D, generator=gen)
    v = torch.randn(B * K, Hkv, D, generator=gen)
    slots = torch.empty(B * K, dtype=torch.int64)
    masks = torch.zeros(B, K, dtype=torch.int64)
    for b in range(B):
        for i in range(K):
            t = prefix[b] + off + i
            slots[b * K + i] = int(pt[b, t // page_size]) * page_size + t % page_size
            seen = [j for j in range(off) if torch.rand((), generator=gen) < 0.5]
            masks[b, i] = sum(1 << j for j in seen) | (1 << (off + i))
    want, want_k, want_v = sequential(q, kc, vc, k, v, slots, pt, pl, masks, page_size, W, 0.125)
    d = kernel_device
    kc_d, vc_d = kc.to(d), vc.to(d)
    cfg = kern.choose_config(B, K, Hq, Hkv, D, 6 * page_size, torch.device(d), None, itemsize=4, block_n=16,
                             num_stages=2)  # fmt: skip
    got = kern.launch_cascade(
        q.to(d), kc_d, vc_d, pt.to(d), pl.to(d), masks.to(d), page_size, W, 0.125, config=cfg,
        new_rows=(k.to(d), v.to(d), slots.to(d)), window_offset=off,
    )  # fmt: skip
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-4, atol=2e-4)
    for name, a, b in (("k_cache", kc_d.cpu(), want_k), ("v_cache", vc_d.cpu(), want_v)):
        assert torch.equal(a.nan_to_num(7.0, 8.0, 9.0), b.nan_to_num(7.0, 8.0, 9.0)), name
    # The op (CPU: the two ops in order) agrees.
    kc2, vc2 = kc.clone(), vc.clone()
    op = torch.ops.treespec.tree_attention_paged_write(q, kc2, vc2, k, v, slots, pt, pl, masks, page_size, W, 0.125, off)
    torch.testing.assert_close(op.double(), want, rtol=2e-5, atol=2e-5)


def test_op_on_cpu_runs_the_two_ops_in_order_and_traces():
    B, R, Hq, Hkv, D, page_size = 2, 4, 4, 2, 8, 8
    case = new_rows_case(B, R, Hq, Hkv, D, page_size, 6, [5, 11], [4, 2], torch.float64, seed=1)
    q, kc, vc, k, v, slots, pt, pl, masks = case
    want, want_k, want_v = sequential(*case, page_size, R, 0.3)
    got = torch.ops.treespec.tree_attention_paged_write(q, kc, vc, k, v, slots, pt, pl, masks, page_size, R, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(kc.nan_to_num(7.0), want_k.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0, 8.0), want_v.nan_to_num(7.0, 8.0))
    case = new_rows_case(B, R, Hq, Hkv, D, page_size, 6, [5, 11], [4, 2], torch.float64, seed=1)
    q, kc, vc, k, v, slots, pt, pl, masks = case
    fn = torch.compile(lambda *a: torch.ops.treespec.tree_attention_paged_write(*a, page_size, R, 0.3) * 2,
                       backend="aot_eager", fullgraph=True)  # fmt: skip
    torch.testing.assert_close(fn(q, kc, vc, k, v, slots, pt, pl, masks), want * 2, rtol=1e-12, atol=1e-12)
    assert torch.equal(kc.nan_to_num(7.0), want_k.nan_to_num(7.0))  # the mutation survives functionalization


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(k=a["k"][:-1], v=a["v"][:-1], slots=a["slots"][:-1]), r"k: expected B \* R = 8 rows"),
        (lambda a: a.update(window=3), r"window_offset: the R = 4 new rows are window keys \[window_offset, "
         r"window_offset \+ R\), which must lie in the window of 3 keys, got window_offset=0"),
        (lambda a: a.update(window=6, window_offset=3), "must lie in the window of 6 keys, got window_offset=3"),
        (lambda a: a.update(window=6, window_offset=-1), "got window_offset=-1"),
        (lambda a: a.update(k=a["k"].float()), "k: dtype torch.float32 must equal the cache dtype"),
        (lambda a: a.update(slots=a["slots"].int()), "slots: expected dtype torch.int64"),
    ],
)
def test_bad_input_names_the_argument(change, match):
    B, R, Hq, Hkv, D, page_size = 2, 4, 4, 2, 8, 8
    q, kc, vc, k, v, slots, pt, pl, masks = new_rows_case(B, R, Hq, Hkv, D, page_size, 6, [5, 11], [4, 2],
                                                           torch.float64, seed=1)  # fmt: skip
    args = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, slots=slots, page_table=pt, prefix_len=pl,
                ancestor_mask=masks, page_size=page_size, window=R, scale=0.3)  # fmt: skip
    change(args)
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.tree_attention_paged_write(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("B,R,prefix,valid", [(1, 1, [300], [1]), (2, 64, [700, 33], [64, 50])], ids=["decode", "verify"])
def test_gpu_fused_write_in_a_graph_equals_kv_write_then_attention(dtype, B, R, prefix, valid):
    """On the device, captured in a CUDA graph and replayed: the output against the float64 reference of
    kv_write + attention, the caches bit for bit against kv_write's."""
    Hq, Hkv, D, page_size = 8, 2, 128, 64
    case = new_rows_case(B, R, Hq, Hkv, D, page_size, 16, prefix, valid, dtype, seed=R + 1)
    q, kc, vc, k, v, slots, pt, pl, masks = case
    want, want_k, want_v = sequential(*case, page_size, R, D**-0.5)
    dev = [t.cuda() for t in (q, kc, vc, k, v, slots, pt, pl, masks)]
    fresh = [t.clone() for t in dev[1:3]]
    op = torch.ops.treespec.tree_attention_paged_write
    op(*dev, page_size, R, D**-0.5)  # warm-up (compiles)
    torch.cuda.synchronize()
    dev[1].copy_(fresh[0])
    dev[2].copy_(fresh[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*dev, page_size, R, D**-0.5)
    graph.replay()
    torch.cuda.synchronize()
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)
    # Padding rows all go to the dummy slot 0: which of them lands there last is a race on the GPU, settled
    # head by head (each KV head is another program's store; the H200 left head 0 from one padding row and
    # head 1 from another), and of no consequence: no row sees the dummy slot. So each head of slot 0 must
    # hold that head of some padding row, and every other slot must equal kv_write's bit for bit.
    for cache, rows, ref in ((dev[1], k, want_k), (dev[2], v, want_v)):
        got = cache.cpu().float().nan_to_num(7.0, 8.0)
        assert torch.equal(got[1:], ref.float().nan_to_num(7.0, 8.0)[1:])
        padding = rows[slots == 0].float()
        if len(padding):
            assert all(any(torch.equal(got[0, h], row[h]) for row in padding) for h in range(Hkv))
        else:
            assert torch.equal(got[0], ref[0].float().nan_to_num(7.0, 8.0))


def test_inductor_calls_it_in_place_on_the_cache_buffers():
    """Under Inductor (how a CUDA target graph runs) the op mutates the module's cache buffers in place: no
    clone of a whole KV cache per layer, which a functionalised mutation without re-inplacing would cost."""
    from torch._inductor.utils import run_and_get_code

    B, R, Hq, Hkv, D, page_size = 2, 4, 4, 2, 8, 8
    q, kc, vc, k, v, slots, pt, pl, masks = new_rows_case(B, R, Hq, Hkv, D, page_size, 6, [5, 11], [4, 2],
                                                           torch.float32, seed=1)  # fmt: skip
    want, want_k, _ = sequential(q, kc, vc, k, v, slots, pt, pl, masks, page_size, R, 0.3)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("kc", kc.clone())
            self.register_buffer("vc", vc.clone())

        def forward(self, q, k, v, slots, pt, pl, masks):
            op = torch.ops.treespec.tree_attention_paged_write
            return op(q, self.kc, self.vc, k, v, slots, pt, pl, masks, page_size, R, 0.3) * 2

    layer = Layer()
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(layer, backend="inductor", fullgraph=True), q, k, v, slots, pt, pl, masks)
    code = "\n".join(codes)
    assert "tree_attention_paged_write.default(" in code
    assert "copy_(" not in code and ".clone(" not in code, "the caches were copied around the op"
    torch.testing.assert_close(out.double(), want * 2, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.kc.nan_to_num(7.0), want_k.float().nan_to_num(7.0))
