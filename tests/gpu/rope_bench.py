"""treespec::skinny_qkv_rope against what it replaces, at the 8B verify's shape (64 rows, 32 q / 8 kv heads of 128,
K 4096): cuBLAS q/k/v + a compiled rotary kernel, and the skinny MMA tiles + that kernel. Checks the op's values
against the float64 unfused graph first. Weights rotate over copies (cold reads, as in a forward).

    python3 tests/gpu/rope_bench.py [OUT.json] [sweep]

``sweep`` also times the op over its tile space (half width, K step, warps, stages; each config checked against
the float64 reference first) and prints the best: the tiles ``rope_config`` derives from the q/k/v GEMM's entry
were never swept for the fused op itself.
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton

from paired_sweep import sweep_tiles
from treecompile.ops.skinny_qkv_rope import _launch_skinny_qkv_rope, rope_config, skinny_qkv_rope_reference

M, K, HQ, HKV, D = 64, 4096, 32, 8, 128
N = (HQ + 2 * HKV) * D
COPIES = 8


def rope(qkv, cos, sin):
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)

    def rot(a, h):
        a = a.float().view(M, h, D)
        r = torch.cat((-a[..., D // 2 :], a[..., : D // 2]), dim=-1)
        return (a * cos.float()[:, None] + r * sin.float()[:, None]).to(qkv.dtype).reshape(M, -1)

    return rot(q, HQ), rot(k, HKV), v.contiguous()


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt)
    ws = [(torch.randn(N, K, device=dev) / K**0.5).to(dt) for _ in range(COPIES)]
    pos = torch.randint(0, 2048, (M,), device=dev).double()
    freqs = pos[:, None] / 500000.0 ** (torch.arange(0, D, 2, device=dev).double() / D)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    got = torch.ops.treespec.skinny_qkv_rope(x, ws[0], None, cos, sin, HQ, HKV)
    want = skinny_qkv_rope_reference(x.double(), ws[0].double(), None, cos.double(), sin.double(), HQ, HKV)
    err = max((g.double() - w).abs().max().item() for g, w in zip(got, want))
    ref16 = rope(F.linear(x, ws[0]), cos, sin)
    err16 = max((g.double() - w.double()).abs().max().item() for g, w in zip(got, ref16))
    print(f"config {rope_config(M, N, K, D)}; max |op - float64| {err:.4f}, |op - bf16 unfused| {err16:.4f}")
    rope_c = torch.compile(rope)
    rope_c(F.linear(x, ws[0]), cos, sin)
    i = [0]

    def nxt():
        i[0] = (i[0] + 1) % COPIES
        return ws[i[0]]

    qkv0 = F.linear(x, ws[0])
    rows = {
        "cublas qkv": lambda: F.linear(x, nxt()),
        "cublas qkv + compiled rope": lambda: rope_c(F.linear(x, nxt()), cos, sin),
        "skinny_qkv_rope": lambda: torch.ops.treespec.skinny_qkv_rope(x, nxt(), None, cos, sin, HQ, HKV),
        "compiled rope alone": lambda: rope_c(qkv0, cos, sin),
    }
    out = {"config": list(rope_config(M, N, K, D)), "max_err_f64": err, "max_err_bf16": err16}
    for name, fn in rows.items():
        us = triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3
        out[name] = us
        print(f"{name:32s} {us:8.2f} us")
    if "sweep" in sys.argv[2:]:
        q, k, v = (t.clone() for t in got)
        def error(cfg):
            for t in (q, k, v):
                t.fill_(float("nan"))
            _launch_skinny_qkv_rope(x, ws[0], None, cos, sin, q, k, v, cfg)
            return max((g.double() - w).abs().max().item() for g, w in zip((q, k, v), want))

        out["sweep"] = sweep_tiles(
            (16, 32, 64), error, lambda c: _launch_skinny_qkv_rope(x, nxt(), None, cos, sin, q, k, v, c), 0.05
        )
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
