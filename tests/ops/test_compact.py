"""treespec::compact_window_rows: Triton kernels (fused pointer table and per buffer) and the reference
against a per-request Python oracle, over mixed dtypes, strided rows and overlapping moves."""

import logging

import pytest
import torch

from treecompile.ops import compact
from treecompile.ops.compact import (
    _launch_compact_window_rows,
    clear_pointer_tables,
    compact_window_rows_reference,
    validate_accepted_path,
)

NUM_SLOTS = 300


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view of every row (NaN payloads and fp8 compare exactly)."""
    rows = t.unsqueeze(1) if t.dim() == 1 else t.reshape(t.shape[0], -1)
    return rows.view(torch.uint8).cpu()


def make_buffers(device, num_slots=NUM_SLOTS, seed=0):
    """Every word size and layout in one list: 4-byte words (fp32, bf16 with even rows, fp64, the K
    and V halves of one [S, 2, H, D] cache, a 1-d fp32 buffer) and byte words (fp16 with 7 columns,
    uint8 with 3 columns, fp8 rows of 5 bytes)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    kv = rand(num_slots, 2, 3, 4).to(torch.bfloat16)
    buffers = [
        rand(num_slots, 3, 5),
        rand(num_slots, 7).half(),
        rand(num_slots, 2, 8).to(torch.bfloat16),
        torch.randint(0, 256, (num_slots, 3), generator=gen, dtype=torch.uint8),
        rand(num_slots, 2).double(),
        rand(num_slots),
        kv[:, 0],  # rows of 24 bytes, row stride 48 bytes
        kv[:, 1],
    ]
    if hasattr(torch, "float8_e4m3fn"):
        buffers.append(rand(num_slots, 5).to(torch.float8_e4m3fn))
    buffers[0][7, 1, 2] = float("nan")  # a NaN payload must travel bit for bit
    return [b.to(device) for b in buffers], kv.to(device)


def random_acceptance(batch, num_nodes, window, seed, num_slots=NUM_SLOTS):
    """Random root-first increasing paths of random lengths (1..N), padded with -1, and distinct
    window slots in shuffled order (so source and destination rows interleave arbitrarily)."""
    gen = torch.Generator().manual_seed(seed)
    accept_len = torch.randint(1, num_nodes + 1, (batch,), generator=gen)
    accept_len[0] = 1
    accept_len[-1] = num_nodes
    path = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for b in range(batch):
        n = int(accept_len[b])
        rest = torch.randperm(num_nodes - 1, generator=gen)[: n - 1] + 1
        path[b, :n] = torch.cat([torch.zeros(1, dtype=torch.int64), rest.sort().values])
    slots = torch.randperm(num_slots, generator=gen)[: batch * window].view(batch, window)
    return slots, path, accept_len


def oracle_compact(buffers, slots, path, accept_len):
    """Request by request, row by row, from a snapshot taken before any move."""
    out = [as_bytes(b).clone() for b in buffers]
    for before, after in zip([as_bytes(b) for b in buffers], out):
        for b in range(path.shape[0]):
            for i in range(int(accept_len[b])):
                after[int(slots[b, i])] = before[int(slots[b, int(path[b, i])])]
    return out


def assert_moved(buffers, want):
    for k, (buf, w) in enumerate(zip(buffers, want)):
        assert torch.equal(as_bytes(buf), w), f"buffers[{k}] ({buf.dtype}, {tuple(buf.shape)}) differs"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-buffer"])
@pytest.mark.parametrize(
    "batch,num_nodes,window", [(4, 1, 1), (3, 2, 5), (8, 33, 33), (4, 63, 64), (4, 64, 70)],
    ids=lambda v: str(v),
)
def test_kernel_matches_oracle(batch, num_nodes, window, fused, kernel_device):
    buffers, _ = make_buffers(kernel_device, seed=num_nodes)
    slots, path, accept_len = random_acceptance(batch, num_nodes, window, seed=num_nodes)
    want = oracle_compact(buffers, slots, path, accept_len)
    _launch_compact_window_rows(
        buffers, slots.to(kernel_device), path.to(kernel_device), accept_len.to(kernel_device), fused=fused
    )
    assert_moved(buffers, want)


@pytest.mark.parametrize("batch,block_b", [(5, 1), (7, 4), (9, 16)], ids=lambda v: str(v))
def test_kernel_partial_programs(batch, block_b, kernel_device):
    buffers, _ = make_buffers(kernel_device, seed=batch)
    slots, path, accept_len = random_acceptance(batch, 17, 20, seed=batch)
    want = oracle_compact(buffers, slots, path, accept_len)
    _launch_compact_window_rows(
        buffers, slots.to(kernel_device), path.to(kernel_device), accept_len.to(kernel_device),
        block_b=block_b,
    )
    assert_moved(buffers, want)


def as_table_views(slots, path, accept_len):
    """The metadata as views of wider state tables, the way a caller's per-request buffers hand them over:
    slots and path every third column of a [B, 3W + 1] table, accept_len a column of a [B, 64] table."""
    batch, window = slots.shape
    num_nodes = path.shape[1]
    slot_table, path_table, len_table = (
        torch.full((batch, width), -7, dtype=torch.int64, device=slots.device)
        for width in (3 * window + 1, 3 * num_nodes + 1, 64)
    )
    slot_table[:, 1::3] = slots
    path_table[:, 1::3] = path
    len_table[:, 5] = accept_len
    return slot_table[:, 1::3], path_table[:, 1::3], len_table[:, 5]


@pytest.mark.parametrize("run", ["kernel", "op"])
def test_strided_metadata_views(run, kernel_device):
    """slots, accepted_path and accept_len may be strided views (the kernel takes every stride)."""
    device = kernel_device if run == "kernel" else "cpu"
    buffers, _ = make_buffers(device, seed=5)
    slots, path, accept_len = random_acceptance(5, 9, 12, seed=5)
    want = oracle_compact(buffers, slots, path, accept_len)
    views = as_table_views(slots.to(device), path.to(device), accept_len.to(device))
    assert views[2].stride() == (64,)
    if run == "kernel":
        _launch_compact_window_rows(buffers, *views)
    else:
        torch.ops.treespec.compact_window_rows(buffers, *views)
    assert_moved(buffers, want)


@pytest.mark.parametrize("run", ["kernel", "reference", "op"])
def test_overlapping_moves(run, kernel_device):
    """Path [0, 2, 3] over contiguous slots: 2 -> 1 and 3 -> 2 must both read pre-call rows."""
    device = kernel_device if run == "kernel" else "cpu"
    buf = torch.arange(10 * 4, dtype=torch.float32, device=device).view(10, 4)
    before = buf.clone()
    slots = torch.tensor([[3, 4, 5, 6]], device=device)
    path = torch.tensor([[0, 2, 3, -1]], device=device)
    accept_len = torch.tensor([3], device=device)
    if run == "kernel":
        _launch_compact_window_rows([buf], slots, path, accept_len)
    elif run == "reference":
        compact_window_rows_reference([buf], slots, path, accept_len)
    else:
        torch.ops.treespec.compact_window_rows([buf], slots, path, accept_len)
    want = before.clone()
    want[4] = before[5]
    want[5] = before[6]
    assert torch.equal(buf, want)  # rows 3 (root) and 6 (past accept_len) untouched


def test_accept_len_one_and_full_chain_move_nothing(kernel_device):
    buffers, _ = make_buffers(kernel_device)
    before = [as_bytes(b).clone() for b in buffers]
    slots = torch.randperm(NUM_SLOTS)[:128].view(2, 64).to(kernel_device)
    path = torch.stack([torch.full((64,), -1), torch.arange(64)]).to(kernel_device)
    path[0, 0] = 0
    accept_len = torch.tensor([1, 64], device=kernel_device)
    _launch_compact_window_rows(buffers, slots, path, accept_len)
    assert_moved(buffers, before)


def test_rows_outside_the_accepted_prefix_are_untouched(kernel_device):
    buffers, _ = make_buffers(kernel_device, seed=3)
    slots, path, accept_len = random_acceptance(6, 20, 24, seed=3)
    before = [as_bytes(b).clone() for b in buffers]
    _launch_compact_window_rows(buffers, *(t.to(kernel_device) for t in (slots, path, accept_len)))
    written = torch.zeros(NUM_SLOTS, dtype=torch.bool)
    for b in range(6):
        written[slots[b, : int(accept_len[b])]] = True
    for buf, old in zip(buffers, before):
        assert torch.equal(as_bytes(buf)[~written], old[~written])


@pytest.mark.parametrize("num_nodes", (1, 2, 33, 63, 64), ids=lambda n: f"N{n}")
def test_reference_matches_oracle(num_nodes):
    """1000+ random acceptances across sizes through the reference (the CPU path)."""
    batch = 220 if num_nodes > 1 else 100
    num_slots = batch * (num_nodes + 3)
    buffers = [torch.randn(num_slots, 3), torch.randn(num_slots, 5).half()]
    slots, path, accept_len = random_acceptance(
        batch, num_nodes, num_nodes + 3, seed=num_nodes, num_slots=num_slots
    )
    want = oracle_compact(buffers, slots, path, accept_len)
    compact_window_rows_reference(buffers, slots, path, accept_len)
    assert_moved(buffers, want)


def test_op_dispatch_cpu_matches_oracle():
    buffers, _ = make_buffers("cpu", seed=5)
    slots, path, accept_len = random_acceptance(10, 12, 12, seed=5)
    want = oracle_compact(buffers, slots, path, accept_len)
    torch.ops.treespec.compact_window_rows(buffers, slots, path, accept_len)
    assert_moved(buffers, want)


def test_pointer_table_is_cached_per_buffer_set(kernel_device):
    clear_pointer_tables()
    buffers, _ = make_buffers(kernel_device)
    args = [t.to(kernel_device) for t in random_acceptance(2, 5, 5, seed=1)]
    _launch_compact_window_rows(buffers, *args)
    tables = dict(compact._POINTER_TABLES)
    assert len(tables) == 2  # one per word size: 4-byte words and bytes
    _launch_compact_window_rows(buffers, *args)
    assert compact._POINTER_TABLES.keys() == tables.keys()
    assert all(compact._POINTER_TABLES[k] is v for k, v in tables.items())
    clear_pointer_tables()
    assert not compact._POINTER_TABLES


def test_pointer_tables_stay_bounded_when_buffers_move():
    clear_pointer_tables()
    keep = [torch.zeros(4, 4) for _ in range(compact._MAX_TABLES + 6)]  # distinct live addresses
    for buf in keep:
        compact._pointer_table([buf], [compact._row_layout(buf)], buf.device)
    assert len(compact._POINTER_TABLES) == compact._MAX_TABLES
    newest = (str(keep[-1].device), ((keep[-1].data_ptr(), 4, 4),))
    assert newest in compact._POINTER_TABLES
    clear_pointer_tables()


def test_compiles_under_aot_eager():
    """The list mutation survives functionalization (auto_functionalized) with fullgraph."""
    buffers, _ = make_buffers("cpu", seed=8)
    slots, path, accept_len = random_acceptance(3, 9, 9, seed=8)
    want = oracle_compact(buffers, slots, path, accept_len)

    def step(k, v, slots, path, accept_len):
        torch.ops.treespec.compact_window_rows([k, v], slots, path, accept_len)
        return k.sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(buffers[0], buffers[1], slots, path, accept_len)
    assert_moved(buffers[:2], want[:2])


def test_opcheck():
    buffers = [torch.randn(12, 3), torch.randn(12, 5).half(), torch.randn(12, 2, 2)[:, 0]]
    slots, path, accept_len = random_acceptance(2, 4, 5, seed=4, num_slots=12)
    torch.library.opcheck(
        torch.ops.treespec.compact_window_rows.default, (buffers, slots, path, accept_len)
    )


def _args(**change):
    args = {
        "buffers": [torch.zeros(16, 4), torch.zeros(16, 2, dtype=torch.float16)],
        "slots": torch.arange(12).view(2, 6),
        "accepted_path": torch.zeros(2, 5, dtype=torch.int64),
        "accept_len": torch.ones(2, dtype=torch.int64),
    }
    args.update(change)
    return args


_kv = torch.zeros(16, 2, 4)
_base = torch.zeros(16, 4)


@pytest.mark.parametrize(
    "args,match",
    [
        (_args(slots=torch.arange(18).view(3, 6)), "slots: batch size 3"),
        (_args(accept_len=torch.ones(3, dtype=torch.int64)), "accept_len: batch size 3"),
        (_args(slots=torch.arange(8).view(2, 4)), "W >= N = 5"),
        (
            _args(accepted_path=torch.zeros(2, 65, dtype=torch.int64), slots=torch.zeros(2, 65, dtype=torch.int64)),
            "1..64",
        ),
        (_args(slots=torch.arange(12, dtype=torch.int32).view(2, 6)), "slots: expected dtype torch.int64"),
        (_args(accepted_path=torch.zeros(2, 5, dtype=torch.int32)), "accepted_path: expected dtype"),
        (_args(accept_len=torch.ones(2)), "accept_len: expected dtype"),
        (_args(accept_len=torch.ones(2, 1, dtype=torch.int64)), "accept_len: expected a 1-d"),
        (_args(buffers=[torch.zeros(16, 4), torch.zeros(15, 4)]), r"buffers\[1\]: has 15 slots"),
        (_args(buffers=[torch.zeros(16, 4, device="meta")]), r"buffers\[0\] is on meta"),
        (_args(accept_len=torch.ones(2, dtype=torch.int64, device="meta")), "accept_len is on meta"),
        (_args(buffers=[torch.zeros(4, 16).t()]), r"buffers\[0\]: each row"),
        (_args(buffers=[torch.zeros(())]), r"buffers\[0\]: expected a \[num_slots"),
        (_args(buffers=[_base, _base]), r"buffers\[0\] and buffers\[1\] share memory"),
        (_args(buffers=[_kv[:, 0], _kv.view(16, 8)[:, 2:6]]), r"buffers\[0\] and buffers\[1\] share memory"),
    ],
    ids=[
        "batch-slots", "batch-accept_len", "window-too-small", "N65", "dtype-slots", "dtype-path",
        "dtype-accept_len", "dim-accept_len", "num_slots-mismatch", "device-buffer", "device-accept_len",
        "strided-row", "0d-buffer", "same-buffer-twice", "overlapping-views",
    ],
)
def test_op_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.compact_window_rows(**args)


def test_interleaved_halves_are_not_aliases():
    kv = torch.randn(16, 2, 4)
    before = kv.clone()
    slots, path = torch.tensor([[0, 1, 2]]), torch.tensor([[0, 2, -1]])
    torch.ops.treespec.compact_window_rows([kv[:, 0], kv[:, 1]], slots, path, torch.tensor([2]))
    assert torch.equal(kv[1], before[2]) and torch.equal(kv[0], before[0])


@pytest.mark.parametrize(
    "path,accept_len,slots,num_slots,match",
    [
        ([[0, 1, -1]], [0], None, None, "accept_len"),
        ([[0, 1, -1]], [4], None, None, "accept_len"),
        ([[1, 2, -1]], [2], None, None, "start at the root"),
        ([[0, 2, 1]], [3], None, None, "must increase"),
        ([[0, 1, 3]], [3], None, None, "outside the tree"),
        ([[0, 1, -1]], [2], [[4, 4, 5]], None, "distinct"),
        ([[0, 1, -1]], [2], [[0, 1, 9]], 8, r"\[0, num_slots = 8\)"),
        ([[0, 1, -1]], [2], [[0, 1]], None, "W >= 3"),
    ],
    ids=[
        "len-0", "len-past-N", "no-root", "not-increasing", "node-past-N", "dup-slots", "slot-range",
        "short-window",
    ],
)
def test_validate_accepted_path_rejects(path, accept_len, slots, num_slots, match):
    with pytest.raises(ValueError, match=match):
        validate_accepted_path(
            torch.tensor(path), torch.tensor(accept_len),
            None if slots is None else torch.tensor(slots), num_slots,
        )


def test_validate_accepted_path_accepts_valid_paths():
    slots, path, accept_len = random_acceptance(50, 33, 40, seed=6, num_slots=2000)
    validate_accepted_path(path, accept_len, slots, 2000)


@pytest.mark.gpu
def test_gpu_op_matches_oracle_and_replays_in_a_cuda_graph():
    buffers, _ = make_buffers("cuda", seed=11)
    slots, path, accept_len = random_acceptance(4, 64, 64, seed=11)  # 4 * 64 <= NUM_SLOTS
    dev = [t.cuda() for t in (slots, path, accept_len)]
    want = oracle_compact(buffers, *dev)
    torch.ops.treespec.compact_window_rows(buffers, *dev)  # warm-up: builds the pointer table
    assert_moved(buffers, want)
    # Capture, then replay on fresh contents: the graph reads the cached table and the index tensors.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.treespec.compact_window_rows(buffers, *dev)
    fresh, _ = make_buffers("cuda", seed=12)
    for buf, new in zip(buffers, fresh):
        buf.copy_(new)
    new_slots, new_path, new_len = random_acceptance(4, 64, 64, seed=13)
    for t, new in zip(dev, (new_slots, new_path, new_len)):
        t.copy_(new)
    want = oracle_compact(buffers, *dev)
    graph.replay()
    torch.cuda.synchronize()
    assert_moved(buffers, want)


@pytest.mark.gpu
def test_gpu_capture_without_warm_up_falls_back_per_buffer(caplog):
    clear_pointer_tables()
    buffers, _ = make_buffers("cuda", seed=14)
    slots, path, accept_len = (t.cuda() for t in random_acceptance(4, 16, 16, seed=14))
    want = oracle_compact(buffers, slots, path, accept_len)
    scratch = [b.clone() for b in buffers]  # compile the per-buffer kernel before capture
    _launch_compact_window_rows(scratch, slots, path, accept_len, fused=False)
    compact._warned_unfused = False
    graph = torch.cuda.CUDAGraph()
    with caplog.at_level(logging.WARNING, logger="treecompile.ops.compact"):
        with torch.cuda.graph(graph):
            torch.ops.treespec.compact_window_rows(buffers, slots, path, accept_len)
    assert "warm-up" in caplog.text
    graph.replay()
    torch.cuda.synchronize()
    assert_moved(buffers, want)


@pytest.mark.gpu
def test_gpu_opcheck():
    buffers = [torch.randn(12, 3), torch.randn(12, 5).half(), torch.randn(12, 2, 2)[:, 0]]
    args = random_acceptance(2, 4, 5, seed=4, num_slots=12)
    torch.library.opcheck(
        torch.ops.treespec.compact_window_rows.default,
        ([b.cuda() for b in buffers], *(t.cuda() for t in args)),
    )
