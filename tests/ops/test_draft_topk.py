"""treespec::draft_topk: Triton kernels and reference against a float64 log_softmax + Python sort oracle.

The oracle orders each row with Python's ``sorted`` on ``(-value, index)`` (NaN mapped to -inf first), so
it is independent of ``torch.sort``'s stability. Kernels run in the Triton interpreter on CPU: small
slices (``block``) give several slices per row at small V, and k = 16 cases stay few (each round is a
handful of interpreted reductions per program).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import poisoned
from treecompile.ops._common import counter_table
from treecompile.ops.draft_topk import MAX_K, _launch_draft_topk, draft_topk_reference

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # The interpreter evaluates -inf - -inf and log(0) with numpy for all -inf rows: NaN by design.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

NEG_INF = float("-inf")
NAN = float("nan")


def mixed_logits(rows: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows cycling through five kinds: spread normals; integer values in [-2, 2] (ties everywhere);
    ties sprinkled with NaN and -inf; an entirely -inf/NaN row; mostly -inf with a few finite values
    (so the top-k reaches into -inf ties). ``rows == 1`` gives the tie row alone."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(rows, vocab, dtype=torch.float64)
    kinds = [1] if rows == 1 else [r % 5 for r in range(rows)]
    for r, kind in enumerate(kinds):
        normal = 3 * torch.randn(vocab, generator=gen, dtype=torch.float64)
        ties = torch.randint(-2, 3, (vocab,), generator=gen).double()
        u = torch.rand(vocab, generator=gen, dtype=torch.float64)
        if kind == 0:
            x[r] = normal
        elif kind == 1:
            x[r] = ties
        elif kind == 2:
            x[r] = torch.where(u < 0.15, NAN, torch.where(u < 0.3, NEG_INF, ties))
        elif kind == 3:
            x[r] = torch.where(u < 0.5, NAN, NEG_INF)
        else:
            x[r] = torch.where(u < 0.9, NEG_INF, ties)
    return x.to(dtype)


def oracle_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log_softmax of the NaN-mapped row; order by (-value, index) with Python's sort."""
    work = logits.double()
    work = torch.where(torch.isnan(work), NEG_INF, work)
    logp_all = torch.log_softmax(work, dim=-1)
    index = [sorted(range(len(row)), key=lambda i, row=row: (-row[i], i))[:k] for row in work.tolist()]
    index = torch.tensor(index, dtype=torch.int64).reshape(logits.shape[0], k)
    return logp_all.gather(1, index), index


def run_launcher(logits: torch.Tensor, k: int, block: int, fused: bool = False, index_offset=None):
    """Call the launcher with NaN-poisoned strided outputs (columns outside [1, 1 + k) must stay NaN).
    ``fused``: the merge inside the slice kernel (the last slice of a row merges it); the counter table
    must be all zero again afterwards."""
    rows = logits.shape[0]
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp_buf = poisoned((rows, k + 3), out_dtype, logits.device)
    index_buf = poisoned((rows, k + 3), torch.int64, logits.device)
    logp, index = logp_buf[:, 1 : 1 + k], index_buf[:, 1 : 1 + k]
    _launch_draft_topk(logits, k, logp, index, block=block, fused_merge=fused, index_offset=index_offset)
    if fused:
        assert int(counter_table("draft_topk fused merge", logits.device, 1).abs().sum()) == 0
    assert torch.isnan(logp_buf[:, 0]).all() and torch.isnan(logp_buf[:, 1 + k :]).all()
    untouched = poisoned((1,), torch.int64).item()
    assert (index_buf[:, 0] == untouched).all() and (index_buf[:, 1 + k :] == untouched).all()
    return logp.cpu(), index.cpu()


def assert_matches(got, want, tol: float, what: str = ""):
    logp, index = got
    want_logp, want_index = want
    assert torch.equal(index, want_index), f"{what}: indices differ\n{index}\n{want_index}"
    torch.testing.assert_close(
        logp.double(), want_logp.double(), rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "vocab,k", [(v, k) for v in (1, 7, 16, 64, 65, 333, 1000) for k in (1, 4, 8, 16) if k <= v]
)
def test_reference_matches_oracle(vocab, k):
    logits = mixed_logits(10, vocab, seed=vocab * 17 + k, dtype=torch.float64)
    logp, index = draft_topk_reference(logits, k)
    assert logp.dtype == torch.float64 and index.dtype == torch.int64
    assert_matches((logp, index), oracle_topk(logits, k), tol=1e-12, what=f"V{vocab} k{k}")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_reference_low_precision_inputs_give_float32(dtype):
    logits = mixed_logits(5, 300, seed=3, dtype=dtype)
    logp, index = draft_topk_reference(logits, 8)
    assert logp.dtype == torch.float32
    assert_matches((logp, index), oracle_topk(logits, 8), tol=1e-6, what=str(dtype))


def test_all_neg_inf_row_gives_nan_and_first_indices():
    logits = torch.tensor([[NEG_INF, NAN, NEG_INF, NAN, NEG_INF], [0.0, 1.0, 1.0, NAN, 1.0]])
    logp, index = torch.ops.treespec.draft_topk(logits, 3)
    assert torch.isnan(logp[0]).all()
    assert index.tolist() == [[0, 1, 2], [1, 2, 4]]
    torch.testing.assert_close(logp[1], torch.full((3,), 1.0 - math.log(1 + 3 * math.e)))


# --------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU, or CUDA when present)
# --------------------------------------------------------------------------------------------------

KERNEL_CASES = [
    # (rows, vocab, k, block): several slices per row, V % block != 0, slices shorter than k, V == k
    pytest.param(5, 1, 1, 64, id="R5-V1-k1"),
    pytest.param(5, 7, 4, 64, id="R5-V7-k4"),
    pytest.param(5, 16, 16, 16, id="R5-V16-k16-block16"),
    pytest.param(5, 17, 16, 16, id="R5-V17-k16-block16"),
    pytest.param(5, 65, 8, 64, id="R5-V65-k8"),
    pytest.param(5, 130, 16, 64, id="R5-V130-k16"),
    pytest.param(5, 200, 1, 64, id="R5-V200-k1"),
    pytest.param(1, 300, 8, 64, id="R1-V300-k8"),
    pytest.param(5, 700, 4, 256, id="R5-V700-k4"),
    pytest.param(1, 700, 16, 2048, id="R1-V700-k16-block2048"),
]


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
@pytest.mark.parametrize("rows,vocab,k,block", KERNEL_CASES)
def test_kernel_matches_oracle(rows, vocab, k, block, fused, kernel_device):
    logits = mixed_logits(rows, vocab, seed=vocab + k)
    got = run_launcher(logits.to(kernel_device), k, block, fused)
    assert_matches(got, oracle_topk(logits, k), tol=2e-6, what=f"R{rows} V{vocab} k{k}")


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
@pytest.mark.parametrize("dtype", (torch.float16, torch.float64), ids=str)
def test_kernel_input_dtypes(dtype, fused, kernel_device):
    logits = mixed_logits(5, 150, seed=8, dtype=dtype)
    got = run_launcher(logits.to(kernel_device), 4, 64, fused)
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_matches(got, oracle_topk(logits, 4), tol=1e-12 if dtype == torch.float64 else 2e-6)


def test_kernel_strided_rows(kernel_device):
    """Rows of a wider tensor (row stride 250) and a broadcast row (row stride 0)."""
    wide = mixed_logits(5, 250, seed=11)
    logits = wide[:, 37:237]
    assert logits.stride() == (250, 1)
    assert_matches(run_launcher(logits.to(kernel_device), 8, 64), oracle_topk(logits, 8), tol=2e-6)
    broadcast = wide[1:2, :90].expand(3, 90)
    assert_matches(run_launcher(broadcast.to(kernel_device), 4, 64), oracle_topk(broadcast, 4), tol=2e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
def test_kernel_ties_take_lower_index_across_slices(fused, kernel_device):
    """The same maximum in three slices, -inf ties, and NaN in front of a real value."""
    logits = torch.full((2, 150), NEG_INF)
    logits[0, [140, 70, 3]] = 5.0
    logits[0, [2, 100]] = 4.0
    logits[1, [0, 1]] = NAN
    logits[1, 120] = -1e30
    want_index = torch.tensor([[3, 70, 140, 2, 100, 0, 1, 4], [120, 0, 1, 2, 3, 4, 5, 6]])
    logp, index = run_launcher(logits.to(kernel_device), 8, 64, fused)
    assert torch.equal(index, want_index)
    assert torch.equal(oracle_topk(logits, 8)[1], want_index)
    lse = 5.0 + math.log(3 + 2 * math.exp(-1.0))
    want = torch.tensor([5.0] * 3 + [4.0] * 2, dtype=torch.float64) - lse
    torch.testing.assert_close(logp[0, :5].double(), want)
    assert torch.isneginf(logp[0, 5:]).all()
    assert logp[1, 0].item() == 0.0 and torch.isneginf(logp[1, 1:]).all()


def test_kernel_pos_inf_gives_nan_like_log_softmax(kernel_device):
    logits = mixed_logits(2, 70, seed=4)
    logits[:, 66] = float("inf")
    got = run_launcher(logits.to(kernel_device), 4, 64)
    assert_matches(got, oracle_topk(logits, 4), tol=2e-6)
    assert torch.isnan(got[0]).all() and (got[1][:, 0] == 66).all()


def test_kernel_rejects_bad_block():
    logits = torch.zeros(2, 40)
    out = (torch.empty(2, 8), torch.empty(2, 8, dtype=torch.int64))
    for block in (4, 48):
        with pytest.raises(ValueError, match="block"):
            _launch_draft_topk(logits, 8, *out, block=block)


def test_kernel_zero_rows(kernel_device):
    logits = torch.zeros(0, 40, device=kernel_device)
    out = (
        torch.empty(0, 4, device=kernel_device),
        torch.empty(0, 4, dtype=torch.int64, device=kernel_device),
    )
    _launch_draft_topk(logits, 4, *out, block=64)


# --------------------------------------------------------------------------------------------------
# The op: dispatch, validation, opcheck
# --------------------------------------------------------------------------------------------------


def test_op_dispatch_cpu_matches_reference():
    logits = mixed_logits(6, 500, seed=21)
    got = torch.ops.treespec.draft_topk(logits, 8)
    assert got[0].shape == (6, 8) and got[1].dtype == torch.int64
    assert_matches(got, draft_topk_reference(logits, 8), tol=0.0)


def test_opcheck():
    gen = torch.Generator().manual_seed(2)
    cases = ((torch.randn(3, 50, generator=gen), 4), (torch.randn(2, 16, generator=gen).double(), 16))
    for logits, k in cases:
        torch.library.opcheck(torch.ops.treespec.draft_topk.default, (logits, k))
    offset = torch.arange(50, dtype=torch.int64) * 2
    torch.library.opcheck(torch.ops.treespec.draft_topk.default, (cases[0][0], 4, offset))


@pytest.mark.parametrize(
    "logits,k,match",
    [
        (torch.zeros(2, 10), 0, r"k: expected 1 <= k <= 16, got 0"),
        (torch.zeros(2, 40), MAX_K + 1, r"k: expected 1 <= k <= 16, got 17"),
        (torch.zeros(2, 5), 6, r"k: k = 6 exceeds the vocabulary size V = logits.shape\[1\] = 5"),
        (torch.zeros(10), 4, r"logits: expected a 2-d tensor \[R, V\]"),
        (torch.zeros(2, 3, 10), 4, r"logits: expected a 2-d tensor \[R, V\]"),
        (torch.zeros(2, 10, dtype=torch.int64), 4, r"logits: expected dtype"),
        (torch.zeros(2, 20)[:, ::2], 4, r"logits: the last dim must have stride 1"),
        (torch.zeros(10, 3).t(), 2, r"logits: the last dim must have stride 1"),
    ],
    ids=["k0", "k17", "k-over-V", "1d", "3d", "int64", "stride2", "transposed"],
)
def test_op_rejects_bad_input(logits, k, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.draft_topk(logits, k)
    with pytest.raises(ValueError, match=match):  # the fake (meta) path validates the same way
        meta = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device="meta")
        torch.ops.treespec.draft_topk(meta, k)


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16, torch.float64), ids=str)
@pytest.mark.parametrize("vocab", (32000, 128256))
@pytest.mark.parametrize("k", (4, 8))
def test_gpu_op_matches_reference(k, vocab, dtype):
    gen = torch.Generator().manual_seed(vocab + k)
    logits = (4 * torch.randn(16, vocab, generator=gen)).to(dtype)
    logits[3] = torch.randint(-3, 3, (vocab,), generator=gen).to(dtype)  # ties across slices
    logits[5, ::3] = NAN
    logits[6] = NEG_INF
    logits[7, : vocab - 3] = NEG_INF  # top-k reaches into -inf ties
    logp, index = torch.ops.treespec.draft_topk(logits.cuda(), k)
    assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert_matches((logp.cpu(), index.cpu()), draft_topk_reference(logits, k), tol=tol, what=str(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["0", "1"], ids=["merge-launch", "fused-merge"])
def test_gpu_cuda_graph_replay_with_new_logits(monkeypatch, fused):
    """Capture once; copy new logits into the bound buffer; each replay matches the reference (with the fused
    merge, the counters must come back to zero for every replay, or a row keeps the NaN written first)."""
    monkeypatch.setenv("TREECOMPILE_TOPK_FUSED_MERGE", fused)
    gen = torch.Generator().manual_seed(5)
    logits_buf = torch.zeros(16, 32000, dtype=torch.bfloat16, device="cuda")
    op = torch.ops.treespec.draft_topk
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(logits_buf, 8)  # warm-up compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logp, index = op(logits_buf, 8)
    for trial in range(3):
        new = (3 * torch.randn(16, 32000, generator=gen)).bfloat16()
        new[trial] = NEG_INF
        logits_buf.copy_(new)
        logp.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = draft_topk_reference(new, 8)
        assert_matches((logp.cpu(), index.cpu()), want, tol=2e-5, what=f"replay {trial}")


@pytest.mark.gpu
def test_gpu_opcheck():
    logits = torch.randn(3, 5000, device="cuda")
    torch.library.opcheck(torch.ops.treespec.draft_topk.default, (logits, 8))


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
def test_kernel_index_offset_maps_each_index(fused, kernel_device):
    """``index_offset`` (EAGLE-3's d2t, here a strided view): each returned index i is i + offset[i], added in
    the merge's store; the log-probs are unchanged."""
    rows, vocab, k = 5, 300, 8
    logits = mixed_logits(rows, vocab, seed=21)
    table = torch.randint(0, 5000, (vocab, 2), generator=torch.Generator().manual_seed(2))
    offset = table[:, 1]  # stride 2
    got = run_launcher(logits.to(kernel_device), k, 64, fused, offset.to(kernel_device))
    want_logp, want_index = oracle_topk(logits, k)
    assert_matches(got, (want_logp, want_index + offset[want_index]), tol=2e-6)
    ref = draft_topk_reference(logits, k, offset)
    assert torch.equal(ref[1], want_index + offset[want_index])


def test_op_index_offset_on_cpu_and_bad_offsets():
    logits = mixed_logits(3, 40, seed=5)
    offset = torch.arange(40) * 3
    logp, index = torch.ops.treespec.draft_topk(logits, 4, offset)
    want_logp, want_index = draft_topk_reference(logits, 4)
    assert torch.equal(index, want_index * 4) and torch.equal(logp, want_logp)
    for bad, match in ((offset[:39], r"index_offset: expected one offset per vocabulary entry \(V = 40\)"),
                       (offset.int(), "index_offset: expected dtype torch.int64"),
                       (offset.view(4, 10), r"index_offset: expected a 1-d tensor")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            torch.ops.treespec.draft_topk(logits, 4, bad)
