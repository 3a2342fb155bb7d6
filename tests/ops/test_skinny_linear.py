"""treespec::skinny_linear: the Triton kernel (interpreter on CPU, the device on GPU) against a float64
F.linear, over row counts 1..256 (past 64: several row blocks), K not a multiple of the tile, N not a multiple of the slice, biases, strided
rows, the residual-add epilogue, and the op's boundary checks. Outputs are poisoned with NaN so an unwritten element
fails. bfloat16 runs on the GPU only: the Triton 3.x interpreter's tl.dot misreads bfloat16 operands (a 16 x 16
bf16 dot there is off by ~1e10; float16 and float32 are exact), and its float32 -> bfloat16 cast truncates where
the GPU rounds to nearest even; the GPU is not affected."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import poisoned
from treecompile.ops.skinny_linear import (
    MAX_ROWS, _launch_skinny_linear, choose_skinny_config, gemv_config, skinny_linear_reference,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(M, N, K, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check(out, x, w, b):
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-5 if x.dtype == torch.float32 else 2e-2
    assert not out.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "M,N,K,bias",
    [(1, 40, 64, False), (3, 17, 50, True), (16, 64, 128, False), (20, 33, 96, True), (64, 48, 200, False)],
)
def test_matches_float64_linear(dtype, M, N, K, bias, kernel_device):
    d = kernel_device
    x, w, b = _inputs(M, N, K, dtype, bias, seed=M * 1000 + N)
    out = poisoned((M, N), dtype, d)
    _launch_skinny_linear(x.to(d), w.to(d), None if b is None else b.to(d), out)
    _check(out.cpu(), x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("M,N,K,bias,block_m", [(65, 24, 40, True, None), (96, 33, 72, False, None),
                                                (130, 20, 50, True, 32), (256, 17, 64, False, 128)])  # fmt: skip
def test_a_batch_of_trees_runs_in_row_blocks(dtype, M, N, K, bias, block_m, kernel_device):
    """Past 64 rows (a batch of trees' verify) the tiles repeat over row blocks (64 by default; a measured
    entry may pick another): the last block is partial, every row and column is written once."""
    from treecompile.ops.skinny_linear import ROW_BLOCK

    d = kernel_device
    x, w, b = _inputs(M, N, K, dtype, bias, seed=M + N)
    cfg = choose_skinny_config(M, N, K) if block_m is None else choose_skinny_config(M, N, K, block_m=block_m)
    assert cfg.block_m == (block_m or ROW_BLOCK) and M > cfg.block_m  # several row blocks
    out = poisoned((M, N), dtype, d)
    _launch_skinny_linear(x.to(d), w.to(d), None if b is None else b.to(d), out, config=cfg)
    _check(out.cpu(), x, w, b)


def test_batch_rows_stay_on_cublas_until_measured(monkeypatch):
    """A 65-256-row shape uses the Triton tiles only from a measurement of its own band: the 64-row entries
    (one tree's verify) do not stand in for a batch of trees. A band-3 sweep row brings its row block."""
    from treecompile.ops import skinny_linear

    below_band3 = {key: v for key, v in skinny_linear._MEASURED.items() if key[0] <= 64}
    monkeypatch.setattr(skinny_linear, "_MEASURED", below_band3)
    assert skinny_linear.measured_tiles(64, 960, 576) is not None  # SmolLM2's fused qkv, one tree
    assert skinny_linear.measured_tiles(96, 960, 576) is None  # four trees of 24 nodes: not swept
    row = dict(M=128, N=960, K=576, cublas_us=6.0, best=dict(block_m=128, block_n=32, block_k=64, warps=4,
                                                             stages=3, us=4.0))  # fmt: skip
    assert skinny_linear.register_tiles([row]) == 1
    cfg = skinny_linear.measured_tiles(96, 960, 576)  # the nearest swept M of the band stands in
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.gemv) == (128, 32, 64, False)
    assert skinny_linear.measured_tiles(64, 960, 576).block_m == 64  # band 2 keeps one tile of every row
    row["best"] = dict(row["best"], us=6.0)  # no faster than cuBLAS: stays there
    skinny_linear.register_tiles([row])
    assert skinny_linear.measured_tiles(96, 960, 576) is None
    row["best"] = dict(row["best"], us=4.0, block_m=48)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        skinny_linear.register_tiles([row])


def test_a_gemv_entry_past_8_rows_needs_a_sweep_past_8_rows(monkeypatch):
    """The gemv kernel takes up to 16 rows (a (4, 4, 16) verify), but a gemv winner swept at <= 8 rows serves
    <= 8 rows only: 9-16 rows take the band's MMA entry unless a 9-16-row gemv entry exists; no gemv entry
    takes past GEMV_MAX_ROWS."""
    from treecompile.ops import skinny_linear

    monkeypatch.setattr(skinny_linear, "_MEASURED", {})

    def row(M, kind, us):
        best = dict(block_n=8 if kind != "dot" else 32, block_k=128, warps=4, stages=3, us=us, kind=kind)
        return dict(M=M, N=96, K=512, cublas_us=10.0, best=best)

    assert skinny_linear.register_tiles([row(8, "gemv_pdl", 5.0), row(16, "dot", 6.0)]) == 2
    assert skinny_linear.measured_tiles(6, 96, 512).gemv
    for M in (9, 12, 16):
        cfg = skinny_linear.measured_tiles(M, 96, 512)
        assert not cfg.gemv and cfg.block_n == 32, M  # the 16-row MMA entry, not the 8-row gemv
    assert skinny_linear.register_tiles([row(12, "gemv_pdl", 4.0)]) == 1
    cfg = skinny_linear.measured_tiles(13, 96, 512)  # nearest: the 12-row gemv
    assert cfg.gemv and cfg.pdl and cfg.block_m == 16
    assert not skinny_linear.measured_tiles(16, 96, 512).gemv  # its own 16-row MMA entry is nearer
    assert skinny_linear.measured_tiles(17, 96, 512) is None  # band 2: nothing swept there
    with pytest.raises(ValueError, match=f"needs M <= {skinny_linear.GEMV_MAX_ROWS}"):
        skinny_linear.register_tiles([row(32, "gemv", 4.0)])


def test_the_shipped_table_sends_smollm2_batch_verify_where_it_was_measured_faster():
    """SmolLM2's 65-256-row GEMMs (batch 4 or 16 of trees) from the sweep: Triton row blocks where they beat
    cuBLAS, cuBLAS where it won (gate/up at 96 rows, the LM head), nothing past 256 rows."""
    from treecompile.ops.skinny_linear import measured_tiles

    qkv = measured_tiles(128, 960, 576)  # four trees of 32 nodes
    assert qkv is not None and (qkv.block_m, qkv.block_n, qkv.block_k) == (64, 16, 128)
    assert measured_tiles(80, 576, 1536).block_m == 32  # the nearest swept M (96) stands in
    assert measured_tiles(96, 3072, 576) is None and measured_tiles(128, 3072, 576) is not None
    assert all(measured_tiles(m, 49152, 576) is None for m in (96, 128, 256))
    assert measured_tiles(257, 960, 576) is None and measured_tiles(512, 960, 576) is None


@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 16, 16), (32, 32, 64), (64, 16, 32)])
def test_every_tile_shape_is_exact_enough(block_m, block_n, block_k, kernel_device):
    d = kernel_device
    x, w, b = _inputs(37, 70, 90, torch.float32, True, seed=block_n)
    out = poisoned((37, 70), torch.float32, d)
    cfg = choose_skinny_config(37, 70, 90, block_m=block_m, block_n=block_n, block_k=block_k)
    _launch_skinny_linear(x.to(d), w.to(d), b.to(d), out, config=cfg)
    _check(out.cpu(), x, w, b)


def test_strided_rows_in_and_out(kernel_device):
    d = kernel_device
    x_wide, w, _ = _inputs(5, 24, 40, torch.float32, False)
    x = torch.cat([x_wide, torch.full((5, 8), float("nan"))], 1).to(d)[:, :40]  # row stride 48, NaN past K
    out_wide = poisoned((5, 30), torch.float32, d)
    out = out_wide[:, :24]
    _launch_skinny_linear(x, w.to(d), None, out)
    _check(out.cpu(), x_wide, w, None)
    assert out_wide[:, 24:].isnan().all(), "wrote past the output's columns"


def test_weight_rows_view(kernel_device):
    """A fused projection hands out row slices of one weight: contiguous rows, a storage offset."""
    d = kernel_device
    x, w, _ = _inputs(2, 96, 32, torch.float32, False)
    part = w[32:64]
    out = poisoned((2, 32), torch.float32, d)
    _launch_skinny_linear(x.to(d), w.to(d)[32:64], None, out)  # sliced where it lives: a storage offset there too
    _check(out.cpu(), x, part, None)


def test_bias_column_of_a_wider_table(kernel_device):
    """A bias handed over as a column of a wider table (stride 8): the kernel must follow its stride (it read
    bias[n] as if contiguous, and so added the table's other columns)."""
    x, w, b = _inputs(3, 20, 24, torch.float32, True)
    table = torch.full((20, 8), 1e6)
    table[:, 3] = b
    bias = table[:, 3]
    assert bias.stride() == (8,)
    d = kernel_device
    out = poisoned((3, 20), torch.float32, d)
    _launch_skinny_linear(x.to(d), w.to(d), bias.to(d), out)
    _check(out.cpu(), x, w, b)


@pytest.mark.parametrize("pipeline", [False, True], ids=["double-buffer", "pipelined"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "M,N,K,bias,block_n,block_k",
    [(1, 40, 64, False, 8, 32), (3, 17, 50, True, 4, 16), (8, 33, 96, True, 16, 64), (5, 9, 200, False, 2, 128),
     (16, 13, 72, True, 4, 32), (11, 20, 40, False, 8, 16)],
)
def test_gemv_matches_float64_linear(dtype, M, N, K, bias, block_n, block_k, pipeline, kernel_device):
    """The multiply-add kernel, both loops (the register double buffer, and the compiler-pipelined one): N
    not a multiple of the slice, K not a multiple of the step (the masked last tile), rows padded up to a
    power of two."""
    d = kernel_device
    x, w, b = _inputs(M, N, K, dtype, bias, seed=M * 100 + N)
    out = poisoned((M, N), dtype, d)
    cfg = gemv_config(M, N, K, block_n=block_n, block_k=block_k, pipeline=pipeline)
    _launch_skinny_linear(x.to(d), w.to(d), None if b is None else b.to(d), out, config=cfg)
    _check(out.cpu(), x, w, b)


def test_gemv_strided_rows_views_and_pdl_config(kernel_device):
    """Strided x / out rows, a weight row view, a bias column; a ``pdl`` config runs too (the interpreter
    ignores it; on the GPU it is a dependent launch after the previous kernel)."""
    d = kernel_device
    x_wide, w_all, b = _inputs(3, 60, 40, torch.float32, True)
    x = torch.cat([x_wide, torch.full((3, 8), float("nan"))], 1)[:, :40]
    w = w_all[20:44]
    table = torch.full((60, 4), 1e6)
    table[:, 1] = b
    out_wide = poisoned((3, 30), torch.float32, d)
    out = out_wide[:, :24]
    cfg = gemv_config(3, 24, 40, block_n=8, block_k=16, pdl=True)
    _launch_skinny_linear(x.to(d), w.to(d), table[20:44, 1].to(d), out, config=cfg)
    _check(out.cpu(), x_wide, w, b[20:44])
    assert out_wide[:, 24:].isnan().all(), "wrote past the output's columns"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "M,N,K,bias,gemv,split_k,block_k",
    [(1, 40, 130, False, True, 4, 32), (3, 17, 50, True, True, 7, 16), (5, 24, 200, True, False, 3, 32),
     (20, 33, 96, False, False, 2, 16), (64, 48, 200, True, False, 5, 16), (8, 70, 1000, True, True, 16, 32),
     (2, 30, 130, True, "pipelined", 3, 32)],
)  # fmt: skip
def test_split_k_matches_float64_linear(dtype, M, N, K, bias, gemv, split_k, block_k, kernel_device):
    """Split-K (both kernels): splits of whole K tiles, a masked last tile, splits past K that hold no
    tile (3 x 50 over 7 splits of 16: 3 empty), N not a multiple of the slice. The second call gives the
    same bits (the partials are summed in split order) and each call leaves the counter table zeroed."""
    from treecompile.ops._common import counter_table

    d = kernel_device
    x, w, b = (t.to(d) if t is not None else None for t in _inputs(M, N, K, dtype, bias, seed=M * 10 + K))
    make = gemv_config if gemv else choose_skinny_config
    cfg = make(M, N, K, block_k=block_k, split_k=split_k, **(dict(pipeline=True) if gemv == "pipelined" else {}))
    outs = []
    for _ in range(2):
        out = poisoned((M, N), dtype, d)
        _launch_skinny_linear(x, w, b, out, config=cfg)
        counters = counter_table("skinny_linear split-K", x.device, 1)
        assert int(counters.abs().sum()) == 0, "a split-K launch left a counter set"
        outs.append(out)
    _check(outs[0].cpu(), x.cpu(), w.cpu(), None if b is None else b.cpu())
    assert torch.equal(outs[0], outs[1])


def test_split_k_in_the_measured_table():
    """A sweep row with ``split_k`` or ``l2_prefetch`` reaches the launch config; bad counts are refused by name."""
    from treecompile.ops import skinny_linear

    row = dict(M=64, N=96, K=512, cublas_us=10.0, best=dict(block_n=32, block_k=64, warps=4, stages=3, us=8.0,
                                                           split_k=4))  # fmt: skip
    assert skinny_linear.register_tiles([row]) == 1
    cfg = skinny_linear.measured_tiles(64, 96, 512)
    assert (cfg.split_k, cfg.block_n, cfg.block_k, cfg.gemv) == (4, 32, 64, False)
    row["best"] = dict(row["best"], kind="gemv_pdl", split_k=2)
    row["M"] = 1
    skinny_linear.register_tiles([row])
    cfg = skinny_linear.measured_tiles(1, 96, 512)
    assert (cfg.split_k, cfg.gemv, cfg.pdl, cfg.pipeline) == (2, True, True, False)
    skinny_linear.register_tiles([dict(row, best=dict(row["best"], pipeline=True))])
    assert skinny_linear.measured_tiles(1, 96, 512).pipeline
    with pytest.raises(ValueError, match="best.pipeline is for the gemv kernels"):
        skinny_linear.register_tiles([dict(row, best=dict(row["best"], kind="dot", pipeline=True))])
    row["best"] = dict(row["best"], l2_prefetch=4)
    skinny_linear.register_tiles([row])
    assert skinny_linear.measured_tiles(1, 96, 512).l2_prefetch == 4
    row["best"] = dict(row["best"], l2_prefetch=3)
    with pytest.raises(ValueError, match="l2_prefetch must be 0 or a power of two"):
        skinny_linear.register_tiles([row])
    row["best"] = dict(row["best"], l2_prefetch=0, split_k=17)
    with pytest.raises(ValueError, match="split_k must be in 1..16"):
        skinny_linear.register_tiles([row])
    x, w, _ = _inputs(2, 16, 16, torch.float32, False)
    with pytest.raises(ValueError, match="split_k must be in 1..16"):
        _launch_skinny_linear(x, w, None, torch.empty(2, 16), config=gemv_config(2, 16, 16, split_k=0))


def test_l2_prefetch_env_is_checked_and_changes_no_result(monkeypatch, kernel_device):
    """TREECOMPILE_SKINNY_L2_PREFETCH (A/B runs: weight tiles hinted into L2 before the dependency wait) is 0 or
    a power of two <= 16, refused by name otherwise; the hints never change a result (GPU: the hints run; the
    interpreter drops them)."""
    from treecompile.ops.skinny_linear import L2_PREFETCH_ENV

    d = kernel_device
    x, w, b = (t.to(d) for t in _inputs(3, 40, 300, torch.float32, True))
    for cfg in (choose_skinny_config(3, 40, 300), gemv_config(3, 40, 300, block_k=64)):
        want = poisoned((3, 40), torch.float32, d)
        _launch_skinny_linear(x, w, b, want, config=cfg)
        monkeypatch.setenv(L2_PREFETCH_ENV, "4")
        out = poisoned((3, 40), torch.float32, d)
        _launch_skinny_linear(x, w, b, out, config=cfg)
        assert torch.equal(out, want)
        for bad in ("3", "32", "x"):
            monkeypatch.setenv(L2_PREFETCH_ENV, bad)
            with pytest.raises(ValueError, match=L2_PREFETCH_ENV):
                _launch_skinny_linear(x, w, b, out, config=cfg)
        monkeypatch.delenv(L2_PREFETCH_ENV)


def test_gemv_config_refuses_too_many_rows():
    with pytest.raises(ValueError, match="M: the gemv kernel takes 1..16 rows"):
        gemv_config(17, 16, 16)
    x, w, _ = _inputs(4, 16, 16, torch.float32, False)
    with pytest.raises(ValueError, match="block_m=2 must cover"):
        _launch_skinny_linear(x, w, None, torch.empty(4, 16), config=gemv_config(2, 16, 16))


def test_op_on_cpu_is_the_reference_and_traces():
    x, w, b = _inputs(4, 12, 20, torch.float32, True)
    assert torch.equal(torch.ops.treespec.skinny_linear(x, w, b), F.linear(x, w, b))
    compiled = torch.compile(lambda a, c: torch.ops.treespec.skinny_linear(a, c) * 2, backend="aot_eager",
                             fullgraph=True)  # fmt: skip
    assert torch.equal(compiled(x, w), F.linear(x, w) * 2)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8), None), f"1..{MAX_ROWS} rows"),
        (lambda: (torch.zeros(0, 8), torch.zeros(4, 8), None), "rows"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 9), None), r"weight: expected \[N, K=8\]"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16), None), "weight: expected dtype"),
        (lambda: (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32), None), "x: expected dtype"),
        (lambda: (torch.zeros(8, 2).t(), torch.zeros(4, 8), None), "x: the last dim must have stride 1"),
        (lambda: (torch.zeros(2, 8), torch.zeros(8, 4).t(), None), "weight: the last dim must have stride 1"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(5)), r"bias: expected \[N=4\]"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4, 1)), "bias: expected a 1-d"),
        (lambda: (torch.zeros(8), torch.zeros(4, 8), None), "x: expected a 2-d"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), None, False, torch.zeros(2, 5)),
         r"residual: expected \[M=2, N=4\]"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), None, False, torch.zeros(4, 4)),
         r"residual: expected \[M=2, N=4\]"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), None, False, torch.zeros(8)), "residual: expected a 2-d"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), None, False, torch.zeros(2, 4, dtype=torch.float16)),
         "residual: expected dtype torch.float32"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), None, False, torch.zeros(4, 2).t()),
         "residual: the last dim must have stride 1"),
        (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), None, False, torch.zeros(2, 4, device="meta")),
         "residual on meta"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.skinny_linear(*make())


def _exact_inputs(M, N, K, dtype, bias, seed=0):
    """x integers |x| <= 127 and w multiples of 2**-10 under 1/8 (7-bit values, exact in every dtype), bias
    integers |b| <= 500: products and partial sums are multiples of 2**-10 under 2**12 in magnitude (K <= 200),
    so the GEMM's float32 sum is exact whatever the summation order or split, while nearly every result needs
    more bits than a 16-bit mantissa holds. Each rounding the kernel applies is then known exactly."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (M, K), generator=gen).to(dtype)
    w = (torch.randint(-127, 128, (N, K), generator=gen) / 1024).to(dtype)
    b = torch.randint(-500, 501, (N,), generator=gen).to(dtype) if bias else None
    return x, w, b


def _strided_residual(y, seed, device="cpu", pad=5):
    """A residual [M, N] for the rounded linear ``y``, as a view of rows of a wider table (row stride N + pad,
    NaN past N: a read past the row or with out's stride shows). On a checkerboard it is -y: there
    round(round(y) + r) is 0, while one rounding of the exact sum keeps y's own rounding error, so the two
    orders differ wherever y does not fit the dtype; elsewhere it is large and random."""
    M, N = y.shape
    gen = torch.Generator().manual_seed(seed)
    checker = (torch.arange(M)[:, None] + torch.arange(N)[None, :]) % 2 == 0
    r = torch.where(checker, -y.float(), torch.randn(M, N, generator=gen) * 100).to(y.dtype)
    table = torch.full((M, N + pad), float("nan"), dtype=y.dtype)
    table[:, :N] = r
    view = table.to(device)[:, :N]  # sliced where it lives: ``.to`` of a strided view would make it contiguous
    assert view.stride() == (N + pad, 1)
    return view


# (M, N, K, kernel, split_k): one MMA tile, row blocks (M > 64), split-K over MMA tiles, TMA weight boxes (plain
# and split-K), the gemv kernel (plain, split-K with an empty split, and its compiler-pipelined loop, split-K).
_RESIDUAL_CASES = [
    (3, 20, 40, "dot", 1), (70, 24, 40, "dot", 1), (20, 33, 96, "dot", 3), (16, 40, 72, "tma", 1),
    (5, 24, 200, "tma", 2), (3, 17, 50, "gemv", 1), (1, 40, 130, "gemv", 4), (2, 30, 130, "pipelined", 3),
]  # fmt: skip


def _residual_config(M, N, K, kernel, split_k):
    if kernel in ("gemv", "pipelined"):
        return gemv_config(M, N, K, block_n=8, block_k=32, split_k=split_k, pipeline=kernel == "pipelined")
    return choose_skinny_config(M, N, K, block_n=16, block_k=32, split_k=split_k, tma=kernel == "tma")


def _skip_bfloat16_in_the_interpreter(dtype, device):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bfloat16 runs on the GPU only (the interpreter's dot and casts: see the module docstring)")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,N,K,kernel,split_k", _RESIDUAL_CASES)
def test_residual_is_added_to_the_rounded_linear(M, N, K, kernel, split_k, dtype, bias, kernel_device):
    """The epilogue rounds as the unfused graph: ``round(round(x @ w.T + b) + residual)``, bit for bit (the GEMM is
    exact here, see ``_exact_inputs``), and so equals the reference ``F.linear(x, w, b) + residual``; for
    16-bit dtypes the data tells that from one rounding of the exact sum. The residual is a row-strided view."""
    d = kernel_device
    _skip_bfloat16_in_the_interpreter(dtype, d)
    x, w, b = _exact_inputs(M, N, K, dtype, bias, seed=M * 100 + K)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    y = exact.to(dtype)  # what F.linear returns: the exact sum rounded once
    r = _strided_residual(y, seed=N)
    want = (y.float() + r.float()).to(dtype)
    assert torch.equal(skinny_linear_reference(x, w, b, r), want)
    if dtype != torch.float32:
        assert not torch.equal((exact + r.double()).to(dtype), want), "the data must tell the roundings apart"
    out = poisoned((M, N), dtype, d)
    cfg = _residual_config(M, N, K, kernel, split_k)
    _launch_skinny_linear(x.to(d), w.to(d), None if b is None else b.to(d), out, config=cfg,
                          residual=_strided_residual(y, seed=N, device=d))  # fmt: skip
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,N,K,kernel,split_k", _RESIDUAL_CASES)
def test_residual_changes_the_output_by_exactly_the_residual(M, N, K, kernel, split_k, dtype, kernel_device):
    """Random data, where the GEMM's summation order shows: the same launch with a large random residual gives
    bit for bit the launch without it plus the residual in x's dtype (its rounded result, then the 16-bit add),
    changes nearly every element, and agrees with the float64 reference."""
    d = kernel_device
    _skip_bfloat16_in_the_interpreter(dtype, d)
    x, w, b = (t.to(d) if t is not None else None for t in _inputs(M, N, K, dtype, M % 2 == 1, seed=M + N + K))
    r = (torch.randn(M, N, generator=torch.Generator().manual_seed(K)) * 50).to(dtype).to(d)
    cfg = _residual_config(M, N, K, kernel, split_k)
    plain = poisoned((M, N), dtype, d)
    _launch_skinny_linear(x, w, b, plain, config=cfg)
    fused = poisoned((M, N), dtype, d)
    _launch_skinny_linear(x, w, b, fused, config=cfg, residual=r)
    assert torch.equal(fused, plain + r)
    assert (fused != plain).double().mean() > 0.9, "the residual did not land"
    want = skinny_linear_reference(*(t.cpu().double() if t is not None else None for t in (x, w, b, r)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.cpu().double(), want, rtol=tol, atol=tol)


def test_op_with_residual_on_cpu_is_the_reference_and_traces():
    """The op's last argument: on the CPU it is the reference (``F.linear(...) + residual`` in x's dtype, a
    row-strided residual too), by position or keyword, and it traces (fake kernel) with it."""
    x, w, b = _inputs(4, 12, 20, torch.float32, True)
    r = torch.randn(4, 16)[:, :12]
    assert torch.ops.treespec.skinny_linear.default._schema.arguments[-1].name == "residual"
    assert torch.equal(torch.ops.treespec.skinny_linear(x, w, b, False, r), F.linear(x, w, b) + r)
    xb, wb, bb, rb = (t.to(torch.bfloat16) for t in (x, w, b, r))
    out = torch.ops.treespec.skinny_linear(xb, wb, bb, residual=rb)
    assert out.dtype == torch.bfloat16 and torch.equal(out, F.linear(xb, wb, bb) + rb)
    assert not torch.equal(out, torch.ops.treespec.skinny_linear(xb, wb, bb))
    compiled = torch.compile(lambda a, c, res: torch.ops.treespec.skinny_linear(a, c, residual=res) * 2,
                             backend="aot_eager", fullgraph=True)  # fmt: skip
    assert torch.equal(compiled(x, w, r), (F.linear(x, w) + r) * 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "M,N,K,kind",
    [(M, N, K, kind) for M, N, K in [(1, 960, 576), (8, 8192, 576), (16, 960, 576), (64, 3072, 576), (1, 6144, 4096),
                                     (3, 100, 70)]
     for kind in ("table", "table_pdl_env", "table_l2", "gemv", "gemv_pdl", "gemv_pdl_prefetch", "dot_split4",
                  "gemv_split4", "gemv_pdl_pipelined")
     if not kind.startswith("gemv") or M <= 16],  # gemv: <= 16 rows
)
def test_gpu_matches_float64_and_replays_in_a_graph(monkeypatch, dtype, M, N, K, kind):
    """Each kernel in a CUDA graph, after another kernel that writes x (so a dependent launch that read x
    before its wait would read stale rows), replayed with new x. ``table_pdl_env``: the table's kernel with
    TREECOMPILE_PDL=1, so the MMA kernel too runs as a dependent launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if kind == "table_l2":  # four weight tiles a program hinted into L2 before the dependency wait
        monkeypatch.setenv("TREECOMPILE_SKINNY_L2_PREFETCH", "4")
    if kind == "table_pdl_env":
        if torch.cuda.get_device_capability()[0] < 9:
            pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
        monkeypatch.setenv("TREECOMPILE_PDL", "1")
    if kind.startswith("table"):
        cfg = None
    elif kind == "dot_split4":  # split-K: the counter table exists before capture (this eager call)
        cfg = choose_skinny_config(M, N, K, split_k=4)
    else:
        cfg = gemv_config(M, N, K, pdl=kind.startswith("gemv_pdl"), split_k=4 if kind == "gemv_split4" else 1,
                          pipeline=kind.endswith("pipelined"))  # fmt: skip
    # the first weight tile loaded before the dependency wait (the pipelined loop waits first whatever it is told)
    constant = kind in ("gemv_pdl_prefetch", "gemv_pdl_pipelined")
    x, w, b = (t.cuda() if t is not None else None for t in _inputs(M, N, K, dtype, bias=N % 2 == 1))
    src = torch.randn_like(x)
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    _launch_skinny_linear(x, w, b, out, config=cfg, constant_weight=constant)
    _check(out, x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(src * 2)  # the previous kernel writes x
        _launch_skinny_linear(x, w, b, out, config=cfg, constant_weight=constant)
    src.copy_(torch.randn_like(src))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, src * 2, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "M,N,K,kind",
    [(M, N, K, kind) for M, N, K in [(1, 576, 576), (64, 576, 1536), (3, 100, 70)]
     for kind in ("table", "gemv_pdl_prefetch", "gemv_pdl_pipelined", "dot_split4", "gemv_split4")
     if not kind.startswith("gemv") or M <= 16],  # gemv: <= 16 rows
)  # fmt: skip
def test_gpu_residual_written_by_the_previous_kernel_replays_in_a_graph(dtype, M, N, K, kind):
    """A decoder's residual stream is the previous kernel's output: in a CUDA graph a kernel writes the (row-
    strided) residual just before the launch, so a dependent launch that read it before its wait would add stale
    rows. After each replay the output is the launch without residual plus the new residual, bit for bit; the
    op itself (the table's tiles) gives the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if kind == "table":
        cfg = None
    elif kind == "dot_split4":
        cfg = choose_skinny_config(M, N, K, split_k=4)
    else:
        cfg = gemv_config(M, N, K, pdl=True, split_k=4 if kind == "gemv_split4" else 1,
                          pipeline=kind.endswith("pipelined"))  # fmt: skip
    constant = kind in ("gemv_pdl_prefetch", "gemv_pdl_pipelined")
    x, w, b = (t.cuda() if t is not None else None for t in _inputs(M, N, K, dtype, bias=M % 2 == 1))
    res = torch.full((M, N + 8), float("nan"), device="cuda", dtype=dtype)[:, :N]
    src = torch.randn(M, N, device="cuda", dtype=dtype) * 20
    res.copy_(src)
    plain = torch.empty(M, N, device="cuda", dtype=dtype)
    _launch_skinny_linear(x, w, b, plain, config=cfg, constant_weight=constant)
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    _launch_skinny_linear(x, w, b, out, config=cfg, constant_weight=constant, residual=res)
    assert torch.equal(out, plain + res)
    if kind == "table":
        assert torch.equal(torch.ops.treespec.skinny_linear(x, w, b, constant, res), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res.copy_(src * 2)  # the previous kernel writes the residual
        _launch_skinny_linear(x, w, b, out, config=cfg, constant_weight=constant, residual=res)
    for _ in range(2):
        src.copy_(torch.randn_like(src) * 20)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain + src * 2)


def test_dependent_launch_switch(monkeypatch):
    """Dependent launches are on by default for CUDA devices of compute capability >= 9, never in the
    interpreter or on the CPU; TREECOMPILE_PDL=0 turns them off. Inductor's kernels of treecompile's own
    compiles follow the same switch (inductor_pdl_patch)."""
    import torch._inductor.config as inductor_config

    from treecompile.ops import _common
    from treecompile.ops._tree_attention_kernels import choose_config

    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(_common, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_common, "triton_interpret", lambda: False)
    monkeypatch.delenv("TREECOMPILE_PDL", raising=False)
    assert _common.pdl_enabled(cuda0)  # the default on Hopper
    has_switch = hasattr(inductor_config, "triton.enable_pdl")
    assert _common.inductor_pdl_patch(cuda0) == ({"triton.enable_pdl": True} if has_switch else {})
    assert _common.inductor_pdl_patch(torch.device("cpu")) == {}
    monkeypatch.setenv("TREECOMPILE_PDL", "1")
    assert _common.pdl_enabled(cuda0)
    assert not _common.pdl_enabled(torch.device("cpu"))
    monkeypatch.setattr(_common, "_capability", lambda index: (8, 0))
    assert not _common.pdl_enabled(cuda0)  # Ampere has no programmatic dependent launch
    assert _common.inductor_pdl_patch(cuda0) == {}
    monkeypatch.setattr(_common, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_common, "triton_interpret", lambda: True)
    assert not _common.pdl_enabled(cuda0)
    monkeypatch.setenv("TREECOMPILE_PDL", "0")
    monkeypatch.setattr(_common, "triton_interpret", lambda: False)
    assert not _common.pdl_enabled(cuda0)
    assert _common.inductor_pdl_patch(cuda0) == {}
    # the attention's config carries the switch; on the CPU (the interpreter's device) it stays off
    monkeypatch.setenv("TREECOMPILE_PDL", "1")
    assert not choose_config(1, 16, 8, 2, 64, 1024, torch.device("cpu")).pdl
    assert choose_config(1, 16, 8, 2, 64, 1024, torch.device("cpu"), pdl=True).pdl  # a sweep's override


def test_combo_kernel_switch(monkeypatch):
    """Inductor's combo kernels are on for treecompile's compiles on CUDA, never on the CPU or in the
    interpreter; TREECOMPILE_COMBO_KERNELS=0 turns them off. inductor_patches merges them with the
    dependent-launch patch."""
    import torch._inductor.config as inductor_config

    from treecompile.ops import _common

    if not hasattr(inductor_config, "combo_kernels"):
        pytest.skip("this torch's Inductor has no combo_kernels")
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(_common, "triton_interpret", lambda: False)
    monkeypatch.delenv("TREECOMPILE_COMBO_KERNELS", raising=False)
    assert _common.inductor_combo_patch(cuda0) == {"combo_kernels": True}
    assert _common.inductor_combo_patch(torch.device("cpu")) == {}
    monkeypatch.setattr(_common, "inductor_pdl_patch", lambda device=None: {"triton.enable_pdl": True})
    assert _common.inductor_patches(cuda0) == {"triton.enable_pdl": True, "combo_kernels": True}
    monkeypatch.setattr(_common, "triton_interpret", lambda: True)
    assert _common.inductor_combo_patch(cuda0) == {}
    monkeypatch.setattr(_common, "triton_interpret", lambda: False)
    monkeypatch.setenv("TREECOMPILE_COMBO_KERNELS", "0")
    assert _common.inductor_combo_patch(cuda0) == {}
    assert _common.inductor_patches(cuda0) == {"triton.enable_pdl": True}


def test_treecompile_compiles_ask_inductor_for_dependent_launches(monkeypatch):
    """compile_inference (the drafter's hooks, DraftTree) passes Inductor the dependent-launch and combo-kernel
    patches where inductor_pdl_patch / inductor_combo_patch give them, merged under the caller's own options,
    and none under a mode or another backend (torch.compile takes options only with Inductor and without
    mode)."""
    from treecompile import compiling
    from treecompile.ops import _common

    seen = []
    monkeypatch.setattr(compiling.torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    monkeypatch.setattr(_common, "inductor_pdl_patch", lambda device=None: {"triton.enable_pdl": True})
    monkeypatch.setattr(_common, "inductor_combo_patch", lambda device=None: {})

    def f(x):
        return x + 1

    compiling.compile_inference(f, "f_pdl")
    compiling.compile_inference(f, "f_opts", options={"triton.enable_pdl": False, "max_autotune": False})
    compiling.compile_inference(f, "f_mode", mode="reduce-overhead")
    assert seen[0]["options"] == {"triton.enable_pdl": True} and seen[0]["dynamic"] is False
    assert seen[1]["options"] == {"triton.enable_pdl": False, "max_autotune": False}  # the caller's own wins
    assert "options" not in seen[2]
    monkeypatch.setattr(_common, "inductor_pdl_patch", lambda device=None: {})
    compiling.compile_inference(f, "f_cpu")
    assert "options" not in seen[3]
    monkeypatch.setattr(_common, "inductor_combo_patch", lambda device=None: {"combo_kernels": True})
    compiling.compile_inference(f, "f_combo", options={"combo_kernels": False})
    compiling.compile_inference(f, "f_combo2")
    assert seen[4]["options"] == {"combo_kernels": False} and seen[5]["options"] == {"combo_kernels": True}


def test_counter_tables_are_one_per_owner_and_never_resized():
    """``counter_table``: zeroed int32, one per (owner, device), the same tensor on every call (a captured
    graph keeps its address); a launch counting more groups than the table holds is refused by name."""
    from treecompile.ops._common import counter_table

    a = counter_table("test owner a", torch.device("cpu"), 32)
    assert a.dtype == torch.int32 and a.numel() == 32 and int(a.abs().sum()) == 0
    assert counter_table("test owner a", torch.device("cpu"), 8) is a
    assert counter_table("test owner b", torch.device("cpu"), 8) is not a
    with pytest.raises(ValueError, match="test owner a: a launch counts at most 32 groups, got 33"):
        counter_table("test owner a", torch.device("cpu"), 33)


@pytest.mark.parametrize(
    "mode, shapes, flag, kind",
    [
        # the pipelined gemv configs, timed next to the shipped choice
        ("pipe", [(1, 40, 72, 3), (3, 24, 64, 3)], "pipeline", "gemv_pdl"),
        # each MMA tile through TMA boxes and through pointers
        ("tma", [(16, 40, 72, 5), (64, 24, 64, 5)], "tma", "dot"),
        # wide slices over split-K (the shipped choice, then two split configs)
        ("wide", [(64, 40, 96, 3), (20, 24, 64, 3)], "split_k", "dot"),
    ],
)
@pytest.mark.interpreter  # the script's smoke modes are the interpreter's (they put their tensors on the CPU)
def test_sweep_mode_smoke(tmp_path, monkeypatch, mode, shapes, flag, kind):
    """tests/gpu/skinny_sweep.py's ``pipe``, ``tma`` and ``wide`` modes (interpreter, two tiny shapes each): the mode's
    configs run and are checked against F.linear; the rows (``best.<flag>`` where such a config won) load into
    the table."""
    import json
    import sys

    from conftest import gpu_script

    from treecompile.ops import skinny_linear

    sweep = gpu_script("skinny_sweep")
    out = tmp_path / f"{mode}.json"
    monkeypatch.setattr(sys, "argv", ["skinny_sweep.py", str(out), f"{mode}-smoke"])
    sweep.main()
    rows = json.loads(out.read_text())
    assert [(r["M"], r["N"], r["K"], r["configs"]) for r in rows] == shapes
    for r in rows:
        flagged = [c for c in r["top"] if (c[flag] > 1 if flag == "split_k" else c[flag])]
        assert len(flagged) == 2 and all(c["kind"] == kind and c["max_err"] < 0.05 for c in flagged)
    assert skinny_linear.register_tiles(rows) == 2


def test_a_gpu_class_table_lays_over_the_h200_table(monkeypatch):
    """On a GPU with its own entries (``_MEASURED_BY_GPU``) those replace the H200's for the same (M, N, K) and the
    rest still serve; registered rows win over both; with no CUDA device (or an unlisted GPU) the H200 table
    alone serves."""
    from treecompile.ops import skinny_linear

    assert skinny_linear.gpu_class() is None or torch.cuda.is_available()
    monkeypatch.setattr(skinny_linear, "gpu_class", lambda: None)  # an H200, or any GPU with no table of its own
    h200 = skinny_linear.measured_tiles(1, 28672, 4096)  # 8B gate/up at one row: the H200's pipelined gemv
    assert h200.pipeline and (h200.block_n, h200.block_k) == (4, 512)
    assert skinny_linear.measured_tiles(64, 4096, 4096) is not None  # 8B o at 64 rows: Triton on the H200
    monkeypatch.setattr(skinny_linear, "gpu_class", lambda: "H100 SXM")
    cfg = skinny_linear.measured_tiles(1, 28672, 4096)
    assert cfg.gemv and cfg.pdl and cfg.pipeline and (cfg.block_n, cfg.block_k, cfg.num_stages) == (4, 1024, 6)
    assert skinny_linear.measured_tiles(3, 28672, 4096) is None  # its 4-row entry is within 2% of cuBLAS
    assert skinny_linear.measured_tiles(1, 960, 576).pipeline is False  # SmolLM2: the H200 entry serves
    verify = skinny_linear.measured_tiles(64, 28672, 4096)  # 8B gate/up at 64 rows: the H100's own tiles
    assert (verify.block_n, verify.block_k, verify.num_stages, verify.tma) == (128, 128, 3, False)
    assert skinny_linear.measured_tiles(64, 6144, 4096) is None  # qkv at 64 rows: cuBLAS on the H100 too
    o = skinny_linear.measured_tiles(64, 4096, 4096)  # o at 64 rows: the H100's own 256-wide K steps
    assert (o.block_n, o.block_k, o.num_stages) == (32, 256, 4)
    assert skinny_linear.measured_tiles(64, 4096, 12288) is None  # the head's fc at 64 rows: the H100's entry, cuBLAS
    row = dict(M=1, N=28672, K=4096, cublas_us=80.0, best=dict(block_n=8, block_k=512, warps=4, stages=3, us=90.0,
                                                              kind="gemv_pdl"))  # fmt: skip
    assert skinny_linear.register_tiles([row]) == 1
    assert skinny_linear.measured_tiles(1, 28672, 4096) is None  # the registered row: slower than cuBLAS
    try:  # the cache must not keep a made-up name for device 0, whatever fails here
        for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda index, name=name: name)
            skinny_linear._gpu_class_of.cache_clear()
            assert skinny_linear._gpu_class_of(0) == ("H100 SXM" if "HBM3" in name else None), name
    finally:
        skinny_linear._gpu_class_of.cache_clear()


def test_gemv_keep_footprint_shortens_the_k_step_of_a_stand_in_entry(monkeypatch):
    """``TREECOMPILE_GEMV_KEEP_FOOTPRINT``: the H100's 4-row gemv entries standing in for 6 rows (8-row blocks) take
    half the K step, so the accumulator stays the measured [4, N, K] size; the 4-row launch itself, MMA entries
    and the switch off are unchanged."""
    from treecompile.ops import skinny_linear

    monkeypatch.setattr(skinny_linear, "gpu_class", lambda: "H100 SXM")
    for footprint in (False, True):
        monkeypatch.setattr(skinny_linear, "GEMV_KEEP_FOOTPRINT", footprint)
        for N, K in ((4096, 12288), (4096, 4096), (4096, 14336)):  # the head's fc, o, down
            four, six = skinny_linear.measured_tiles(4, N, K), skinny_linear.measured_tiles(6, N, K)
            assert four.gemv and six.gemv and (four.block_m, six.block_m) == (4, 8)
            assert six.block_k == (four.block_k // 2 if footprint else four.block_k), (N, K, footprint)
            assert six.block_m * six.block_n * six.block_k <= (1 if footprint else 2) * four.block_m * four.block_n * four.block_k
        mma = skinny_linear.measured_tiles(48, 28672, 4096)  # a 64-row MMA entry for 48 rows: no change
        assert not mma.gemv and mma.block_k == skinny_linear.measured_tiles(64, 28672, 4096).block_k


@pytest.mark.parametrize("gpu", [None, "H100 SXM"], ids=["h200_table", "h100_table"])
def test_every_stand_in_gemv_config_of_the_shipped_tables_matches_float64(gpu, monkeypatch,
                                                                          kernel_device):  # fmt: skip
    """The footprint rule (on by default since the forty-sixth session) makes gemv configs no sweep ran: an
    entry measured at m rows standing in for M > m rows takes a shorter K step. Each distinct such config of the
    shipped H100 table (every row count of 2..16 an entry stands in for) runs here on a scaled-down weight,
    [2 * BLOCK_N + 3, 2 * BLOCK_K + 24] (a partial slice and the masked K tail), against float64, with NaN-poisoned
    output. On the H200 table the rule changes no config: its few-row gemv entries that could stand in lost to
    cuBLAS, so those shapes stay on cuBLAS either way."""
    from treecompile.ops import skinny_linear

    monkeypatch.setattr(skinny_linear, "gpu_class", lambda: gpu)
    shapes = {(N, K) for table in (skinny_linear._MEASURED, skinny_linear._MEASURED_BY_GPU.get(gpu, {}))
              for (_, N, K) in table}  # fmt: skip
    configs = {}
    for N, K in sorted(shapes):
        for M in range(2, 17):
            monkeypatch.setattr(skinny_linear, "GEMV_KEEP_FOOTPRINT", False)
            plain = skinny_linear.measured_tiles(M, N, K)
            monkeypatch.setattr(skinny_linear, "GEMV_KEEP_FOOTPRINT", True)
            cfg = skinny_linear.measured_tiles(M, N, K)
            if cfg != plain:  # the rule changed it: only the K step, only shorter
                assert cfg.gemv and cfg.block_k < plain.block_k, (M, N, K, cfg, plain)
                assert cfg == dataclasses.replace(plain, block_k=cfg.block_k), (M, N, K)
                configs.setdefault((M, cfg), (N, K))
    if gpu is None:  # the H200's few-row gemv entries that could stand in lost to cuBLAS: the rule changes nothing
        assert not configs
        return
    # the 8B head's fc at 6 rows on the H100: the case the rule was made for
    assert any(M == 6 and nk == (4096, 12288) for (M, _), nk in configs.items())
    d = kernel_device
    for i, ((M, cfg), (N, K)) in enumerate(sorted(configs.items(), key=lambda item: (item[0][0], str(item[0][1])))):
        n, k = 2 * cfg.block_n + 3, 2 * cfg.block_k + 24
        x, w, b = _inputs(M, n, k, torch.float32, bias=i % 2 == 1, seed=i)
        out = poisoned((M, n), torch.float32, d)
        _launch_skinny_linear(x.to(d), w.to(d), None if b is None else b.to(d), out, config=cfg)
        assert cfg.block_k >= 16, (M, N, K, cfg)
        _check(out.cpu(), x, w, b)


@pytest.mark.parametrize("gpu", [None, "H100 SXM"], ids=["h200_table", "h100_table"])
def test_every_mma_config_of_the_shipped_tables_matches_float64(gpu, monkeypatch, kernel_device):
    """Each distinct MMA config (tiles, stages, split-K, row block, TMA boxes) the shipped table of a GPU class
    routes one of its measured shapes to, at that shape's row count, runs on a scaled-down weight [2 * BLOCK_N + 3,
    2 * BLOCK_K * SPLIT_K + 24] (a partial slice, every split, the masked K tail) against float64 with
    NaN-poisoned output. The sweeps checked each config only at its own full shape, on their GPU; an entry added
    by hand (the H100's 64-row o on 256-wide K steps, forty-ninth session) is covered here too."""
    from treecompile.ops import skinny_linear

    monkeypatch.setattr(skinny_linear, "gpu_class", lambda: gpu)
    table = {**skinny_linear._MEASURED, **skinny_linear._MEASURED_BY_GPU.get(gpu, {})}
    configs = {(M, cfg) for M, N, K in table if (cfg := skinny_linear.measured_tiles(M, N, K)) and not cfg.gemv}
    assert any(M == 64 and (cfg.block_n, cfg.block_k) == (32, 256) for M, cfg in configs)  # the 8B o, both tables
    d = kernel_device
    for i, (M, cfg) in enumerate(sorted(configs, key=lambda mc: (mc[0], str(mc[1])))):
        n, k = 2 * cfg.block_n + 3, 2 * cfg.block_k * cfg.split_k + 24
        x, w, b = (t.to(d) if t is not None else None for t in _inputs(M, n, k, torch.float16, bias=i % 2 == 1,
                                                                         seed=i))  # fmt: skip
        out = poisoned((M, n), torch.float16, d)
        _launch_skinny_linear(x, w, b, out, config=cfg)
        _check(out.cpu(), x.cpu(), w.cpu(), None if b is None else b.cpu())


@pytest.mark.parametrize("footprint", [False, True], ids=["plain", "keep_footprint"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_routing_traces_without_a_graph_break(dynamic, footprint, monkeypatch):
    """``linear_rows`` decides its route in Python, and the drafter calls it inside its compiled draft round:
    ``measured_tiles`` and ``gpu_class`` must trace in one graph (``fullgraph``), for static and symbolic row
    counts, and answer as eagerly. Before the forty-first session ``min(..., key=...)`` broke the graph for a
    symbolic row count at every call of a shape with table entries (static counts traced; checked on torch 2.13
    in the forty-second session)."""
    from treecompile.ops import skinny_linear

    if footprint:  # the H100's 4-row gemv entry standing in for 6 rows with a shorter K step (GEMV_KEEP_FOOTPRINT)
        monkeypatch.setattr(skinny_linear, "GEMV_KEEP_FOOTPRINT", True)
        monkeypatch.setattr(skinny_linear, "gpu_class", lambda: "H100 SXM")
        assert skinny_linear.measured_tiles(6, 4096, 4096).block_k * 2 == skinny_linear.measured_tiles(4, 4096, 4096).block_k

    def route(x):
        cfg = skinny_linear.measured_tiles(x.shape[0], 4096, 4096)
        pdl = 1.0 if cfg is not None and cfg.pdl else 0.0
        block_k = cfg.block_k / 1e4 if cfg is not None else 0.0
        return x * (2.0 if cfg is not None else 3.0) + pdl + block_k + (skinny_linear.gpu_class() is None)

    torch._dynamo.reset()
    compiled = torch.compile(route, backend="eager", fullgraph=True, dynamic=dynamic)
    for M in (1, 3, 4, 6, 64, 100):  # decode, draft lanes (nearest swept M), step 0, a verify tree, a batch
        x = torch.ones(M, 2)
        assert torch.equal(compiled(x), route(x)), M
    # the scan above met table entries (the min over them was the break), one of them a win
    assert skinny_linear._swept_rows(4096, 4096) and skinny_linear.measured_tiles(1, 4096, 4096) is not None
    assert skinny_linear.measured_tiles(100, 4096, 4096) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "M,N,K,bias,block_n,block_k,split_k",
    [(16, 40, 72, False, 16, 32, 1), (20, 33, 96, True, 32, 64, 1), (64, 48, 200, True, 16, 16, 5),
     (130, 20, 64, False, 16, 32, 1), (3, 70, 1000, True, 64, 128, 3)],
)  # fmt: skip
def test_tma_tiles_match_float64_linear(dtype, M, N, K, bias, block_n, block_k, split_k, kernel_device):
    """The MMA tiles with TMA weight boxes: N and K tails (the box reads zeros there), split-K, row blocks.
    Under the interpreter the descriptors are emulated, on Hopper they are the copy engine's."""
    from treecompile.ops._common import tma_weights_ok

    d = kernel_device
    x, w, b = (t.to(d) if t is not None else None for t in _inputs(M, N, K, dtype, bias, seed=M + N + K))
    assert tma_weights_ok(w) or (d == "cuda" and torch.cuda.get_device_capability()[0] < 9)
    cfg = choose_skinny_config(M, N, K, block_n=block_n, block_k=block_k, split_k=split_k, tma=True)
    out = poisoned((M, N), dtype, d)
    _launch_skinny_linear(x, w, b, out, config=cfg)
    _check(out.cpu(), x.cpu(), w.cpu(), None if b is None else b.cpu())


def test_tma_boxes_stop_at_a_row_views_edge(kernel_device):
    """A weight that is the first N rows of a bigger one (fuse_projections' q of a fused qkv): the boxes of
    the last slice read zeros past N, not the next rows (NaN there), and a layout no box can take (a 100-byte
    row stride) falls back to pointer loads with the same result."""
    d = kernel_device
    M, N, K = 16, 24, 64
    x, w, _ = (t.to(d) if t is not None else None for t in _inputs(M, N, K, torch.float16, False, seed=5))
    fused = torch.cat([w, torch.full((16, K), float("nan"), dtype=w.dtype, device=d)])
    out = poisoned((M, N), torch.float16, d)
    _launch_skinny_linear(x, fused[:N], None, out, config=choose_skinny_config(M, N, K, block_n=16, tma=True))
    _check(out.cpu(), x.cpu(), w.cpu(), None)
    x50, w50, _ = (t.to(d) if t is not None else None for t in _inputs(M, N, 50, torch.float16, False, seed=6))
    out = poisoned((M, N), torch.float16, d)
    _launch_skinny_linear(x50, w50, None, out, config=choose_skinny_config(M, N, 50, block_k=16, tma=True))
    _check(out.cpu(), x50.cpu(), w50.cpu(), None)


def test_tma_tiles_in_the_measured_table_and_their_limits(monkeypatch):
    """A sweep row with ``best.tma`` reaches the MMA config; the gemv kernels and boxes past 256 are refused."""
    from treecompile.ops import skinny_linear

    row = dict(M=64, N=96, K=512, cublas_us=10.0, best=dict(block_n=32, block_k=128, warps=4, stages=4, us=8.0,
                                                           tma=True))  # fmt: skip
    assert skinny_linear.register_tiles([row]) == 1
    cfg = skinny_linear.measured_tiles(64, 96, 512)
    assert cfg.tma and not cfg.gemv and (cfg.block_n, cfg.block_k) == (32, 128)
    with pytest.raises(ValueError, match="best.tma is for the MMA tiles"):
        skinny_linear.register_tiles([dict(row, M=1, best=dict(row["best"], kind="gemv_pdl"))])
    with pytest.raises(ValueError, match="at most 256 elements"):
        skinny_linear.register_tiles([dict(row, best=dict(row["best"], block_k=512))])
    x, w, _ = _inputs(16, 16, 512, torch.float32, False)
    with pytest.raises(ValueError, match="at most 256 elements"):
        _launch_skinny_linear(x, w, None, torch.empty(16, 16), config=choose_skinny_config(16, 16, 512, block_k=512,
                                                                                            tma=True))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# skinny_linear_norm_out: the residual epilogue plus the next RMSNorm's inputs (u = round(g * s), sums of s^2
# a BLOCK_N-wide slice)
# --------------------------------------------------------------------------------------------------


def _strided_norm_weight(N, dtype, device="cpu", seed=0):
    """The norm weight as a column of a wider table (stride 3, 1e6 elsewhere: a contiguous read shows)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.full((N, 3), 1e6)
    table[:, 1] = torch.rand(N, generator=gen) * 2 + 0.25
    view = table.to(dtype).to(device)[:, 1]
    assert view.stride() == (3,)
    return view


def _launch_norm_out(x, w, b, r, g, config=None):
    """The launcher with poisoned outputs: (s, u, sumsq), sumsq sized by the config's (or the default's) slices."""
    from treecompile.ops.skinny_linear import norm_out_slices

    (M, K), N, d = x.shape, w.shape[0], x.device
    S = norm_out_slices(M, N, K) if config is None else -(-N // config.block_n)
    s, u, sq = poisoned((M, N), x.dtype, d), poisoned((M, N), x.dtype, d), poisoned((S, M), torch.float32, d)
    _launch_skinny_linear(x, w, b, s, config=config, residual=r, norm=(u, sq, g))
    return s, u, sq


def _check_norm_out(s, u, sq, g, block_n):
    """u is round(g * s) bit for bit; sumsq [cdiv(N, block_n), M] is each slice's sum of s^2 from the stored
    (rounded) s, and its slices add up to the row's whole sum (a dropped or doubled slice shows)."""
    M, N = s.shape
    assert not s.isnan().any() and not u.isnan().any() and not sq.isnan().any(), "unwritten output elements"
    assert torch.equal(u, (g.float()[None, :] * s.float()).to(s.dtype))
    assert sq.shape == (-(-N // block_n), M) and sq.dtype == torch.float32
    s2 = s.double().pow(2)
    for j in range(sq.shape[0]):
        torch.testing.assert_close(sq[j].double(), s2[:, j * block_n:(j + 1) * block_n].sum(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sq.sum(0), s.float().pow(2).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [17, 24, 64])
def test_norm_out_matches_the_reference(M, dtype, bias, kernel_device):
    """The default config (N = 40: 16-wide slices, a partial last one), exact GEMM data (``_exact_inputs``): s is
    the residual epilogue's result bit for bit (and the reference's), u and sumsq those of the rounded s; a
    row-strided residual and a strided norm weight. sumsq's shape is ``norm_out_slices``."""
    from treecompile.ops.skinny_linear import (
        norm_out_slices, norm_out_supported, skinny_linear_norm_out_reference,
    )

    d = kernel_device
    _skip_bfloat16_in_the_interpreter(dtype, d)
    N, K = 40, 72
    assert norm_out_supported(M, N, K) and norm_out_slices(M, N, K) == 3  # 16 + 16 + 8 columns
    x, w, b = _exact_inputs(M, N, K, dtype, bias, seed=M)
    y = F.linear(x.double(), w.double(), None if b is None else b.double()).to(dtype)
    r_cpu, g_cpu = _strided_residual(y, seed=M), _strided_norm_weight(N, dtype, seed=M)
    want = skinny_linear_norm_out_reference(x, w, b, r_cpu, g_cpu)
    assert want[2].shape == (3, M)
    on = (lambda t: None if t is None else t.to(d))
    s, u, sq = _launch_norm_out(on(x), on(w), on(b), _strided_residual(y, seed=M, device=d),
                                _strided_norm_weight(N, dtype, d, seed=M))  # fmt: skip
    s, u, sq = s.cpu(), u.cpu(), sq.cpu()
    assert torch.equal(s, want[0]) and torch.equal(u, want[1])
    torch.testing.assert_close(sq, want[2], rtol=1e-6, atol=1e-6)
    _check_norm_out(s, u, sq, g_cpu, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "M,N,K,block_m,block_n,block_k,tma,split_k",
    [(17, 50, 96, 32, 32, 32, False, 1), (24, 33, 40, 32, 16, 16, False, 1), (64, 70, 130, 64, 64, 64, False, 1),
     (24, 40, 72, 32, 16, 32, True, 1), (70, 24, 40, 32, 16, 32, False, 1),
     # split-K: the split that reduces a slice writes its norm inputs (K tail in the last split, uneven splits,
     # several row blocks, TMA boxes)
     (17, 50, 96, 32, 32, 32, False, 2), (64, 70, 130, 64, 64, 32, False, 3), (70, 24, 200, 32, 16, 32, False, 4),
     (24, 40, 72, 32, 16, 16, True, 2)],
)  # fmt: skip
def test_norm_out_keeps_the_residual_epilogues_bits(M, N, K, block_m, block_n, block_k, tma, split_k, dtype,
                                                    kernel_device):  # fmt: skip
    """Random data, explicit tiles (a partial last slice, K tails, TMA weight boxes, several row blocks, split-K):
    s equals the plain residual launch of the same tiles bit for bit, u = round(g * s), the slices' sums of s^2
    land."""
    d = kernel_device
    _skip_bfloat16_in_the_interpreter(dtype, d)
    x, w, b = (t.to(d) if t is not None else None for t in _inputs(M, N, K, dtype, M % 2 == 0, seed=M + N + K))
    r = (torch.randn(M, N + 4, generator=torch.Generator().manual_seed(N)) * 4).to(dtype).to(d)[:, :N]
    g = _strided_norm_weight(N, dtype, d, seed=K)
    cfg = choose_skinny_config(M, N, K, block_m=block_m, block_n=block_n, block_k=block_k, tma=tma, split_k=split_k)
    plain = poisoned((M, N), dtype, d)
    _launch_skinny_linear(x, w, b, plain, config=cfg, residual=r)
    s, u, sq = _launch_norm_out(x, w, b, r, g, config=cfg)
    assert torch.equal(s, plain)
    _check_norm_out(s.cpu(), u.cpu(), sq.cpu(), g.cpu(), block_n)


def test_norm_out_op_on_cpu_is_the_reference_and_traces():
    """The op: on the CPU the reference; its fake gives [M, N], [M, N], [S, M] float32 (S = norm_out_slices);
    torch.compile(fullgraph, aot_eager) traces it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from treecompile.ops.skinny_linear import norm_out_slices, skinny_linear_norm_out_reference

    M, N, K = 20, 40, 24
    x, w, b = _inputs(M, N, K, torch.float32, True)
    r = torch.randn(M, N + 3)[:, :N]
    g = torch.rand(N * 2)[::2]
    op = torch.ops.treespec.skinny_linear_norm_out
    assert [a.name for a in op.default._schema.arguments] == ["x", "weight", "bias", "constant_weight", "residual",
                                                              "norm_weight"]  # fmt: skip
    got = op(x, w, b, False, r, g)
    want = skinny_linear_norm_out_reference(x, w, b, r, g)
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    assert torch.equal(got[0], torch.ops.treespec.skinny_linear(x, w, b, False, r))
    S = norm_out_slices(M, N, K)
    assert got[2].shape == (S, M) and S == 3
    with FakeTensorMode() as mode:
        fakes = op(*(mode.from_tensor(t) for t in (x, w, b)), False, mode.from_tensor(r), mode.from_tensor(g))
        assert [tuple(t.shape) for t in fakes] == [(M, N), (M, N), (S, M)]
        assert [t.dtype for t in fakes] == [torch.float32] * 3
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: [t * 2 for t in op(*a)], backend="aot_eager", fullgraph=True)
    out = compiled(x, w, None, True, r, g)
    want = skinny_linear_norm_out_reference(x, w, None, r, g)
    assert all(torch.equal(a, c * 2) for a, c in zip(out, want))


def test_norm_out_refuses_gemv_configs_and_takes_split_k_entries(kernel_device):
    """Only the MMA kernel has the epilogue: a measured gemv entry (<= 16 rows) makes the op (and
    norm_out_supported) refuse, naming the reason; so does a forced gemv config at the launcher. A split-K entry
    is served (its sumsq has one row a BLOCK_N slice of the entry) and matches the reference."""
    from treecompile.ops import skinny_linear

    op = torch.ops.treespec.skinny_linear_norm_out
    N, K = 96, 512

    def args(M):
        x, w, _ = _inputs(M, N, K, torch.float32, False)
        return x, w, None, False, torch.randn(M, N, generator=torch.Generator().manual_seed(M)), torch.rand(N) + 0.5

    assert skinny_linear.norm_out_supported(8, N, K)  # unmeasured: the static MMA tiles serve even 8 rows
    row = dict(M=8, N=N, K=K, cublas_us=10.0, best=dict(block_n=8, block_k=128, warps=4, stages=3, us=5.0,
                                                       kind="gemv_pdl"))  # fmt: skip
    assert skinny_linear.register_tiles([row]) == 1
    assert not skinny_linear.norm_out_supported(8, N, K)
    with pytest.raises(ValueError, match="not supported for .*gemv kernel"):
        op(*args(8))
    split = dict(M=64, N=N, K=K, cublas_us=10.0, best=dict(block_n=32, block_k=64, warps=4, stages=3, us=8.0,
                                                          split_k=2))  # fmt: skip
    assert skinny_linear.register_tiles([split]) == 1
    assert skinny_linear.norm_out_supported(64, N, K) and skinny_linear.norm_out_slices(64, N, K) == 3
    a = args(64)
    want = skinny_linear.skinny_linear_norm_out_reference(*a[:2], None, a[4], a[5], block_n=32)
    on = [t.to(kernel_device) if isinstance(t, torch.Tensor) else t for t in a]
    s, u, sq = _launch_norm_out(on[0], on[1], None, on[4], on[5])
    assert sq.shape == (3, 64)
    torch.testing.assert_close(s.cpu(), want[0], rtol=1e-5, atol=1e-4)
    _check_norm_out(s.cpu(), u.cpu(), sq.cpu(), a[5], 32)
    x, w, _ = _inputs(4, 16, 16, torch.float32, False)
    norm = (torch.empty(4, 16), torch.empty(2, 4), torch.ones(16))
    with pytest.raises(ValueError, match="gemv kernel"):
        _launch_skinny_linear(x, w, None, torch.empty(4, 16), config=gemv_config(4, 16, 16),
                              residual=torch.zeros(4, 16), norm=norm)  # fmt: skip
    with pytest.raises(ValueError, match="sumsq: expected a contiguous float32 \\[S=1, M=4\\]"):
        _launch_skinny_linear(x, w, None, torch.empty(4, 16), config=choose_skinny_config(4, 16, 16),
                              residual=torch.zeros(4, 16), norm=norm)  # fmt: skip


@pytest.mark.parametrize(
    "residual,norm_weight,match",
    [
        (None, torch.ones(4), "residual: required"),
        (torch.zeros(2, 5), torch.ones(4), r"residual: expected \[M=2, N=4\]"),
        (torch.zeros(2, 4, dtype=torch.float16), torch.ones(4), "residual: expected dtype torch.float32"),
        (torch.zeros(4, 2).t(), torch.ones(4), "residual: the last dim must have stride 1"),
        (torch.zeros(2, 4), torch.ones(5), r"norm_weight: expected \[N=4\]"),
        (torch.zeros(2, 4), torch.ones(4, 1), "norm_weight: expected a 1-d"),
        (torch.zeros(2, 4), torch.ones(4, dtype=torch.float16), "norm_weight: expected dtype torch.float32"),
        (torch.zeros(2, 4), torch.ones(4, device="meta"), "norm_weight on meta"),
    ],
)  # fmt: skip
def test_norm_out_bad_input_names_the_argument(residual, norm_weight, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.skinny_linear_norm_out(torch.zeros(2, 8), torch.zeros(4, 8), None, False, residual,
                                                  norm_weight)  # fmt: skip
