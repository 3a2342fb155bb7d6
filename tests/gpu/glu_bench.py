"""treespec::skinny_glu against what it replaces, at the 8B verify's MLP shape (64 rows, I 14336, K 4096): cuBLAS
gate/up + a compiled silu-mul, the plain skinny GEMM's tiles + that kernel, and the fused op. Checks the op's values
against the float64 unfused graph first. Weights rotate over copies (cold reads, as in a forward), and the copy
bandwidth measured here gives the weight-read floor.

    python3 tests/gpu/glu_bench.py [OUT.json] [sweep]

``sweep`` also times the op over its tile space (features a half, K step, warps, stages; each config checked against
the float64 reference first) and prints the best: the tiles ``glu_config`` derives from the gate/up GEMM's entry
(half its slice width) were never swept for the fused op itself. ``TREECOMPILE_SKINNY_GLU_TILES`` runs a winner
in a round.
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton

from paired_sweep import sweep_tiles
from treecompile.bench.rounds import measure_copy_bandwidth
from treecompile.ops.skinny_glu import _launch_skinny_glu, glu_config, skinny_glu_reference

M, I, K = 64, 14336, 4096
COPIES = 8


def silu_mul(gu):
    g, u = gu.split(I, dim=-1)
    return (F.silu(g.float()) * u.float()).to(gu.dtype)


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt)
    ws = [(torch.randn(2 * I, K, device=dev) / K**0.5).to(dt) for _ in range(COPIES)]
    out = torch.empty(M, I, device=dev, dtype=dt)
    want = skinny_glu_reference(x.double(), ws[0].double())
    got = torch.ops.treespec.skinny_glu(x, ws[0])
    scale = want.abs().max().item()  # errors relative to the largest output: bf16 rounds ~2^-8 of a value
    err = (got.double() - want).abs().max().item() / scale
    err16 = (got.double() - silu_mul(F.linear(x, ws[0])).double()).abs().max().item()
    bw = measure_copy_bandwidth(torch.device(dev), 1 << 30)  # as the rounds bench measures its floors
    floor_us = 2 * I * K * 2 / bw * 1e6
    print(f"config {glu_config(M, I, K)}; max |op - float64| / max |float64| {err:.5f}, |op - bf16 unfused| {err16:.4f}; "
          f"copy {bw / 1e12:.2f} TB/s, weight-read floor {floor_us:.2f} us")  # fmt: skip
    if not err < 1e-2:
        raise SystemExit(f"skinny_glu differs from the float64 reference by {err}")
    silu_mul_c = torch.compile(silu_mul)
    silu_mul_c(F.linear(x, ws[0]))
    i = [0]

    def nxt():
        i[0] = (i[0] + 1) % COPIES
        return ws[i[0]]

    rows = {
        "cublas gate/up": lambda: F.linear(x, nxt()),
        "cublas gate/up + compiled silu-mul": lambda: silu_mul_c(F.linear(x, nxt())),
        "skinny_glu": lambda: torch.ops.treespec.skinny_glu(x, nxt()),
    }
    result = {"config": list(glu_config(M, I, K)), "max_err_f64": err, "max_err_bf16": err16,
              "copy_tb_s": bw / 1e12, "floor_us": floor_us}  # fmt: skip
    for name, fn in rows.items():
        us = triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3
        result[name] = us
        print(f"{name:36s} {us:8.2f} us  ({us / floor_us:.3f}x the floor)")
    if "sweep" in sys.argv[2:]:
        def error(cfg):
            out.fill_(float("nan"))
            _launch_skinny_glu(x, ws[0], out, cfg)
            return (out.double() - want).abs().max().item() / scale

        result["sweep"] = sweep_tiles(
            (32, 64, 128), error, lambda c: _launch_skinny_glu(x, nxt(), out, c), 1e-2, floor_us
        )
    if len(sys.argv) > 1:
        json.dump(result, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
