"""A draft round's tree bookkeeping alone, with and without the treespec tree ops (``TREECOMPILE_TREE_KERNELS``: both,
and the expand_lanes op alone with the torch selection, "expand_op_us"):
DraftTree's begin, S-1 expands and select compiled by Inductor as in the speculator (``inductor=True``),
captured in one CUDA graph with random log-probs, and timed by replays. Checks first that both give the same lanes
and trees. The full 8B rounds (``treecompile.bench rounds``) time the same change inside a round, where a few us
are within their run-to-run spread; this isolates it.

    python3 tests/gpu/tree_ops_bench.py [OUT.json] [--smoke]

``--smoke`` runs one small config eagerly on the CPU (the test suite's check that the script runs).
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from treecompile.draft_tree import DraftTree

CONFIGS = [(4, 5, 64, 1), (4, 5, 64, 4), (8, 4, 24, 1), (10, 6, 64, 1)]  # (K, S, N, B): the 8B bench's, others
REPS = 200


def inputs(K, S, B, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def logp(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64).log().sort(-1, descending=True).values.float()

    steps = [(logp(B, K, K), torch.randint(0, 32000, (B, K, K), generator=g)) for _ in range(S - 1)]
    tensors = (logp(B, K), torch.randint(0, 32000, (B, K), generator=g), torch.randint(0, 32000, (B,), generator=g))
    return [t.to(device) for t in tensors], [(a.to(device), b.to(device)) for a, b in steps]


def one_round(tree, logp0, tokens0, roots, steps):
    lanes = tree.begin(logp0, tokens0)
    for child_logp, child_tokens in steps:
        lanes = tree.expand(lanes, child_logp, child_tokens)
    t = tree.select(roots)
    return (lanes.tokens, lanes.mask, t.tokens, t.parents, t.depth, t.ancestor_mask, t.candidate)


def time_graph(fn) -> float:
    """Median us of a replay of ``fn`` captured in a CUDA graph (after warm-up runs that compile)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def op_latencies(K, S, N, B) -> dict:
    """Each op alone, eager, 20 launches back to back in one CUDA graph: us a launch (its latency in a replay)."""
    from treecompile.ops.expand_lanes import expand_lanes_reference

    (logp0, tokens0, roots), steps = inputs(K, S, B, "cuda")
    tree = DraftTree(K, S, N)
    lanes = tree.begin(logp0, tokens0)
    for child_logp, child_tokens in steps:
        lanes = tree.expand(lanes, child_logp, child_tokens)
    scores, tokens, parents = tree.candidates()
    own, first = torch.zeros(K, dtype=torch.int64, device="cuda"), torch.tensor(K, device="cuda")
    prev = expand_lanes_reference(logp0[:, None], tokens0[:, None], own, torch.tensor(0, device="cuda"))
    calls = {
        "select_tree": lambda: torch.ops.treespec.select_tree(scores, tokens, parents, roots, K, N),
        "expand_lanes": lambda: torch.ops.treespec.expand_lanes(*steps[0], own, first, prev[3], prev[4], prev[5]),
    }
    return {name: time_graph(lambda f=f: [f() for _ in range(20)]) / 20 for name, f in calls.items()}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    smoke = "--smoke" in sys.argv
    device = "cpu" if smoke else "cuda"
    rows = []
    for K, S, N, B in CONFIGS[:1] if smoke else CONFIGS:
        (logp0, tokens0, roots), steps = inputs(K, S, B, device)
        results, row = {}, dict(K=K, S=S, N=N, B=B)
        for kernels, key in ((False, "torch_us"), (True, "ops_us"), ("expand", "expand_op_us")):
            tree = DraftTree(K, S, N, inductor=not smoke, tree_kernels=kernels)
            results[kernels] = one_round(tree, logp0, tokens0, roots, steps)
            if not smoke:
                run = functools.partial(one_round, tree, logp0, tokens0, roots, steps)
                row[key] = time_graph(run)
        row["equal"] = all(
            torch.equal(a, b) for other in (True, "expand") for a, b in zip(results[False], results[other])
        )
        if not smoke:
            row.update({f"{k}_us": v for k, v in op_latencies(K, S, N, B).items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args:
        with open(args[0], "w") as f:
            json.dump(rows, f, indent=1)
    if not all(r["equal"] for r in rows):
        raise SystemExit("the tree ops disagree with the torch references")


if __name__ == "__main__":
    main()
