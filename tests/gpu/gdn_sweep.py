"""Sweep the chunked GDN kernel's launch options at Qwen3-Next-80B shapes (H200 session tool, not a test).

For N = 8 and 16 (the chunked form's range), each variant (dot precision, value block): max error against
the float64 sequential reference on one request, then the time per layer of a graph of 20 layers (the
bench's method: L2 cleaned before each replay, median of 20), beside the sequential tree kernel. Prints one
line per point; writes JSON to argv[1]. Written for the next GPU session (tf32x3 took the Mamba2 chunked
kernel from 87 to 23 us at N = 64).
"""

import json
import sys

import torch
import torch.nn.functional as F

import treecompile  # noqa: F401
import treecompile.ops.gdn_chunk_tree as gc
import treecompile.ops.gdn_tree as gdn
from treecompile.bench.linear import eagle_tree
from treecompile.bench.rounds import Clock

HK, HV, DK, DV, LAYERS = 16, 32, 128, 128, 20
dev = torch.device("cuda")
clock = Clock(dev, 20)
out = []


def inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(q=r(1, n, HK, DK), k=r(1, n, HK, DK), v=r(1, n, HV, DV), g=F.logsigmoid(r(1, n, HV)),
                beta=torch.sigmoid(r(1, n, HV)), state=r(1, HV, DK, DV) * 0.5)


def to_dev(c):
    return {k: (v.float() if k == "state" else v.to(torch.bfloat16)).to(dev) for k, v in c.items()}


def width():
    return gdn.gdn_payload_width(HK, DK, HV, DV)


def all_of(fns):
    def run():
        for f in fns:
            f()
    return run


for n in (8, 16):
    parents, _ = eagle_tree(n, 1, seed=n)
    cd = to_dev(inputs(n, n))
    rounded = {k: v.cpu().double() for k, v in cd.items()}
    ws = torch.zeros(1, n, HV, DK, DV, dtype=torch.float64)
    want = torch.ops.treespec.gdn_tree_verify(*rounded.values(), parents, ws, torch.zeros(1, n, width(), dtype=torch.float64))
    pdev = parents.to(dev)
    layers = [to_dev(inputs(n, 1000 + i)) for i in range(LAYERS)]
    pls = [torch.zeros(1, n, width(), device=dev) for _ in range(LAYERS)]
    wsd = torch.zeros(1, n, HV, DK, DV, device=dev)
    seq = [lambda c=c, pl=pl: torch.ops.treespec.gdn_tree_verify(*c.values(), pdev, wsd, pl) for c, pl in zip(layers, pls)]
    us = clock.time(clock.capture(all_of(seq))) * 1e3 / LAYERS
    print(f"N={n} sequential tree: {us:.2f} us", flush=True)
    out.append(dict(n=n, variant="sequential", us=us))
    for prec in ("ieee", "tf32x3"):
        for bv in (16, 32, 64):
            try:
                o = torch.empty(1, n, HV, DV, dtype=torch.bfloat16, device=dev)
                pl = torch.zeros(1, n, width(), device=dev)
                gc._launch_gdn_tree_verify_chunked(*cd.values(), pdev, pl, o, None, True, block_v=bv, precision=prec)
                err = ((o.double().cpu() - want).abs().max() / want.abs().max()).item()
                os_ = [torch.empty(1, n, HV, DV, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
                fns = [lambda c=c, pl=pl, o=o: gc._launch_gdn_tree_verify_chunked(
                    *c.values(), pdev, pl, o, None, True, block_v=bv, precision=prec) for c, pl, o in zip(layers, pls, os_)]
                us = clock.time(clock.capture(all_of(fns))) * 1e3 / LAYERS
                print(f"N={n} chunked {prec} block_v={bv}: {us:.2f} us, max rel err {err:.2e}", flush=True)
                out.append(dict(n=n, variant=f"{prec}/bv{bv}", us=us, err=err))
            except Exception as e:  # noqa: BLE001
                print(f"N={n} chunked {prec} block_v={bv}: fail {type(e).__name__}: {str(e)[:200]}", flush=True)
                clock.recover()
json.dump(out, open(sys.argv[1], "w"), indent=1)
