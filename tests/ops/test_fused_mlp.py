"""treespec::fused_mlp: both kernels (interpreter on CPU, the device on GPU) against a float64 gated MLP, over
row counts 1..16, hidden and intermediate sizes that are not multiples of the tiles, a partial count of
partials in the reduce's last step, strided rows, gate/up as views of one fused weight; the op's rounding
reference, its boundary checks and the measured table's rules. Outputs are poisoned with NaN so an unwritten
element fails. bfloat16 runs on the GPU only (the Triton 3.x interpreter's tl.dot misreads bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import poisoned

from treecompile.ops import fused_mlp as fm
from treecompile.ops._common import tma_weights_ok
from treecompile.ops.fused_mlp import (
    MAX_ROWS, MlpConfig, _launch_fused_mlp, choose_mlp_config, fused_mlp_reference, measured_mlp_tiles,
    register_mlp_tiles,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(M, H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(dtype)
    gate = (torch.randn(I, H, generator=g) / H**0.5).to(dtype)
    up = (torch.randn(I, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(H, I, generator=g) / I**0.5).to(dtype)
    return x, gate, up, down


def _float64(x, gate, up, down, norm_weight=None, residual=None, eps=0.0):
    x, gate, up, down = (t.double() for t in (x, gate, up, down))
    if norm_weight is not None:  # HF LlamaRMSNorm of x (+ residual), in float64
        s = x if residual is None else x + residual.double()
        x = norm_weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _check(out, x, gate, up, down, norm_weight=None, residual=None, eps=0.0):
    assert not out.isnan().any(), "unwritten output elements"
    tol = 1e-5 if x.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _float64(x, gate, up, down, norm_weight, residual, eps), rtol=tol, atol=tol)


def _norm_inputs(M, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.2 * torch.randn(H, generator=g)).to(dtype), torch.randn(M, H, generator=g).to(dtype)


SMALL = dict(chunk=16, block_k=16, block_h=16, reduce_block=8, reduce_chunks=4)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "M,H,I,tiles",
    [
        (1, 64, 128, {}),  # the default tiles, every dim a multiple
        (3, 50, 70, SMALL),  # H and I past the last tile: every tail mask
        (16, 48, 96, SMALL),  # a full 16-row tile; 6 partials: the reduce's last step is partial
        (5, 40, 33, dict(SMALL, chunk=32)),  # one feature in the last slice
        (2, 17, 16, dict(SMALL, reduce_chunks=1, reduce_block=1)),  # one partial and one output a step
        (1, 16, 4200, dict(SMALL, reduce_chunks=0)),  # 263 partials: the automatic step (256) twice
    ],
)
def test_matches_float64_gated_mlp(dtype, M, H, I, tiles, tma, kernel_device):
    """Pointer tiles and TMA boxes (the interpreter emulates descriptors, on Hopper they are the copy engine's; a
    weight whose rows are not 16-byte multiples, H=50 or 17 in float16, falls back to pointers)."""
    d = kernel_device
    x, gate, up, down = _inputs(M, H, I, dtype, seed=M * 100 + H)
    out = poisoned((M, H), dtype, d)
    _launch_fused_mlp(*(t.to(d) for t in (x, gate, up, down)), out, choose_mlp_config(M, H, I, tma=tma, **tiles))
    _check(out.cpu(), x, gate, up, down)


def test_tma_boxes_read_zeros_past_a_view_of_the_fused_weight(monkeypatch, kernel_device):
    """With TMA the gate half of a fused [2I, H] weight is bounded by its own descriptor: the last slice's
    padded features read zeros, not the up half's first rows; and the down tiles past I read zeros, not the
    next row (NaN there would otherwise reach the output through 0 * NaN)."""
    d = kernel_device
    M, H, I = 2, 32, 40
    x, gate, up, down = _inputs(M, H, I, torch.float32, seed=21)
    gate_up = torch.cat([gate, up]).to(d)
    padded_down = torch.full((H, I + 8), float("nan"))
    padded_down[:, :I] = down
    down_view = padded_down.to(d)[:, :I]  # row stride 48 floats (192 bytes): a legal box source, NaN just past I
    assert tma_weights_ok(gate_up[:I], gate_up[I:], down_view)
    out = poisoned((M, H), torch.float32, d)
    _launch_fused_mlp(x.to(d), gate_up[:I], gate_up[I:], down_view, out, choose_mlp_config(M, H, I, tma=True, **SMALL))
    _check(out.cpu(), x, gate, up, down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "residual+norm"])
@pytest.mark.parametrize("M,H,I,tiles", [(1, 64, 128, {}), (3, 50, 70, SMALL), (16, 48, 96, dict(SMALL, tma=True))])
def test_norm_prologue_matches_float64(dtype, with_residual, M, H, I, tiles, kernel_device):
    """With norm_weight the MLP's input is rmsnorm(x (+ residual)) * norm_weight (HF LlamaRMSNorm): the row's
    norm summed over the same steps that feed the MMA, applied to the gate / up sums after the loop; a tail
    step (H past the last tile) adds nothing to the sum of squares."""
    d = kernel_device
    x, gate, up, down = _inputs(M, H, I, dtype, seed=M + 7 * H)
    norm_weight, residual = _norm_inputs(M, H, dtype, seed=M)
    residual = residual if with_residual else None
    out = poisoned((M, H), dtype, d)
    on = (lambda t: None if t is None else t.to(d))
    _launch_fused_mlp(on(x), on(gate), on(up), on(down), out, choose_mlp_config(M, H, I, **tiles), on(norm_weight),
                      on(residual), 1e-5)  # fmt: skip
    out = out.cpu()
    _check(out, x, gate, up, down, norm_weight, residual, 1e-5)
    if dtype == torch.float16:  # against HF's rounding (norm_weight * round(s * r)): one float16 rounding apart
        want = fused_mlp_reference(x, gate, up, down, norm_weight, residual, 1e-5).float()
        torch.testing.assert_close(out.float(), want, rtol=4e-3, atol=4e-3)


def test_norm_weight_of_any_stride_and_eps_matter(kernel_device):
    """norm_weight may be a strided view (a column of a table); eps enters the scale (a row of zeros plus a
    large eps is not a division by zero)."""
    d = kernel_device
    M, H, I = 2, 32, 48
    x, gate, up, down = _inputs(M, H, I, torch.float32, seed=11)
    x[1] = 0.0
    table = torch.randn(H, 3)
    norm_weight = table.to(d)[:, 1]  # sliced where it lives: ``.to`` of a strided view would make it contiguous
    assert norm_weight.stride(0) == 3
    x_d, gate_d, up_d, down_d = (t.to(d) for t in (x, gate, up, down))
    for eps in (1e-6, 0.5):
        out = poisoned((M, H), torch.float32, d)
        _launch_fused_mlp(x_d, gate_d, up_d, down_d, out, choose_mlp_config(M, H, I, **SMALL), norm_weight, None, eps)
        _check(out.cpu(), x, gate, up, down, table[:, 1], None, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rounds_like_the_unfused_path(dtype, kernel_device):
    """The kernel rounds g, u and silu(g) * u to x's dtype as the unfused graph does: against the op's own
    reference it differs only by summation order (far inside the float64 tolerance above)."""
    d = kernel_device
    x, gate, up, down = _inputs(4, 64, 96, dtype, seed=3)
    out = poisoned((4, 64), dtype, d)
    _launch_fused_mlp(*(t.to(d) for t in (x, gate, up, down)), out, choose_mlp_config(4, 64, 96, **SMALL))
    out = out.cpu()
    want = fused_mlp_reference(x.float(), gate.float(), up.float(), down.float()) if dtype == torch.float32 else None
    if want is None:  # float16: the reference in float16 rounds h exactly as the kernel does
        want = fused_mlp_reference(x, gate, up, down).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def test_strided_rows_and_fused_gate_up_views(kernel_device):
    """x may be rows of a wider tensor (a row stride > H); gate and up may be the two halves of one fused
    [2I, H] weight (fuse_projections' layout), passed as views without a copy."""
    d = kernel_device
    M, H, I = 3, 40, 48
    wide = torch.randn(M, H + 24, dtype=torch.float32)
    x = wide[:, 8 : 8 + H]
    gate_up = torch.randn(2 * I, H) / H**0.5
    down = torch.randn(H, I) / I**0.5
    gate, up = gate_up[:I], gate_up[I:]
    # the views are taken where the tensors live: ``.to`` of a view would copy it into a contiguous tensor
    x_d, gate_up_d = wide.to(d)[:, 8 : 8 + H], gate_up.to(d)
    gate_d, up_d = gate_up_d[:I], gate_up_d[I:]
    assert x_d.stride(0) == H + 24 and gate_d.data_ptr() != up_d.data_ptr()
    out = poisoned((M, H), torch.float32, d)
    _launch_fused_mlp(x_d, gate_d, up_d, down.to(d), out, choose_mlp_config(M, H, I, **SMALL))
    _check(out.cpu(), x, gate, up, down)


def test_op_on_cpu_is_the_reference_and_its_fake_agrees():
    x, gate, up, down = _inputs(2, 32, 48, torch.float32, seed=5)
    out = torch.ops.treespec.fused_mlp(x, gate, up, down)
    assert torch.equal(out, fused_mlp_reference(x, gate, up, down))
    torch.library.opcheck(torch.ops.treespec.fused_mlp.default, (x, gate, up, down, True))
    norm_weight, residual = _norm_inputs(2, 32, torch.float32, seed=5)
    out = torch.ops.treespec.fused_mlp(x, gate, up, down, True, norm_weight, residual, 1e-6)
    assert torch.equal(out, fused_mlp_reference(x, gate, up, down, norm_weight, residual, 1e-6))
    torch.library.opcheck(torch.ops.treespec.fused_mlp.default, (x, gate, up, down, True, norm_weight, residual, 1e-6))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.treespec.fused_mlp(*(mode.from_tensor(t) for t in (x, gate, up, down)))
    assert fake.shape == (2, 32) and fake.dtype == torch.float32


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(x=torch.zeros(0, 32)), r"x: 1\.\.16 rows"),
        (dict(x=torch.zeros(MAX_ROWS + 1, 32)), r"x: 1\.\.16 rows .* got M=17"),
        (dict(x=torch.zeros(2, 3, 32)), r"x: expected a 2-d tensor \[M, H\]"),
        (dict(x=torch.zeros(2, 32, dtype=torch.int32)), r"x: expected dtype"),
        (dict(x=torch.zeros(2, 32, dtype=torch.float64, device="meta")), r"x: float64 runs on the CPU only"),
        (dict(up=torch.zeros(48, 32, dtype=torch.float16)), r"up: expected dtype torch.float32"),
        (dict(up=torch.zeros(40, 32)), r"gate, up: expected \[I, H=32\]"),
        (dict(gate=torch.zeros(48, 31)), r"gate, up: expected \[I, H=32\]"),
        (dict(down=torch.zeros(32, 40)), r"down: expected \[H=32, I=48\]"),
        (dict(down=torch.zeros(48, 32).t()), r"down: the last dim must have stride 1"),
        (dict(x=torch.zeros(32, 2).t()), r"x: the last dim must have stride 1"),
        (dict(gate=torch.zeros(48, 32, device="meta")), r"all tensors must be on one device"),
        (dict(residual=torch.zeros(2, 32)), r"residual: only with norm_weight"),
        (dict(norm_weight=torch.zeros(31)), r"norm_weight: expected \[H=32\]"),
        (dict(norm_weight=torch.zeros(1, 32)), r"norm_weight: expected a 1-d tensor \[H\]"),
        (dict(norm_weight=torch.zeros(32, dtype=torch.float16)), r"norm_weight: expected dtype torch.float32"),
        (dict(norm_weight=torch.zeros(32), eps=-1e-6), r"eps: the norm's epsilon must be finite and >= 0"),
        (dict(norm_weight=torch.zeros(32), eps=float("nan")), r"eps: the norm's epsilon must be finite"),
        (dict(norm_weight=torch.zeros(32), residual=torch.zeros(3, 32)), r"residual: expected x's shape \[M=2, H=32\]"),
        (dict(norm_weight=torch.zeros(32), residual=torch.zeros(32, 2).t()), r"residual: the last dim must have stride 1"),
        (dict(norm_weight=torch.zeros(32, device="meta")), r"all tensors must be on one device"),
    ],
)
def test_bad_inputs_are_refused_by_name(change, match):
    args = dict(x=torch.zeros(2, 32), gate=torch.zeros(48, 32), up=torch.zeros(48, 32), down=torch.zeros(32, 48))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fm._check_inputs(**args)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("block_m", 8, "block_m must be a power of two >= 16"),
        ("chunk", 48, "chunk must be a power of two >= 16"),
        ("block_k", 8, "block_k must be a power of two >= 16"),
        ("reduce_chunks", 3, "reduce_chunks must be a power of two"),
        ("num_warps", 3, "num_warps must be"),
        ("num_stages", 0, "num_stages must be in 1..8"),
        ("block_k", 512, "a TMA box spans at most 256 elements a dim"),
    ],
)
def test_bad_tiles_are_refused_by_name(field, value, match):
    x, gate, up, down = _inputs(2, 32, 48, torch.float32)
    cfg = choose_mlp_config(2, 32, 48, **{field: value}, tma=field == "block_k" and value == 512)
    with pytest.raises(ValueError, match=match):
        _launch_fused_mlp(x, gate, up, down, torch.empty(2, 32), cfg)


def test_default_tiles_fit_the_dims():
    assert choose_mlp_config(1, 4096, 14336) == MlpConfig(16, 64, 128, 128, tma=True)  # TMA: 3x faster on an H100
    small = choose_mlp_config(4, 20, 24)
    assert (small.chunk, small.block_k, small.block_h) == (32, 32, 32)
    with pytest.raises(ValueError, match=r"M: the fused MLP takes 1\.\.16 rows"):
        choose_mlp_config(17, 64, 64)


def test_measured_table_rules(monkeypatch):
    """A shape is fused only once the sweep measured it >= 2% faster than the unfused chain; the smallest swept
    row count at or above M stands in (never fewer rows: the workspace grows with M), and a 1-row entry serves
    only 1 row and the reverse."""
    monkeypatch.setattr(fm, "_MEASURED", {})
    assert measured_mlp_tiles(1, 4096, 14336) is None
    best = dict(chunk=32, block_k=256, block_h=64, num_warps=8, num_stages=4, reduce_block=64, reduce_chunks=8,
                tma=False)  # fmt: skip
    rows = [dict(M=1, H=4096, I=14336, unfused_us=90.0, best=dict(best, us=85.0)),
            dict(M=4, H=4096, I=14336, unfused_us=95.0, best=dict(best, us=94.0)),  # within 2%: unfused
            dict(M=8, H=4096, I=14336, unfused_us=95.0, best=None)]  # fmt: skip
    assert register_mlp_tiles(rows) == 2
    cfg = measured_mlp_tiles(1, 4096, 14336)
    assert cfg == MlpConfig(16, 32, 256, 64, 8, 4, 64, 8)
    # a row with the RMSNorm in front is judged by that pair (the layer's real neighbourhood)
    with_norm = dict(rows[0], unfused_norm_us=92.0, best_norm=dict(best, chunk=64, us=91.5))
    register_mlp_tiles([with_norm])
    assert measured_mlp_tiles(1, 4096, 14336) is None  # 91.5 is within 2% of 92: unfused
    register_mlp_tiles([dict(with_norm, best_norm=dict(best, chunk=64, us=85.0, tma=True))])
    cfg = measured_mlp_tiles(1, 4096, 14336)
    assert cfg.chunk == 64 and cfg.tma
    register_mlp_tiles(rows[:1])
    assert measured_mlp_tiles(4, 4096, 14336) is None
    assert measured_mlp_tiles(2, 4096, 14336) is None  # the 4-row entry stands in, and it lost
    register_mlp_tiles([dict(rows[1], best=dict(best, us=80.0))])
    assert measured_mlp_tiles(2, 4096, 14336).chunk == 32
    assert measured_mlp_tiles(5, 4096, 14336) is None  # 4 rows never stand in for more
    monkeypatch.delitem(fm._MEASURED, (1, 4096, 14336))
    assert measured_mlp_tiles(1, 4096, 14336) is None  # 4 rows do not stand in for a decode
    assert measured_mlp_tiles(17, 4096, 14336) is None
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        register_mlp_tiles([dict(rows[0], best=dict(best, chunk=24, us=1.0))])


def test_switch_values(monkeypatch):
    monkeypatch.setenv(fm.FUSED_MLP_ENV, "1")
    assert fm.fused_mlp_wanted()
    monkeypatch.setenv(fm.FUSED_MLP_ENV, "0")
    assert not fm.fused_mlp_wanted()
    monkeypatch.setenv(fm.FUSED_MLP_ENV, "yes")
    with pytest.raises(ValueError, match="TREECOMPILE_FUSED_MLP: expected 0 or 1, got 'yes'"):
        fm.fused_mlp_wanted()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 4, 16])
def test_bfloat16_8b_shape_on_cuda(M):
    """The 8B Llama's MLP (H 4096, I 14336) in bfloat16 through the op, default and narrow tiles, against
    float64; and captured in a CUDA graph, replayed with new rows written into the bound input."""
    x, gate, up, down = (t.cuda() for t in _inputs(M, 4096, 14336, torch.bfloat16, seed=M))
    for cfg in (None, choose_mlp_config(M, 4096, 14336, chunk=32, block_k=256, block_h=64, num_warps=8)):
        out = poisoned((M, 4096), torch.bfloat16, "cuda")
        _launch_fused_mlp(x, gate, up, down, out, cfg)
        _check(out, x, gate, up, down)
    static = x.clone()
    torch.ops.treespec.fused_mlp(static, gate, up, down, True)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = torch.ops.treespec.fused_mlp(static, gate, up, down, True)
    fresh = torch.randn_like(x)
    static.copy_(fresh)
    graph.replay()
    _check(got, fresh, gate, up, down)


@pytest.mark.interpreter  # the script's smoke mode is the interpreter's (it puts its tensors on the CPU)
def test_gpu_sweep_script_smoke(tmp_path, monkeypatch):
    """tests/gpu/mlp_sweep.py's smoke mode (interpreter, two tiny shapes): every config is checked against
    float64 and timed, and its JSON rows load into the measured table. Keeps the device script runnable."""
    import json
    import sys

    from conftest import gpu_script

    sweep = gpu_script("mlp_sweep")
    out = tmp_path / "mlp.json"
    monkeypatch.setattr(sys, "argv", ["mlp_sweep.py", str(out), "smoke"])
    monkeypatch.setattr(fm, "_MEASURED", {})
    sweep.main()
    rows = json.loads(out.read_text())
    assert [(r["M"], r["H"], r["I"]) for r in rows] == [(1, 40, 72), (3, 24, 64)]
    for r in rows:
        assert r["unfused_err"] < 1e-2 and all("error" not in c and c["err"] < 1e-2 for c in r["configs"])
        assert r["best"]["us"] == min(c["us"] for c in r["configs"])
        assert r["norm"] and all("error" not in c and c["err"] < 1e-2 for c in r["norm"])
        assert r["best_norm"]["us"] == min(c["us"] for c in r["norm"])
    assert register_mlp_tiles(rows) == 2 and set(fm._MEASURED) == {(1, 40, 72), (3, 24, 64)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 4])
def test_bfloat16_8b_shape_with_norm_on_cuda(M):
    """The 8B layer's residual add + post-attention RMSNorm inside the op (bfloat16, H 4096, I 14336), against
    float64 and against HF's rounding (the reference in bfloat16)."""
    x, gate, up, down = (t.cuda() for t in _inputs(M, 4096, 14336, torch.bfloat16, seed=M))
    norm_weight, residual = (t.cuda() for t in _norm_inputs(M, 4096, torch.bfloat16, seed=M))
    out = poisoned((M, 4096), torch.bfloat16, "cuda")
    _launch_fused_mlp(x, gate, up, down, out, None, norm_weight, residual, 1e-5)
    _check(out, x, gate, up, down, norm_weight, residual, 1e-5)
    want = fused_mlp_reference(x, gate, up, down, norm_weight, residual, 1e-5).float()
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)


def test_variant_installs_a_sweep_as_wins_or_as_it_was_measured(tmp_path, monkeypatch):
    """tests/gpu/variant.py --mlp-table installs a sweep's rows as measured (a shape that lost stays unfused);
    --mlp-table-all counts every swept shape's best tiles as a win (a round-level A/B of the op)."""
    import json

    from conftest import gpu_script

    variant = gpu_script("variant")
    best = dict(chunk=32, block_k=64, block_h=64, num_warps=4, num_stages=3, reduce_block=32, reduce_chunks=0)
    rows = [dict(M=1, H=64, I=96, unfused_us=10.0, best=dict(best, us=12.0)),
            dict(M=4, H=64, I=96, unfused_us=10.0, best=dict(best, us=8.0, tma=True))]  # fmt: skip
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(rows))
    monkeypatch.setattr(fm, "_MEASURED", {})
    assert variant.install_mlp_table(str(path)) == 2
    assert measured_mlp_tiles(1, 64, 96) is None and measured_mlp_tiles(4, 64, 96).tma
    monkeypatch.setattr(fm, "_MEASURED", {})
    assert variant.install_mlp_table(str(path), every_shape=True) == 2
    assert measured_mlp_tiles(1, 64, 96) == MlpConfig(16, 32, 64, 64, 4, 3, 32, 0)
