"""Run a module or script under one A/B variant of the round (GPU tuning runs, branch next/merged2).

    python3 tests/gpu/variant.py [--table SWEEP.json] [--no-gpu-table] [--mlp-table[-all] MLP.json] [--no-fold] [--old-routing] [--inductor KEY=VALUE ...] TARGET [args...]

``--table``: a ``tests/gpu/skinny_sweep.py`` JSON is added to ``skinny_linear``'s measured table
(``register_tiles``): its shapes use their best tiles where they beat cuBLAS, and stay on cuBLAS where not.
``--no-gpu-table``: this GPU's own measured entries (``skinny_linear._MEASURED_BY_GPU``) are dropped, so the
H200's table serves it (the baseline of an A/B of those entries).
``--mlp-table``: a ``tests/gpu/mlp_sweep.py`` JSON is added to ``fused_mlp``'s measured table
(``register_mlp_tiles``): its shapes run the fused MLP with their best tiles where it beat the unfused chain.
``--mlp-table-all``: the same, but every swept shape runs the fused MLP with its best tiles, won or lost (a
round-level A/B of the op as a whole).
``--no-fold``: the pass ``fuse_cache_write`` is left out, so each layer keeps its separate ``kv_write``.
``--old-routing``: ``skinny_linear.measured_tiles`` as before the forty-first session, whose ``min(..., key=...)``
breaks a Dynamo trace for a symbolic row count (the draft round's A/B: no change on an H200, 1.224 vs 1.222 ms).
``--inductor KEY=VALUE``: sets ``torch._inductor.config.KEY`` (a Python literal) for every compile of the
run, e.g. ``combo_kernels=True`` (Inductor fuses independent small kernels, such as a layer's q and k rope,
into one launch).
``--cascade-heavy FIELD=INT,...``: replaces cascade config fields (``CascadeConfig``) only for launches with
more than 128 query rows a KV head (verify N=64 at GQA 4: 256), e.g. ``num_splits=6`` for the verify while
the decode and draft lanes keep their own choice (``TREECOMPILE_CASCADE`` would set every launch).
``--cascade-light FIELD=INT,...``: the same for the other launches (decode, draft lanes, small verifies), e.g.
``merge_rows=1,merge_warps=1``.
TARGET is a module run as ``python -m`` would (``treecompile.bench``) or a script path (``tests/gpu/x.py``).
"""

import json
import os
import runpy
import sys

from treecompile.ops import skinny_linear


def install_table(path: str) -> int:
    if not os.path.exists(path):  # no sweep yet: the built-in table
        return 0
    with open(path) as f:
        return skinny_linear.register_tiles(json.load(f))


def install_mlp_table(path: str, every_shape: bool = False) -> int:
    from treecompile.ops import fused_mlp

    with open(path) as f:
        rows = json.load(f)
    if every_shape:  # the unfused baselines as infinitely slow: each shape's best tiles count as a win
        rows = [dict(r, unfused_us=float("inf"), unfused_norm_us=float("inf")) for r in rows]
    return fused_mlp.register_mlp_tiles(rows)


def drop_fold() -> None:
    import treecompile.passes as passes

    passes.PASSES[:] = [p for p in passes.PASSES if p is not passes.fuse_cache_write]


def cascade_fields(spec: str, heavy: bool) -> None:
    import treecompile.ops._tree_attention_kernels as kernels

    fields = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        fields[key] = bool(int(value)) if key == "tma" else int(value)
    base = kernels.choose_config

    def choose(B, R, Hq, Hkv, D, capacity, device, num_splits=None, itemsize=2, **override):
        if (R * (Hq // Hkv) > 128) == heavy:
            extra = dict(fields)
            if "num_splits" in extra and num_splits is None:
                num_splits = extra.pop("num_splits")
            extra.pop("num_splits", None)
            override = {**extra, **override}
        return base(B, R, Hq, Hkv, D, capacity, device, num_splits, itemsize, **override)

    kernels.choose_config = choose
    print(f"variant: cascade fields {fields} for launches of {'>' if heavy else '<='} 128 rows a KV head", flush=True)


def set_inductor(assignment: str) -> None:
    import ast

    import torch._inductor.config as config

    key, _, value = assignment.partition("=")
    if not hasattr(config, key):
        raise SystemExit(f"variant.py: --inductor {assignment}: torch._inductor.config has no {key!r}")
    setattr(config, key, ast.literal_eval(value))
    print(f"variant: torch._inductor.config.{key} = {getattr(config, key)!r}", flush=True)


def main() -> None:
    args = sys.argv[1:]
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--table":
            print(f"variant: {install_table(args.pop(0))} swept shapes installed", flush=True)
        elif flag == "--no-gpu-table":
            print(f"variant: {skinny_linear.gpu_class()}'s own tiles dropped", flush=True)
            skinny_linear._MEASURED_BY_GPU.clear()
        elif flag in ("--mlp-table", "--mlp-table-all"):
            count = install_mlp_table(args.pop(0), every_shape=flag == "--mlp-table-all")
            print(f"variant: {count} fused-MLP shapes installed ({flag})", flush=True)
        elif flag == "--no-fold":
            drop_fold()
            print("variant: fuse_cache_write left out", flush=True)
        elif flag in ("--cascade-heavy", "--cascade-light"):
            cascade_fields(args.pop(0), heavy=flag == "--cascade-heavy")
        elif flag == "--inductor":
            set_inductor(args.pop(0))
        elif flag == "--old-routing":  # measured_tiles as before the forty-first session (a graph break)
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from graph_breaks import old_measured_tiles

            skinny_linear.measured_tiles = old_measured_tiles
            print("variant: measured_tiles with min(key=...), the drafter's graph break", flush=True)
        else:
            raise SystemExit(f"variant.py: unknown flag {flag}")
    target = args[0]
    sys.argv = [target] + args[1:]
    if target.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
