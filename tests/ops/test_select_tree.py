"""treespec::select_tree: the one-kernel tree selection against its two-sort torch reference and against the
plain-Python EAGLE-2 walk of tests/runtime/test_draft_tree.py, on DraftTree's own candidate records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import gpu_script, poisoned

from treecompile.ops.select_tree import _launch_select_tree, select_tree_reference, tree_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from test_draft_tree import MODES, NP_DTYPE, check_valid_tree, make_inputs, reference_round  # noqa: E402

from treecompile.draft_tree import DraftTree, TreeBatch  # noqa: E402

NAMES = ("tokens", "parents", "depth", "ancestor_mask", "candidate")
# (K, S, N): a one-node tree, chains (K = 1, one of depth 64), a lone step (S = 1), full trees
# (N - 1 == C), odd sizes, and the shipped (4, 5, 64) whose 68 candidates cross a 64-wide tile.
KERNEL_CONFIGS = [(1, 1, 1), (1, 3, 2), (1, 64, 64), (2, 3, 7), (3, 1, 4), (3, 2, 13), (3, 5, 33), (4, 4, 33),
                  (4, 5, 64), (4, 6, 63), (64, 1, 64)]  # fmt: skip


def candidates_of_a_round(K, S, N, B, mode, dtype, seed):
    """DraftTree's records of one round (scores, tokens, parents: [B, C]), the roots, and the round's inputs."""
    inputs = make_inputs(K, S, B, mode, dtype, seed)
    logp0, tokens0, steps, roots = inputs
    tree = DraftTree(K, S, N)
    lanes = tree.begin(logp0, tokens0)
    for child_logp, child_tokens in steps:
        lanes = tree.expand(lanes, child_logp, child_tokens)
    return (*tree.candidates(), roots), inputs


def run_kernel(scores, tokens, parents, roots, K, N, block_c=64, outputs=None, device="cpu"):
    """Launch on ``device`` (inputs moved there, outputs poisoned there unless given); the outputs on the CPU."""
    B = scores.shape[0]
    outs = outputs if outputs is not None else tuple(poisoned((B, N), torch.int64, device) for _ in NAMES)
    inputs = (t.to(device) for t in (scores, tokens, parents, roots))
    _launch_select_tree(*inputs, K, *outs, block_c=block_c)
    return tuple(o.cpu() for o in outs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=lambda c: "K{}-S{}-N{}".format(*c))
def test_kernel_matches_the_python_walk_and_the_reference(config, mode, kernel_device):
    """Poisoned outputs, every node written; each request's tree equals the independent Python walk's."""
    d = kernel_device
    K, S, N = config
    B = 3
    dtype = torch.float32 if (K + S + N) % 2 else torch.float64  # both score dtypes across the configs
    (scores, tokens, parents, roots), (logp0, tokens0, steps, _) = candidates_of_a_round(K, S, N, B, mode, dtype, 2)
    got = run_kernel(scores, tokens, parents, roots, K, N, device=d)
    check_valid_tree(TreeBatch(*got), N)
    want = select_tree_reference(scores, tokens, parents, roots, K, N)
    for name, g, w in zip(NAMES, got, want):
        assert torch.equal(g, w), name
    for b in range(B):
        _, tree = reference_round(
            logp0[b].tolist(), tokens0[b].tolist(), [cl[b].tolist() for cl, _ in steps],
            [ct[b].tolist() for _, ct in steps], K, S, N, NP_DTYPE[dtype],
        )  # fmt: skip
        tree["tokens"][0] = int(roots[b])
        for name in NAMES:
            assert got[NAMES.index(name)][b].tolist() == tree[name], f"{name} b={b}"


def test_many_candidates_and_tile_widths(kernel_device):
    """(8, 9, 64): 520 candidates, 9 tiles a side at the default width and 5 at 128, the lane window at bit 63;
    (4, 6, 63) in 16-wide tiles (6 a side). Each equals the reference."""
    d = kernel_device
    for (K, S, N), widths in (((8, 9, 64), (64, 128)), ((4, 6, 63), (16,))):
        (scores, tokens, parents, roots), _ = candidates_of_a_round(K, S, N, 2, "ties", torch.float32, 0)
        want = select_tree_reference(scores, tokens, parents, roots, K, N)
        for block_c in widths:
            got = run_kernel(scores, tokens, parents, roots, K, N, block_c=block_c, device=d)
            for name, g, w in zip(NAMES, got, want):
                assert torch.equal(g, w), (K, block_c, name)


def test_fuzzed_configs(kernel_device):
    """Random (K, S, N) within DraftTree's limits and random score modes, against the reference."""
    d = kernel_device
    g = torch.Generator().manual_seed(21)
    seen = 0
    while seen < 12:
        K = int(torch.randint(1, 7, (1,), generator=g))
        S = int(torch.randint(1, 64 // K + 2, (1,), generator=g))
        C = K + (S - 1) * K * K
        if (S - 1) * K > 64 or C > 200:
            continue
        N = int(torch.randint(max(1, (S - 1) * K), min(64, C + 1) + 1, (1,), generator=g))
        mode = MODES[int(torch.randint(0, len(MODES), (1,), generator=g))]
        (scores, tokens, parents, roots), _ = candidates_of_a_round(K, S, N, 2, mode, torch.float32, seen)
        got = run_kernel(scores, tokens, parents, roots, K, N, device=d)
        want = select_tree_reference(scores, tokens, parents, roots, K, N)
        for name, a, w in zip(NAMES, got, want):
            assert torch.equal(a, w), ((K, S, N), mode, name)
        seen += 1


def test_strided_inputs_and_outputs(kernel_device):
    """Inputs that are column slices of wider buffers, outputs that are transposed views (built on the kernel's
    device, so the launch sees these strides): strides obeyed."""
    d = kernel_device
    K, S, N, B = 3, 5, 33, 4
    (scores, tokens, parents, roots), _ = candidates_of_a_round(K, S, N, B, "some_nan", torch.float32, 1)
    want = select_tree_reference(scores, tokens, parents, roots, K, N)
    C = scores.shape[1]

    def wide(t):
        w = torch.full((B, 2 * C + 1), 0, dtype=t.dtype, device=d)
        w[:, 1::2] = t.to(d)
        return w[:, 1::2]

    outs = tuple(poisoned((N, B), torch.int64, d).t() for _ in NAMES)
    roots_strided = torch.stack([roots, roots], 1).to(d)[:, 1]
    got = run_kernel(wide(scores), wide(tokens), wide(parents), roots_strided, K, N, outputs=outs, device=d)
    for name, g, w in zip(NAMES, got, want):
        assert torch.equal(g, w), name


def test_op_on_cpu_is_the_reference_and_traces():
    K, S, N = 4, 5, 64
    (scores, tokens, parents, roots), _ = candidates_of_a_round(K, S, N, 2, "smooth", torch.float32, 3)
    want = select_tree_reference(scores, tokens, parents, roots, K, N)
    got = torch.ops.treespec.select_tree(scores, tokens, parents, roots, K, N)
    for name, g, w in zip(NAMES, got, want):
        assert torch.equal(g, w), name
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: torch.ops.treespec.select_tree(*a, K, N), backend="eager", fullgraph=True
    )  # fmt: skip
    for name, g, w in zip(NAMES, compiled(scores, tokens, parents, roots), want):
        assert torch.equal(g, w), name


def test_tree_steps():
    assert tree_steps(68, 4) == 5 and tree_steps(4, 4) == 1 and tree_steps(1, 1) == 1 and tree_steps(64, 1) == 64
    assert tree_steps(67, 4) is None and tree_steps(3, 4) is None and tree_steps(5, 0) is None


def _good():
    (scores, tokens, parents, roots), _ = candidates_of_a_round(2, 3, 7, 2, "smooth", torch.float32, 0)
    return scores, tokens, parents, roots


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: (a[0].half(), *a[1:], 2, 7), "scores: expected dtype torch.float32 or torch.float64"),
        (lambda a: (a[0][0], *a[1:], 2, 7), r"scores: expected a 2-d tensor \[B, C\]"),
        (lambda a: (a[0], a[1].int(), *a[2:], 2, 7), "tokens: expected dtype torch.int64"),
        (lambda a: (a[0], a[1], a[2][:, :5], a[3], 2, 7), r"parents: expected shape \(2, 10\) like scores"),
        (lambda a: (*a[:3], a[3][:1], 2, 7), r"root_tokens: expected \[B=2\]"),
        (lambda a: (*a[:3], a[3][:, None], 2, 7), "root_tokens: expected a 1-d tensor"),
        (lambda a: (*a, 3, 7), r"scores: C = scores.shape\[1\] = 10 is not topk \+ \(steps-1\) \* topk\^2"),
        (lambda a: (*a, 0, 7), "topk: expected an int >= 1, got 0"),
        (lambda a: (*a, 2, 0), r"num_nodes: the tree must have 1..64 nodes, got 0"),
        (lambda a: (*a, 2, 65), r"num_nodes: the tree must have 1..64 nodes, got 65"),
        (lambda a: (*a, 2, 12), "num_nodes: num_nodes - 1 = 11 exceeds the C = 10 candidates"),
        (lambda a: (a[0], a[1].to("meta"), *a[2:], 2, 7), "all tensors must be on one device"),
    ],
)  # fmt: skip
def test_bad_input_raises(change, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.select_tree(*change(_good()))


def test_gpu_bench_script_smoke(monkeypatch, tmp_path):
    """tests/gpu/tree_ops_bench.py's CPU smoke mode: one config, both forms, the same lanes and tree."""
    out = tmp_path / "tree_ops.json"
    monkeypatch.setattr(sys, "argv", ["tree_ops_bench.py", str(out), "--smoke"])
    gpu_script("tree_ops_bench").main()
    (row,) = json.loads(out.read_text())
    assert row["equal"] is True and (row["K"], row["S"], row["N"]) == (4, 5, 64)


def test_launcher_refuses_bad_tile():
    scores, tokens, parents, roots = _good()
    with pytest.raises(ValueError, match="block_c: expected a power of two >= 16, got 24"):
        run_kernel(scores, tokens, parents, roots, 2, 7, block_c=24)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(4, 5, 64), (8, 4, 24), (8, 9, 64), (1, 64, 64)],
                         ids=lambda c: "K{}-S{}-N{}".format(*c))  # fmt: skip
def test_cuda_kernel_equals_reference_and_replays(config):
    """On the GPU: the kernel equals the CPU reference for NaN- and tie-heavy rounds, and a captured launch
    replays onto new candidates written into the bound inputs."""
    K, S, N = config
    B = 5
    rounds = [candidates_of_a_round(K, S, N, B, mode, torch.float32, seed)[0]
              for seed, mode in enumerate(("some_nan", "ties", "nan_rows"))]  # fmt: skip
    wants = [select_tree_reference(*r, K, N) for r in rounds]
    bound = [t.cuda() for t in rounds[0]]
    op = torch.ops.treespec.select_tree
    for name, g, w in zip(NAMES, op(*bound, K, N), wants[0]):
        assert torch.equal(g.cpu(), w), name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = op(*bound, K, N)
    for r, want in zip(rounds[1:], wants[1:]):
        for dst, src in zip(bound, r):
            dst.copy_(src)
        graph.replay()
        for name, g, w in zip(NAMES, outs, want):
            assert torch.equal(g.cpu(), w), name
