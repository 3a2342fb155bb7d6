"""Run a module or script under one A/B variant of the round (GPU tuning runs, branch next/merged2).

    python3 tests/gpu/variant.py [--table SWEEP.json] [--no-fold] TARGET [args...]

``--table``: a ``tests/gpu/skinny_sweep.py`` JSON is added to ``skinny_linear``'s measured table
(``register_tiles``): its shapes use their best tiles where they beat cuBLAS, and stay on cuBLAS where not.
``--no-fold``: the pass ``fuse_cache_write`` is left out, so each layer keeps its separate ``kv_write``.
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


def drop_fold() -> None:
    import treecompile.passes as passes

    passes.PASSES[:] = [p for p in passes.PASSES if p is not passes.fuse_cache_write]


def main() -> None:
    args = sys.argv[1:]
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--table":
            print(f"variant: {install_table(args.pop(0))} swept shapes installed", flush=True)
        elif flag == "--no-fold":
            drop_fold()
            print("variant: fuse_cache_write left out", flush=True)
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
