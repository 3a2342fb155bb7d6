"""A/B of the cascade's tuning variants at the shapes a round runs (GPU; thirteenth session).

    python3 tests/gpu/cascade_ab.py OUT.json [POINTS]      # POINTS: "2048:64,2048:1,65536:64" (P:N)

Per point (B=1, Hq=32, Hkv=8, D=128, bf16, page 64; 8B Llama shapes), per layer with the attention bench's
method (L layers over distinct caches in one CUDA graph, L2 cleaned before each replay, median replay / L):
the default config, TMA prefix tiles, merge programs of 2-8 rows on 1-8 warps, both kernels as dependent
launches, TMA with the fastest merge, split counts below the default, L2 hints, the merge fused into stage 1 (thirteenth session's run had no
split variants; the defaults have since become TMA + the one-warp merge rule, so "default" now means that). Every variant's output is compared with the default's. Then a
profile of eager calls splits the default's and the fastest variant's time into stage 1 and the merge.
The fastest variant per point is printed as a ``TREECOMPILE_CASCADE`` string, for the rounds A/B that follows.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import treecompile  # noqa: F401  registers torch.ops.treespec
from treecompile.bench.attention import HKV, HQ, PAGE, D, Point, _time_graph, layers_for
from treecompile.ops._tree_attention_kernels import choose_config

MERGES = [(1, 4), (2, 4), (4, 4), (8, 4), (1, 1), (2, 2), (4, 2), (8, 8), (16, 8)]


def kernel_split(point: Point, cfg, reps: int = 5) -> dict:
    """GPU time per layer of each kernel (stage 1, merge) over ``reps`` eager passes of all layers."""
    from torch.profiler import ProfilerActivity, profile

    fns = point.cascade(cfg)
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for fn in fns:
                fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if "cascade" in e.key:
            out[e.key] = e.device_time_total / (reps * len(fns))  # us per call
    return out


def main() -> None:
    path = sys.argv[1]
    spec = sys.argv[2] if len(sys.argv) > 2 else "2048:64,2048:1,2048:16,16384:64,65536:64,65536:16"
    points = [tuple(int(x) for x in item.split(":")) for item in spec.split(",")]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator().manual_seed(3)
    dev = torch.device("cuda")
    results = []
    for P, N in points:
        t0 = time.time()
        L = layers_for(P, N, 16, l2)
        point = Point(P, N, L, gen)
        cap = point.max_pages * PAGE
        base_cfg = choose_config(1, N, HQ, HKV, D, cap, dev, None)
        base = point.cascade(base_cfg)[0]()
        variants = {"default": base_cfg, "pdl": choose_config(1, N, HQ, HKV, D, cap, dev, None, pdl=True),
                    "tma": choose_config(1, N, HQ, HKV, D, cap, dev, None, tma=True)}  # fmt: skip
        for rows, warps in MERGES[1:]:
            variants[f"merge{rows}x{warps}w"] = choose_config(
                1, N, HQ, HKV, D, cap, dev, None, merge_rows=rows, merge_warps=warps
            )
        # Split counts below the default: the window programs (one column of the grid) then fit in the same
        # wave as the prefix programs (2k N=64: 8 splits x 32 + 32 window programs = 288 > 264 slots).
        ns = base_cfg.num_splits
        for splits in sorted({max(1, ns // 2), max(1, ns - 1), max(1, (3 * ns) // 4)} - {ns}):
            variants[f"splits{splits}"] = choose_config(1, N, HQ, HKV, D, cap, dev, splits)
        # L2 hints of each split's first tiles before the dependency wait (fourteenth session's l2_prefetch)
        for tiles in (1, 2, 4, 8):
            variants[f"l2pf{tiles}"] = choose_config(1, N, HQ, HKV, D, cap, dev, None, l2_prefetch=tiles)
        timed = {}
        for name, cfg in variants.items():
            try:
                out = point.cascade(cfg)[0]()
                err = ((out.float() - base.float()).abs().max()).item()
                ms = _time_graph(point.cascade(cfg), reps=30)[0] / L
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
                print(f"P={P} N={N} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            timed[name] = (ms, err, cfg)
            print(f"P={P} N={N} {name:14s} {ms * 1e3:7.2f} us/layer  max|diff| {err:.2e}", flush=True)
        merges = [n for n in timed if n.startswith("merge")] + ["default"]
        best_merge = min(merges, key=lambda n: timed[n][0])
        mr, mw = timed[best_merge][2].merge_rows, timed[best_merge][2].merge_warps
        combos = {
            "tma+" + best_merge: dict(tma=True, merge_rows=mr, merge_warps=mw),
            "tma+pdl+" + best_merge: dict(tma=True, merge_rows=mr, merge_warps=mw, pdl=True),
        }
        for name, extra in combos.items():
            cfg = choose_config(1, N, HQ, HKV, D, cap, dev, None, **extra)
            try:
                out = point.cascade(cfg)[0]()
                err = ((out.float() - base.float()).abs().max()).item()
                ms = _time_graph(point.cascade(cfg), reps=30)[0] / L
            except Exception as exc:  # noqa: BLE001
                print(f"P={P} N={N} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            timed[name] = (ms, err, cfg)
            print(f"P={P} N={N} {name:14s} {ms * 1e3:7.2f} us/layer  max|diff| {err:.2e}", flush=True)
        ok = {n: v for n, v in timed.items() if v[1] < 5e-2 and "pdl" not in n}  # pdl: set by env, not here
        best = min(ok, key=lambda n: ok[n][0])
        bc = ok[best][2]
        env = (f"tma={int(bc.tma)},merge_rows={bc.merge_rows},merge_warps={bc.merge_warps},"
               f"l2_prefetch={bc.l2_prefetch}")
        split = {"default": kernel_split(point, base_cfg), best: kernel_split(point, bc)}
        print(f"P={P} N={N} L={L}: default {timed['default'][0] * 1e3:.2f} us, best {best} "
              f"{ok[best][0] * 1e3:.2f} us -> TREECOMPILE_CASCADE={env}; kernels (us/call): {split} "
              f"[{time.time() - t0:.0f} s]", flush=True)  # fmt: skip
        results.append({"P": P, "N": N, "layers": L, "best": best, "env": env, "kernels": split,
                        "variants": {n: {"us": v[0] * 1e3, "max_diff": v[1], "config": v[2].__dict__}
                                     for n, v in timed.items()}})  # fmt: skip
        del point
        torch.cuda.empty_cache()
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
