"""Run a module with ``treespec::skinny_linear`` on the tiles a sweep measured best (GPU tuning runs).

``choose_skinny_config`` holds a placeholder rule until measured tiles replace it. This installs the
best config per (M, N, K) from a ``tests/gpu/skinny_sweep.py`` JSON (the nearest swept M of the same
(N, K), else the rule) and then runs the module as ``python -m`` would, so a benchmark times the tuned op:

    python3 tests/gpu/skinny_table.py sweep.json treecompile.bench e2e --skinny-linears ...
    python3 tests/gpu/skinny_table.py sweep.json tests/gpu/round_parts.py OUT_DIR ab4
"""

import json
import os
import runpy
import sys

from treecompile.ops import skinny_linear


def install(path: str) -> int:
    if not os.path.exists(path):  # no sweep yet: the placeholder rule
        return 0
    with open(path) as f:
        rows = [r for r in json.load(f) if r.get("best")]
    table: dict[tuple[int, int], list[tuple[int, dict]]] = {}
    for r in rows:
        table.setdefault((r["N"], r["K"]), []).append((r["M"], r["best"]))
    rule = skinny_linear.choose_skinny_config

    def choose(M, N, K, **override):
        swept = table.get((N, K))
        if not swept or override:
            return rule(M, N, K, **override)
        _, best = min(swept, key=lambda item: (abs(item[0] - M), item[0]))
        return rule(M, N, K, block_n=best["block_n"], block_k=best["block_k"], num_warps=best["warps"],
                    num_stages=best["stages"])  # fmt: skip

    skinny_linear.choose_skinny_config = choose
    return len(rows)


if __name__ == "__main__":
    print(f"skinny_table: {install(sys.argv[1])} swept shapes installed", flush=True)
    target = sys.argv[2]
    sys.argv = [target] + sys.argv[3:]
    if target.endswith(".py"):  # a script (tests/gpu/round_parts.py)
        sys.path.insert(0, target.rsplit("/", 1)[0])
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
