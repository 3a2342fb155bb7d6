"""Sweep the chunked Mamba2 kernel's launch options at Mamba2-2.7B shapes (H200 session tool, not a test).

For each N, each variant (dot precision, head-dim block, warps): max error against the float64
sequential reference on one request, then the time per layer of a graph of 20 layers (the bench's
method: L2 cleaned before each replay, median of 20). Prints one line per point; writes JSON to argv[1].
"""

import json
import sys

import torch

import treecompile  # noqa: F401
import treecompile.ops.mamba2_chunk_tree as mc
import treecompile.ops.mamba2_tree as m2
from treecompile.bench.linear import eagle_tree
from treecompile.bench.rounds import Clock

H, P, G, S, LAYERS = 80, 64, 1, 128, 20
dev = torch.device("cuda")
clock = Clock(dev, 20)
out = []


def inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(x=r(1, n, H, P), dt=r(1, n, H), A=-torch.exp(r(H) * 0.5), B=r(1, n, G, S), C=r(1, n, G, S),
                D=r(H), dt_bias=r(H) * 0.5, state=r(1, H, P, S) * 0.5)


def to_dev(c):
    return {k: (v.to(torch.bfloat16) if k in ("x", "dt", "B", "C") else v.float()).to(dev) for k, v in c.items()}


VARIANTS = [(prec, bp, nw) for prec in ("ieee", "tf32x3", "tf32") for bp in (32, 64) for nw in (4, 8)]
for n in (1, 8, 16, 32, 64):
    parents, _ = eagle_tree(n, 1, seed=n) if n > 1 else (torch.full((1, 1), -1), None)
    c64 = inputs(n, n)
    cd = to_dev(c64)
    rounded = {k: v.cpu().double() for k, v in cd.items()}
    pl64 = torch.zeros(1, n, m2.mamba2_payload_width(H, P, G, S), dtype=torch.float64)
    want = torch.ops.treespec.mamba2_tree_verify(*rounded.values(), parents, pl64)
    pdev = parents.to(dev)
    layers = [to_dev(inputs(n, 1000 + i)) for i in range(LAYERS)]
    pls = [torch.zeros(1, n, m2.mamba2_payload_width(H, P, G, S), device=dev) for _ in range(LAYERS)]
    ys = [torch.empty(1, n, H, P, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    seq_fns = [lambda c=c, pl=pl: torch.ops.treespec.mamba2_tree_verify(*c.values(), pdev, pl) for c, pl in zip(layers, pls)]

    def all_of(fns):
        def run():
            for f in fns:
                f()
        return run

    us = clock.time(clock.capture(all_of(seq_fns))) * 1e3 / LAYERS
    print(f"N={n} sequential tree: {us:.2f} us", flush=True)
    out.append(dict(n=n, variant="sequential", us=us))
    for prec, bp, nw in VARIANTS:
        try:
            y = torch.empty(1, n, H, P, dtype=torch.bfloat16, device=dev)
            pl = torch.zeros(1, n, m2.mamba2_payload_width(H, P, G, S), device=dev)
            mc._launch_mamba2_tree_verify_chunked(*cd.values(), pdev, pl, y, True, None, None,
                                                  block_p=bp, num_warps=nw, precision=prec)
            err = ((y.double().cpu() - want).abs().max() / want.abs().max()).item()
            fns = [lambda c=c, pl=pl, y=y: mc._launch_mamba2_tree_verify_chunked(
                *c.values(), pdev, pl, y, True, None, None, block_p=bp, num_warps=nw, precision=prec)
                for c, pl, y in zip(layers, pls, ys)]
            us = clock.time(clock.capture(all_of(fns))) * 1e3 / LAYERS
            print(f"N={n} chunked {prec} bp={bp} w={nw}: {us:.2f} us, max rel err {err:.2e}", flush=True)
            out.append(dict(n=n, variant=f"{prec}/bp{bp}/w{nw}", us=us, err=err))
        except Exception as e:  # noqa: BLE001
            print(f"N={n} chunked {prec} bp={bp} w={nw}: fail {type(e).__name__}: {str(e)[:200]}", flush=True)
            clock.recover() if hasattr(clock, "recover") else None
json.dump(out, open(sys.argv[1], "w"), indent=1)
