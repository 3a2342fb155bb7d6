"""Where a round's time goes between kernels: reads a Chrome trace written by ``treecompile.bench rounds --profile``
(``<name>.trace.json``, several replays of one round) and prints, per replay, its span (first kernel start to last
kernel end), the kernels' busy time, the idle gaps, and the kernels summed by name; then the largest gaps with the
kernels on either side. Runs anywhere (CPU): it only reads the JSON.

Under programmatic dependent launches a kernel starts while its predecessor runs and waits inside (``gdc_wait``),
so its own duration counts that wait and busy time can exceed the span. The "timeline share" column charges each
kernel only for how far it pushes the round's end: ``end - max(previous ends)``, at least 0, in start order. Those
shares sum to the span less its idle gaps, and they are what removing or speeding up the kernel could save.

    python3 tests/gpu/trace_gaps.py TRACE.json [--replays 5] [--top 15] [--by-name 25]
"""

from __future__ import annotations

import argparse
import collections
import json


def kernels(path: str) -> list[tuple[float, float, str]]:
    """``(start us, duration us, name)`` of every GPU kernel event, in start order."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = [
        (float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "?"))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(out)


def replays(events: list[tuple[float, float, str]], split_gap_us: float) -> list[list[tuple[float, float, str]]]:
    """Cut the kernel stream where the device idles longer than ``split_gap_us`` (between graph replays)."""
    groups: list[list] = []
    end = None
    for ev in events:
        if end is None or ev[0] - end > split_gap_us:
            groups.append([])
        groups[-1].append(ev)
        end = ev[0] + ev[1] if end is None else max(end, ev[0] + ev[1])
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=15, help="largest gaps listed (last replay)")
    parser.add_argument("--by-name", type=int, default=25, help="kernel names listed by total time (last replay)")
    parser.add_argument("--split-gap", type=float, default=200.0, help="idle us that separates two replays")
    parser.add_argument("--replays", type=int, default=0,
                        help="cut the stream into this many equal runs of kernels instead (replays back to back)")
    args = parser.parse_args(argv)
    events = kernels(args.trace)
    if args.replays > 0 and len(events) % args.replays == 0:
        n = len(events) // args.replays
        groups = [events[i * n:(i + 1) * n] for i in range(args.replays)]
    else:
        groups = replays(events, args.split_gap)
    if not groups:
        print("no kernel events in", args.trace)
        return 1
    for i, g in enumerate(groups):
        span = max(s + d for s, d, _ in g) - g[0][0]
        busy = sum(d for _, d, _ in g)
        print(f"replay {i}: {len(g)} kernels, span {span:.1f} us, busy {busy:.1f} us, idle {span - busy:.1f} us")
    last = groups[-1]
    gaps = []
    for (s0, d0, n0), (s1, _, n1) in zip(last, last[1:]):
        gaps.append((s1 - (s0 + d0), n0, n1))
    print("\nlargest gaps of the last replay (us):")
    for gap, n0, n1 in sorted(gaps, reverse=True)[: args.top]:
        print(f"  {gap:7.2f}  {n0[:60]}  ->  {n1[:60]}")
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    share: dict[str, float] = collections.defaultdict(float)
    for n, extra in timeline_shares(last):
        share[n] += extra
    for _, d, n in last:
        by_name[n].append(d)
    print("\nkernels of the last replay by timeline share (us): share, total, count, mean")
    for n, ds in sorted(by_name.items(), key=lambda kv: -share[kv[0]])[: args.by_name]:
        print(f"  {share[n]:8.1f} {sum(ds):8.1f} {len(ds):4d} {sum(ds) / len(ds):7.2f}  {n[:100]}")
    print(f"  {sum(share.values()):8.1f} in all")
    return 0


def timeline_shares(events: list[tuple[float, float, str]]) -> list[tuple[str, float]]:
    """``(name, us)`` per kernel, in start order: how far its end passes every earlier kernel's end."""
    out, reach = [], None
    for start, dur, name in events:
        end = start + dur
        if reach is None:
            out.append((name, dur))
            reach = end
        else:
            out.append((name, max(0.0, end - max(reach, start))))
            reach = max(reach, end)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
