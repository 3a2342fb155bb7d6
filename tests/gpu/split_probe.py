"""Issue 3 lead (thirty-seventh session): at P = 4k, N = 16 the sweep found 16 splits with one-warp merges 8%
faster than the default's 32 splits with four-warp merges, and at 16k the default best. Is it the split count
or the merge's warps, and where is the crossover? Per layer (bench attention's method), the paged cascade at
Hq=32 Hkv=8 D=128 bf16 for P in {2k, 4k, 8k, 16k} and N in {1, 16}: the default config, and explicit splits
{16, 24, 31, default} each with one- and four-warp merges. Every output is checked against the default's.

    python3 tests/gpu/split_probe.py OUT.json
"""

import json
import sys

import torch

import treecompile  # noqa: F401  registers torch.ops.treespec
from treecompile.bench.attention import HKV, HQ, D, PAGE, B, Point, _time_graph, layers_for
from treecompile.ops._tree_attention_kernels import choose_config


def main(path: str) -> None:
    gen = torch.Generator().manual_seed(7)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for N in (1, 16):
        for P in (2048, 4096, 8192, 16384):
            L = layers_for(P, N, 16, l2)
            point = Point(P, N, L, gen)
            cap = point.max_pages * PAGE
            dev = torch.device("cuda")
            default = choose_config(B, N, HQ, HKV, D, cap, dev)
            base = point.cascade(default)[0]()
            row = {"P": P, "N": N, "L": L, "default": default.__dict__,
                   "default_us": _time_graph(point.cascade(default), reps=30)[0] / L * 1e3, "variants": []}
            for ns in sorted({16, 24, 31, default.num_splits}):
                for mw in (1, 4):
                    cfg = choose_config(B, N, HQ, HKV, D, cap, dev, ns, merge_warps=mw, merge_rows=1)
                    out = point.cascade(cfg)[0]()
                    ok = bool(torch.allclose(out.float(), base.float(), rtol=2e-2, atol=2e-2))
                    us = _time_graph(point.cascade(cfg), reps=30)[0] / L * 1e3
                    row["variants"].append({"splits": ns, "merge_warps": mw, "us": us, "ok": ok})
            best = min(row["variants"], key=lambda v: v["us"])
            print(f"P={P} N={N}: default {row['default_us']:.1f} us ({default.num_splits} splits, "
                  f"{default.merge_warps}-warp merge); " + "; ".join(
                      f"{v['splits']}/{v['merge_warps']}w {v['us']:.1f}{'' if v['ok'] else ' BAD'}"
                      for v in row["variants"]) + f"; best {best['splits']}/{best['merge_warps']}w", flush=True)
            results.append(row)
            del point
            torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
