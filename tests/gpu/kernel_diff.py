"""Per-kernel difference of two graph profiles written by ``tests/gpu/loop_profile.py PROFILE_DIR`` (JSON beside
each kernel table): which kernels a tree's verify graph runs that a plain step's does not, and which take longer.

    python3 tests/gpu/kernel_diff.py A.json [B.json] [--top 30]   (one file: its kernels, largest first)

Kernel names are Inductor's generated ones, so a fused kernel of one graph may carry another name in the other;
the totals and the launch counts are what compare exactly.
"""

from __future__ import annotations

import argparse
import json
import sys


def load(path: str) -> dict[str, tuple[float, float]]:
    with open(path) as f:
        doc = json.load(f)
    return {k["name"]: (k["calls_per_replay"], k["us_per_replay"]) for k in doc["kernels"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b", nargs="?")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    a, b = (load(args.a), load(args.b)) if args.b else ({}, load(args.a))
    names = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, (0, 0))[1] - a.get(n, (0, 0))[1]))
    print(f"{'kernel':70s} {'calls A':>8s} {'calls B':>8s} {'us A':>8s} {'us B':>8s} {'B - A':>8s}")
    for n in names[: args.top]:
        (ca, ta), (cb, tb) = a.get(n, (0, 0.0)), b.get(n, (0, 0.0))
        print(f"{n[:70]:70s} {ca:8.1f} {cb:8.1f} {ta:8.1f} {tb:8.1f} {tb - ta:+8.1f}")
    for label, d in (("A", a), ("B", b)):
        print(f"total {label}: {sum(c for c, _ in d.values()):.0f} launches, {sum(t for _, t in d.values()):.1f} us "
              f"of kernel time a replay")
    return 0


if __name__ == "__main__":
    sys.exit(main())
