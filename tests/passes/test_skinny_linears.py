"""skinny_linears: few-row 16-bit linears become treespec::skinny_linear calls; the rest stay F.linear.

The op's Triton path is CUDA-only; here the pass is told CPU counts too (its CPU path is the F.linear
reference), so the rewrite itself, the cases it leaves alone, and the outputs are checked on this machine.
The op's kernel is checked in tests/ops/test_skinny_linear.py; a CUDA generate with the option on in
tests/runtime/test_speculator_gpu.py.
"""

import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from treecompile.ops import skinny_linear as skinny_op
from treecompile.ops.skinny_linear import linear_rows, measured_tiles, register_tiles
from treecompile.passes.skinny_linears import skinny_linears

skinny_module = importlib.import_module("treecompile.passes.skinny_linears")  # the package attribute is the pass

from test_outer_products import capture

pytestmark = pytest.mark.usefixtures("one_thread")

ON = SimpleNamespace(binding=SimpleNamespace(skinny_linears=True))
OFF = SimpleNamespace(binding=SimpleNamespace(skinny_linears=False))


def ops_in(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def three_linears(x, w1, w2, b2, w3):
    h = F.linear(x, w1)  # [B, T, 48]
    h = torch.nn.functional.linear(h.relu(), w2, b2)  # with a bias
    return F.linear(h, w3.t().contiguous().t())  # a weight with a strided last dim: left alone


def inputs(rows, dtype=torch.float16):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 32, generator=g).to(dtype)
    w1 = (torch.randn(48, 32, generator=g) / 6).to(dtype)
    w2 = (torch.randn(24, 48, generator=g) / 7).to(dtype)
    b2 = torch.randn(24, generator=g).to(dtype)
    w3 = (torch.randn(8, 24, generator=g) / 5).to(dtype)
    return x, w1, w2, b2, w3


@pytest.fixture
def cpu_counts(monkeypatch):
    """The pass runs on CPU graphs, and the three test shapes count as measured Triton wins in every band."""
    monkeypatch.setattr(skinny_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(skinny_op, "_MEASURED", dict(skinny_op._MEASURED))
    for M in (1, 8, 64):
        for N, K in ((48, 32), (24, 48), (8, 24)):
            skinny_op._MEASURED[(M, N, K)] = (16, 32, 4, 3, 3.0, 4.0)


def test_only_shapes_measured_faster_than_cublas_are_rewritten(cpu_counts):
    args = inputs(8)
    skinny_op._MEASURED[(8, 24, 48)] = (16, 32, 4, 3, 4.0, 4.0)  # a tie: cuBLAS keeps it
    del skinny_op._MEASURED[(1, 48, 32)], skinny_op._MEASURED[(8, 48, 32)], skinny_op._MEASURED[(64, 48, 32)]
    gm = skinny_linears(capture(three_linears, *args), ON)
    assert torch.ops.treespec.skinny_linear.default not in ops_in(gm)


def test_measured_tiles_bands_and_nearest_row_count(monkeypatch):
    monkeypatch.setattr(skinny_op, "_MEASURED", {})
    assert measured_tiles(8, 100, 200) is None  # never swept: cuBLAS
    row = lambda M, us, bn: dict(M=M, N=100, K=200, cublas_us=10.0, best=dict(block_n=bn, block_k=64, warps=4, stages=3, us=us))  # noqa: E731
    assert register_tiles([row(1, 9.0, 16), row(4, 9.0, 32), row(64, 11.0, 64), dict(M=8, N=1, K=1, best=None)]) == 3
    assert measured_tiles(1, 100, 200).block_n == 16
    cfg = measured_tiles(12, 100, 200)  # the 2-16 band: M=4's tiles, a 16-row tile
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages) == (16, 32, 64, 3)
    assert measured_tiles(40, 100, 200) is None  # the 17-64 band: cuBLAS was faster there
    assert measured_tiles(8, 100, 201) is None
    register_tiles([row(64, 9.0, 64)])  # a later sweep replaces the entry
    assert measured_tiles(40, 100, 200).block_m == 64


def test_measured_gemv_kinds(monkeypatch):
    """A sweep's gemv / gemv_pdl winners come back as gemv configs for their band's row counts <= 8;
    above 8 rows an entry swept at <= 8 does not stand in; a bad kind is refused by name."""
    monkeypatch.setattr(skinny_op, "_MEASURED", {})
    row = lambda M, kind: dict(M=M, N=100, K=200, cublas_us=10.0, best=dict(block_n=4, block_k=128, warps=8, stages=2, us=8.0, kind=kind))  # noqa: E731
    assert register_tiles([row(1, "gemv_pdl"), row(4, "gemv")]) == 2
    cfg = measured_tiles(1, 100, 200)
    assert (cfg.gemv, cfg.pdl, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps) == (True, True, 1, 4, 128, 8)
    cfg = measured_tiles(7, 100, 200)  # M=4's gemv entry, rows rounded up to 8
    assert (cfg.gemv, cfg.pdl, cfg.block_m) == (True, False, 8)
    assert measured_tiles(12, 100, 200) is None  # same band, but a gemv swept at <= 8 rows serves <= 8: cuBLAS
    with pytest.raises(ValueError, match="best.kind must be one of"):
        register_tiles([row(1, "wgmma")])
    with pytest.raises(ValueError, match="needs M <= 16"):
        register_tiles([row(17, "gemv")])


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_few_row_linears_become_skinny_calls_with_identical_values(cpu_counts, rows):
    args = inputs(rows)
    gm = capture(three_linears, *args)
    (want,) = gm(*args)
    before = ops_in(gm).count(torch._C._nn.linear)
    gm = skinny_linears(gm, ON)
    targets = ops_in(gm)
    assert targets.count(torch.ops.treespec.skinny_linear.default) == 2
    assert targets.count(torch._C._nn.linear) == before - 2  # the strided-weight one stays
    (got,) = gm(*args)
    assert got.shape == want.shape
    assert torch.equal(got, want)  # on the CPU the op is F.linear itself
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.treespec.skinny_linear.default]
    assert [n.args[3] for n in calls] == [True, True]  # graph-input weights: a dependent launch may prefetch


def test_a_weight_computed_in_the_graph_is_not_marked_constant(cpu_counts):
    """The gemv kernel's dependent launch reads its first weight tile before waiting on the previous
    kernel only for constant weights; a weight made inside the graph may be that kernel's output."""

    def scaled(x, w1):
        h = x.relu()  # x used first: the captured graph's inputs keep the (x, w1) order
        return F.linear(h, w1 * 2)

    x, w1 = inputs(4)[:2]
    gm = skinny_linears(capture(scaled, x, w1), ON)
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.treespec.skinny_linear.default]
    assert call.args[3] is False
    torch.testing.assert_close(gm(x, w1)[0], F.linear(x.relu(), w1 * 2))


def test_batch_rows_need_their_own_measurement_and_past_256_stay_linear(cpu_counts, monkeypatch):
    """65-256 rows (a batch of trees) are rewritten only once their band was measured; > 256 never."""
    args = inputs(65)  # the 64-row entries do not stand in
    gm = skinny_linears(capture(three_linears, *args), ON)
    assert torch.ops.treespec.skinny_linear.default not in ops_in(gm)
    for N, K in ((48, 32), (24, 48), (8, 24)):
        skinny_op._MEASURED[(128, N, K)] = (16, 32, 4, 3, 3.0, 4.0, "dot", 1, 0, 64)
    (want,) = capture(three_linears, *args)(*args)
    gm = skinny_linears(capture(three_linears, *args), ON)
    assert ops_in(gm).count(torch.ops.treespec.skinny_linear.default) == 2
    assert torch.equal(gm(*args)[0], want)
    args = inputs(skinny_op.MAX_ROWS + 1)
    skinny_op._MEASURED.update({(skinny_op.MAX_ROWS + 1, N, K): (16, 32, 4, 3, 3.0, 4.0) for N, K in ((48, 32), (24, 48))})
    gm = skinny_linears(capture(three_linears, *args), ON)
    assert torch.ops.treespec.skinny_linear.default not in ops_in(gm)


def test_float32_and_cpu_stay_linear(cpu_counts, monkeypatch):
    args = inputs(8, torch.float32)  # float32 keeps cuBLAS (HF's own rounding)
    gm = skinny_linears(capture(three_linears, *args), ON)
    assert torch.ops.treespec.skinny_linear.default not in ops_in(gm)
    monkeypatch.setattr(skinny_module, "_DEVICE_TYPES", ("cuda",))
    args = inputs(8)
    gm = skinny_linears(capture(three_linears, *args), ON)
    assert torch.ops.treespec.skinny_linear.default not in ops_in(gm)


def test_off_unless_the_binding_asks(cpu_counts):
    args = inputs(4)
    gm = skinny_linears(capture(three_linears, *args), OFF)
    assert torch.ops.treespec.skinny_linear.default not in ops_in(gm)
    gm = skinny_linears(capture(three_linears, *args), SimpleNamespace())
    assert torch.ops.treespec.skinny_linear.default not in ops_in(gm)


def test_linear_rows_falls_back_to_f_linear_off_cuda():
    x, w1, *_ = inputs(3)
    assert torch.equal(linear_rows(x, w1), F.linear(x, w1))
    assert torch.equal(linear_rows(x.float(), w1.float(), torch.ones(48)), F.linear(x.float(), w1.float(), torch.ones(48)))


def test_speculator_refuses_skinny_linears_on_cpu():
    from test_rewrite_attention import tiny_model

    from treecompile.drafter import EagleDrafter
    from treecompile.speculator import TreeSpeculator

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="skinny_linears: runs 16-bit CUDA linears only"):
        TreeSpeculator(model, EagleDrafter.for_target(model, seed=0), topk=2, steps=2, num_nodes=4,
                       max_batch_size=1, max_seq_len=64, skinny_linears=True)  # fmt: skip


def test_drafter_skinny_linears_keeps_its_outputs_on_cpu():
    """On the CPU linear_rows is F.linear: the swapped head computes exactly what it did."""
    from test_rewrite_attention import tiny_model

    from treecompile.drafter import EagleDrafter

    model = tiny_model("llama")
    head = EagleDrafter.for_target(model, seed=0)
    x = torch.randn(2, 3, head.fc.in_features, dtype=head.fc.weight.dtype)
    want = head.project(x)
    head.skinny_linears()
    head.skinny_linears()  # idempotent
    fused = head.midlayer.self_attn.linear  # the fused q/k/v weight: a constant, so prefetchable
    assert fused.func is linear_rows and fused.keywords == dict(constant_weight=True)
    assert torch.equal(head.project(x), want)
