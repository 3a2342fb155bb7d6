"""treespec::vocab_argmax: the Triton kernels (interpreter on CPU, the device on GPU) against torch.argmax.

Rows mix the cases where an argmax can go wrong: ties within a slice and across slices (the first index wins),
NaN (greater than everything; the first NaN wins, also across slices), all -inf rows (index 0), +inf, and a
vocabulary that is not a whole number of slices. Small ``block`` values give several slices per row.
"""

from __future__ import annotations

import pytest
import torch
from conftest import poisoned
from treecompile.ops.vocab_argmax import _launch_vocab_argmax

pytestmark = pytest.mark.usefixtures("one_thread")


def hard_rows(vocab: int, seed: int, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(vocab, generator=gen, dtype=torch.float64) for _ in range(8)]
    rows[1] = torch.randint(-2, 3, (vocab,), generator=gen).double()  # ties everywhere
    rows[2][:] = float("-inf")  # all -inf: index 0
    rows[3][vocab // 2] = float("nan")  # one NaN beats every number
    if vocab > 3:
        rows[4][[1, vocab - 1]] = float("nan")  # two NaN in different slices: the first
        rows[5][[vocab - 2, 2]] = float("inf")  # +inf ties: the first
    rows[6][:] = float("nan")  # all NaN: index 0
    rows[7][:] = 5.0  # one value: index 0
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("vocab,block", [(1, 1), (5, 2), (37, 8), (100, 16), (300, 64)])
def test_matches_torch_argmax(dtype, vocab, block, kernel_device):
    logits = hard_rows(vocab, seed=vocab, dtype=dtype)
    index = poisoned((logits.shape[0],), torch.int64, kernel_device)
    _launch_vocab_argmax(logits.to(kernel_device), index, block=block)
    assert torch.equal(index.cpu(), torch.argmax(logits, dim=-1))


def test_default_block_and_a_strided_row_view(kernel_device):
    base = hard_rows(300, seed=3, dtype=torch.float32)
    wide = torch.full((8, 400), 1e30)  # row stride 400: the op must read only each row's first 300 entries
    wide[:, :300] = base
    logits = wide.to(kernel_device)[:, :300]  # sliced where it lives, so the launch sees the stride
    index = poisoned((8,), torch.int64, kernel_device)
    _launch_vocab_argmax(logits, index)
    assert torch.equal(index.cpu(), torch.argmax(base, dim=-1))


def test_op_on_cpu_is_the_reference_and_traces():
    logits = hard_rows(50, seed=1, dtype=torch.float32)
    assert torch.equal(torch.ops.treespec.vocab_argmax(logits), torch.argmax(logits, -1))
    compiled = torch.compile(lambda x: torch.ops.treespec.vocab_argmax(x) + 1, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(logits), torch.argmax(logits, -1) + 1)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: torch.zeros(2, 3, 4), "2-d"),
        (lambda: torch.zeros(2, 0), "at least 1"),
        (lambda: torch.zeros(2, 4, dtype=torch.int64), "dtype"),
        (lambda: torch.zeros(4, 2).t(), "stride 1"),
    ],
    ids=["3d", "empty-vocab", "int", "transposed"],
)
def test_bad_input_names_the_argument(make, match):
    with pytest.raises(ValueError, match=f"logits.*{match}"):
        torch.ops.treespec.vocab_argmax(make())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (64, 49152), (3, 128256), (5, 1000)])
def test_on_cuda_equals_torch_argmax_and_replays_in_a_graph(rows, vocab):
    gen = torch.Generator().manual_seed(rows)
    base = torch.randn(rows, vocab, generator=gen).to("cuda", torch.bfloat16)
    base[0, 7] = base[0, vocab - 3] = base[0].max() + 1  # a tie across slices
    if rows > 1:
        base[1, [vocab - 1, min(4097, vocab // 2)]] = float("nan")
    logits = base.clone()
    out = torch.ops.treespec.vocab_argmax(logits)
    assert torch.equal(out, torch.argmax(logits, -1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.treespec.vocab_argmax(logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.treespec.vocab_argmax(logits)
    for seed in range(3):  # new values in the bound buffer, same graph
        logits.copy_(torch.randn(rows, vocab, generator=gen.manual_seed(seed)).to("cuda", torch.bfloat16))
        graph.replay()
        assert torch.equal(captured, torch.argmax(logits, -1))
