"""DraftTree against an independent per-request EAGLE-2-style reference, plus structural properties.

The reference below works on plain Python lists, one request at a time: expand the K lanes of each step,
carry the K best children forward, keep the best N-1 candidates by cumulative log-prob (ties to the lower
candidate id, NaN last), and number them by a recursive depth-first walk, best child first. Scores use
NumPy scalars of the tree's score dtype so float32 rounding matches the implementation's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from treecompile.draft_tree import DraftTree, TreeBatch, ascending_unique, rank_order

# (K, S, N): odd sizes, N = 1, 2, 33, 63, 64, full trees (N - 1 == K + (S-1)K^2), K = 1 chains,
# and (8, 9, 64) whose lane window reaches bit 63.
CONFIGS = [
    (1, 1, 1),
    (1, 1, 2),
    (1, 3, 2),
    (1, 64, 64),
    (2, 2, 2),
    (2, 3, 7),
    (3, 1, 4),
    (3, 2, 13),
    (3, 5, 33),
    (4, 4, 33),
    (4, 6, 63),
    (8, 6, 64),
    (8, 9, 64),
    (64, 1, 64),
]
MODES = ["smooth", "ties", "nan_rows", "some_nan"]
NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}


def _cid(config):
    return "K{}-S{}-N{}".format(*config)


# ---------------------------------------------------------------------------------------------------
# Independent reference (plain Python, one request)


@dataclass
class _Cand:
    cid: int
    score: object  # NumPy scalar of the score dtype
    token: int
    parent: int  # parent candidate id, -1 for the root
    depth: int


def _clamp(x):
    return x if (np.isnan(x) or x <= 0) else type(x)(0)


def _rank_key(c: _Cand):
    nan = bool(np.isnan(c.score))
    return (nan, 0.0 if nan else -float(c.score), c.cid)


def _to_int64(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def reference_round(logp0, tokens0, child_logps, child_tokens, K, S, N, np_dtype):
    """One request. logp0/tokens0: [K] lists; child_*: per step s=1..S-1 a [K][K] list.

    Returns (lanes, tree): lanes[s-1] = dict of per-lane lists for step s (1..S), tree = dict of [N] lists.
    """
    cands = [
        _Cand(k, np_dtype(0) + _clamp(np_dtype(logp0[k])), tokens0[k], -1, 1) for k in range(K)
    ]
    lanes = sorted(cands, key=_rank_key)
    lane_masks = [(1 << r) if S > 1 else 0 for r in range(K)]
    lane_parent = [0] * K
    history = []
    for s in range(1, S + 1):
        history.append(
            dict(
                tokens=[c.token for c in lanes],
                scores=[float(c.score) for c in lanes],
                mask=[_to_int64(m) for m in lane_masks],
                candidate=[c.cid for c in lanes],
                parent_lane=list(lane_parent),
            )
        )
        if s == S:
            break
        children = []
        for r, lane in enumerate(lanes):
            for c in range(K):
                cid = K + (s - 1) * K * K + r * K + c
                score = lane.score + _clamp(np_dtype(child_logps[s - 1][r][c]))
                children.append((_Cand(cid, score, child_tokens[s - 1][r][c], lane.cid, s + 1), r))
        cands += [c for c, _ in children]
        best = sorted(children, key=lambda cr: _rank_key(cr[0]))[:K]
        own = [(1 << (s * K + r)) if s + 1 < S else 0 for r in range(K)]
        lane_masks = [lane_masks[pr] | own[r] for r, (_, pr) in enumerate(best)]
        lane_parent = [pr for _, pr in best]
        lanes = [c for c, _ in best]

    kept = sorted(cands, key=_rank_key)[: N - 1]
    kept_ids = {c.cid for c in kept}
    children_of = {-1: []}
    for c in kept:  # already in rank order, so each child list is best first
        assert c.parent == -1 or c.parent in kept_ids, "kept set not closed under parents"
        children_of.setdefault(c.parent, []).append(c)
        children_of.setdefault(c.cid, [])
    tree = dict(parents=[-1], depth=[0], tokens=[None], candidate=[-1], ancestor_mask=[1])

    def visit(cid, node, mask):
        for child in children_of[cid]:
            index = len(tree["parents"])
            tree["parents"].append(node)
            tree["depth"].append(child.depth)
            tree["tokens"].append(child.token)
            tree["candidate"].append(child.cid)
            tree["ancestor_mask"].append(mask | (1 << index))
            visit(child.cid, index, mask | (1 << index))

    visit(-1, 0, 1)
    tree["ancestor_mask"] = [_to_int64(m) for m in tree["ancestor_mask"]]
    return history, tree


# ---------------------------------------------------------------------------------------------------
# Inputs and a driver


def make_inputs(K, S, B, mode, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 1000

    def logp(*shape):
        if mode == "ties":  # a handful of values: equal scores everywhere, -inf next to NaN, and
            # positive log-probs the clamp turns into 0 (a child tying its parent)
            choices = torch.tensor([0.0, -0.5, -1.0, -1.5, float("-inf"), 0.5, float("nan")], dtype=dtype)
            return choices[torch.randint(0, len(choices), shape, generator=g)]
        # A drafter's top-k log-probs: sorted, distinct, negative.
        x = torch.rand(*shape, generator=g, dtype=torch.float64).log()
        x = x.sort(-1, descending=True).values.to(dtype)
        if mode == "nan_rows":  # padded requests: whole rows NaN (request 0 always)
            pad = torch.rand(B, generator=g) < 0.5
            pad[0] = True
            x[pad] = float("nan")
        elif mode == "some_nan":
            x[torch.rand(*shape, generator=g) < 0.2] = float("nan")
        return x

    logp0 = logp(B, K)
    tokens0 = torch.randint(0, vocab, (B, K), generator=g)
    steps = [(logp(B, K, K), torch.randint(0, vocab, (B, K, K), generator=g)) for _ in range(S - 1)]
    roots = torch.randint(0, vocab, (B,), generator=g)
    return logp0, tokens0, steps, roots


def run_round(tree: DraftTree, logp0, tokens0, steps, roots):
    lanes = tree.begin(logp0, tokens0)
    history = [lanes]
    for child_logp, child_tokens in steps:
        lanes = tree.expand(lanes, child_logp, child_tokens)
        history.append(lanes)
    return history, tree.select(roots)


def check_valid_tree(t: TreeBatch, N: int):
    """Structural validity every selected tree must have, whatever its scores."""
    B = t.parents.shape[0]
    for name in ("tokens", "parents", "depth", "ancestor_mask", "candidate"):
        value = getattr(t, name)
        assert value.shape == (B, N) and value.dtype == torch.int64, name
    assert (t.parents[:, 0] == -1).all() and (t.depth[:, 0] == 0).all() and (t.ancestor_mask[:, 0] == 1).all()
    node = torch.arange(N)
    if N > 1:
        p = t.parents[:, 1:]
        assert ((p >= 0) & (p < node[1:])).all(), "parents[i] must lie in [0, i)"
        assert (t.depth[:, 1:] == t.depth.gather(1, p) + 1).all()
        own = torch.bitwise_left_shift(torch.ones_like(node), node)
        assert (t.ancestor_mask[:, 1:] == t.ancestor_mask.gather(1, p) | own[1:]).all()
        ids = t.candidate[:, 1:].sort(dim=1).values
        assert (ids >= 0).all() and (ids[:, 1:] > ids[:, :-1]).all(), "candidates must be distinct"


# ---------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", CONFIGS, ids=_cid)
def test_matches_eagle2_reference(config, mode, dtype):
    K, S, N = config
    B = 4
    tree = DraftTree(K, S, N)
    for seed in range(3):
        logp0, tokens0, steps, roots = make_inputs(K, S, B, mode, dtype, seed)
        history, got = run_round(tree, logp0, tokens0, steps, roots)
        check_valid_tree(got, N)
        for b in range(B):
            ref_lanes, ref_tree = reference_round(
                logp0[b].tolist(),
                tokens0[b].tolist(),
                [cl[b].tolist() for cl, _ in steps],
                [ct[b].tolist() for _, ct in steps],
                K, S, N, NP_DTYPE[dtype],
            )
            ref_tree["tokens"][0] = int(roots[b])
            for name, want in ref_tree.items():
                assert getattr(got, name)[b].tolist() == want, f"{name} b={b} seed={seed}"
            for lanes, want in zip(history, ref_lanes):
                for name in ("tokens", "mask", "candidate", "parent_lane"):
                    got_lane = getattr(lanes, name)[b].tolist()
                    assert got_lane == want[name], f"lanes.{name} step={lanes.step} b={b}"
                got_scores = lanes.scores[b].tolist()
                assert lanes.scores.dtype == dtype
                pairs = zip(got_scores, want["scores"], strict=True)
                assert all(g == w or (g != g and w != w) for g, w in pairs), f"lanes.scores b={b}"
        assert [lanes.step for lanes in history] == list(range(1, S + 1))


@pytest.mark.parametrize("config", [(2, 3, 7), (3, 5, 33), (4, 6, 63), (8, 6, 64)], ids=_cid)
def test_depth_first_best_child_first(config):
    K, S, N = config
    tree = DraftTree(K, S, N)
    B = 8
    logp0, tokens0, steps, roots = make_inputs(K, S, B, "smooth", torch.float64, seed=11)
    _, t = run_round(tree, logp0, tokens0, steps, roots)
    check_valid_tree(t, N)
    scores, _, _ = tree.candidates()  # recorded cumulative scores, candidate-id order
    node_score = torch.cat([torch.zeros(B, 1, dtype=scores.dtype), scores.gather(1, t.candidate[:, 1:])], 1)
    for b in range(B):
        parents = t.parents[b].tolist()
        # Node 1 is the best candidate overall; a node's first child is the next node (preorder).
        assert node_score[b, 1] == scores[b].max()
        children = {i: [j for j in range(1, N) if parents[j] == i] for i in range(N)}
        for i, kids in children.items():
            if kids:
                assert kids[0] == i + 1
            ks = node_score[b, kids]
            assert (ks[1:] <= ks[:-1]).all(), "siblings must be best first"
        # Subtrees are contiguous index ranges.
        for i in range(N):
            desc = [j for j in range(N) if (int(t.ancestor_mask[b, j]) >> i) & 1]
            assert desc == list(range(i, i + len(desc)))
        # The most likely path 0, 1, 2, ... : following first children from the root is a prefix of nodes.
        path, node = [0], 0
        while children[node]:
            node = children[node][0]
            path.append(node)
        assert path == list(range(len(path)))
        # The path's leaf ends the greedy walk from the root (each step takes the best kept child).
        assert t.depth[b, path[-1]] == len(path) - 1


def test_strided_inputs_match_contiguous():
    K, S, N = 3, 4, 20
    B = 5
    logp0, tokens0, steps, roots = make_inputs(K, S, B, "ties", torch.float32, seed=3)
    _, want = run_round(DraftTree(K, S, N), logp0, tokens0, steps, roots)

    base = torch.stack([roots + 100, roots, roots - 7], dim=1)  # [B, 3]
    strided_roots = base[:, 1]
    assert not strided_roots.is_contiguous()
    logp0_t = logp0.t().contiguous().t()  # same values, column-major strides
    steps_t = [(cl.transpose(1, 2).contiguous().transpose(1, 2), ct[:, :, :]) for cl, ct in steps]
    _, got = run_round(DraftTree(K, S, N), logp0_t, tokens0, steps_t, strided_roots)
    for name in ("tokens", "parents", "depth", "ancestor_mask", "candidate"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.tokens[:, 0], roots)


@pytest.mark.parametrize("config", [(2, 3, 7), (4, 4, 33), (8, 9, 64), (1, 64, 64)], ids=_cid)
def test_nan_scores_give_full_tree(config):
    K, S, N = config
    B = 3
    tree = DraftTree(K, S, N)
    logp0, tokens0, steps, roots = make_inputs(K, S, B, "smooth", torch.float32, seed=5)
    logp0[0] = float("nan")  # a padded request: every score NaN
    for cl, _ in steps:
        cl[0] = float("nan")
        cl[1, :, 1:] = float("nan")  # some children NaN
    logp0[2, -1] = float("nan")
    _, t = run_round(tree, logp0, tokens0, steps, roots)
    check_valid_tree(t, N)
    cand_tokens = torch.cat([tokens0] + [ct.reshape(B, -1) for _, ct in steps], 1)
    assert torch.equal(t.tokens[:, 1:], cand_tokens.gather(1, t.candidate[:, 1:]))
    # An all-NaN request keeps candidates in id order: step 0 first, then lanes' children.
    assert t.candidate[0, 1:].sort().values.tolist() == list(range(N - 1))


@pytest.mark.parametrize(
    "config", [(1, 1, 1), (1, 1, 2), (1, 5, 5), (1, 3, 2), (1, 64, 64), (1, 65, 64)], ids=_cid
)
def test_topk1_is_the_chain(config):
    K, S, N = config
    B = 3
    logp0, tokens0, steps, roots = make_inputs(K, S, B, "some_nan", torch.float32, seed=2)
    _, t = run_round(DraftTree(K, S, N), logp0, tokens0, steps, roots)
    node = torch.arange(N)
    assert torch.equal(t.parents, (node - 1).expand(B, N))
    assert torch.equal(t.depth, node.expand(B, N))
    assert torch.equal(t.candidate, (node - 1).expand(B, N))
    chain_mask = [_to_int64((1 << (i + 1)) - 1) for i in range(N)]
    assert t.ancestor_mask[0].tolist() == chain_mask
    chain_tokens = torch.cat([roots[:, None], tokens0] + [ct.reshape(B, 1) for _, ct in steps], 1)
    assert torch.equal(t.tokens, chain_tokens[:, :N])


@pytest.mark.parametrize("config", [(2, 4, 8), (3, 5, 12), (8, 9, 64)], ids=_cid)
def test_lane_masks_follow_lane_ancestry(config):
    K, S, N = config
    B = 4
    tree = DraftTree(K, S, N)
    logp0, tokens0, steps, roots = make_inputs(K, S, B, "some_nan", torch.float64, seed=9)
    history, _ = run_round(tree, logp0, tokens0, steps, roots)
    _, _, cand_parent = tree.candidates()
    for b in range(B):
        lane_slot = {}  # candidate id carried by a running lane -> its lane-window slot
        for lanes in history[:-1]:  # the last state is not run
            for r, cid in enumerate(lanes.candidate[b].tolist()):
                lane_slot[cid] = (lanes.step - 1) * K + r
        for lanes in history[:-1]:
            for r, cid in enumerate(lanes.candidate[b].tolist()):
                want, c = 0, cid
                while c >= 0:  # the lane itself and every ancestor lane
                    if c in lane_slot:
                        want |= 1 << lane_slot[c]
                    c = int(cand_parent[b, c])
                assert int(lanes.mask[b, r]) == _to_int64(want)
                assert (int(lanes.mask[b, r]) >> ((lanes.step - 1) * K + r)) & 1
                assert bin(want).count("1") == lanes.step, "one lane bit per step"
                if lanes.step > 1:  # parent_lane names the lane whose token is this lane's parent
                    parent = history[lanes.step - 2].candidate[b, lanes.parent_lane[b, r]]
                    assert int(parent) == int(cand_parent[b, cid])


def test_rank_order_ties_and_nan():
    nan, inf = float("nan"), float("inf")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        s = torch.tensor([[-1.0, nan, 0.0, -0.0, -inf, -1.0, nan, -0.5]], dtype=dtype)
        assert rank_order(s)[0].tolist() == [2, 3, 7, 0, 5, 4, 1, 6]
        neg_nan = -torch.tensor([nan], dtype=dtype)  # NaN with the sign bit set still ranks last
        assert rank_order(torch.cat([neg_nan, s[0, :1]]).unsqueeze(0))[0].tolist() == [1, 0]


def _rank_order_two_pass(scores):
    """The float64 path's definition: stable sort of -s (NaN as +inf), then a stable pass moving NaN last."""
    nan = torch.isnan(scores)
    key = torch.where(nan, torch.full_like(scores, float("inf")), 0.0 - scores)
    order = torch.sort(key, dim=-1, stable=True).indices
    return order.gather(-1, torch.sort(nan.gather(-1, order).to(torch.uint8), dim=-1, stable=True).indices)


@pytest.mark.parametrize("pairwise", [False, True], ids=["sort", "pairwise"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rank_order_one_sort_key_equals_two_stable_passes(dtype, pairwise):
    """Fuzz: the single int64-key sort of 16/32-bit scores (and its pairwise ranks, no sort) ranks exactly as
    the two stable passes, over many ties, +-0, +-inf and NaN of either sign, at widths from 1 to 400."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        C = int(torch.randint(1, 401, (1,), generator=g))
        u = torch.rand(3, C, generator=g)
        x = torch.randint(-6, 6, (3, C), generator=g).float() / 2  # coarse values: many ties
        x = torch.where(u < 0.4, torch.randn(3, C, generator=g) * 10, x)
        for lo, hi, value in ((0.40, 0.45, float("nan")), (0.45, 0.48, -float("nan")), (0.48, 0.52, -float("inf")),
                              (0.52, 0.55, float("inf")), (0.55, 0.60, -0.0), (0.60, 0.65, 0.0)):  # fmt: skip
            x = torch.where((u >= lo) & (u < hi), value, x)
        x = x.to(dtype)
        assert torch.equal(rank_order(x, pairwise), _rank_order_two_pass(x))


def test_ascending_unique_pairwise_equals_sort_at_every_width():
    """Distinct int64 keys, negative and beyond 32 bits included: pairwise ranks scatter to sort's permutation."""
    g = torch.Generator().manual_seed(3)
    for C in (1, 2, 3, 15, 16, 17, 63, 64, 65, 328):
        keys = torch.randperm(4 * C, generator=g)[:C].view(1, C).expand(2, C).clone()
        keys[1] = keys[1] * (1 << 40) - (1 << 50)  # still distinct, far outside int32
        assert torch.equal(ascending_unique(keys, pairwise=True), torch.sort(keys, dim=-1).indices)


@pytest.mark.parametrize("mode", MODES)
def test_pairwise_rank_selects_the_same_trees(mode):
    """DraftTree(pairwise_rank=True): every lane and tree equal to the sorting tree's, for every config."""
    for K, S, N in CONFIGS:
        inputs = make_inputs(K, S, 3, mode, torch.float32, seed=5)
        want_lanes, want = run_round(DraftTree(K, S, N), *inputs)
        got_lanes, got = run_round(DraftTree(K, S, N, pairwise_rank=True), *inputs)
        for name in ("tokens", "parents", "depth", "ancestor_mask", "candidate"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (K, S, N, name)
        for g, w in zip(got_lanes, want_lanes):
            for name in ("tokens", "mask", "candidate", "parent_lane"):
                assert torch.equal(getattr(g, name), getattr(w, name)), (K, S, N, name)


def test_pairwise_rank_env(monkeypatch):
    monkeypatch.setenv("TREECOMPILE_PAIRWISE_RANK", "1")
    assert DraftTree(2, 3, 6).pairwise_rank and not DraftTree(2, 3, 6, pairwise_rank=False).pairwise_rank
    monkeypatch.setenv("TREECOMPILE_PAIRWISE_RANK", "0")
    assert not DraftTree(2, 3, 6).pairwise_rank
    monkeypatch.setenv("TREECOMPILE_PAIRWISE_RANK", "yes")
    with pytest.raises(ValueError, match="TREECOMPILE_PAIRWISE_RANK='yes': expected '0'"):
        DraftTree(2, 3, 6)


def test_tree_kernels_env(monkeypatch):
    def ops(**kw):
        tree = DraftTree(2, 3, 6, **kw)
        return tree.expand_kernel, tree.select_kernel

    monkeypatch.setenv("TREECOMPILE_TREE_KERNELS", "1")
    assert ops() == (True, True) and ops(tree_kernels=False) == (False, False)
    monkeypatch.setenv("TREECOMPILE_TREE_KERNELS", "expand")
    assert ops() == (True, False) and ops(tree_kernels="select") == (False, True)
    monkeypatch.setenv("TREECOMPILE_TREE_KERNELS", "select")
    assert ops() == (False, True) and ops(tree_kernels=True) == (True, True)
    monkeypatch.setenv("TREECOMPILE_TREE_KERNELS", "0")
    assert ops() == (False, False)
    monkeypatch.delenv("TREECOMPILE_TREE_KERNELS")
    assert ops() == (False, False)
    monkeypatch.setenv("TREECOMPILE_TREE_KERNELS", "on")
    with pytest.raises(ValueError, match="TREECOMPILE_TREE_KERNELS: expected one of 0, 1, expand, select, got 'on'"):
        DraftTree(2, 3, 6)
    monkeypatch.delenv("TREECOMPILE_TREE_KERNELS")
    with pytest.raises(ValueError, match="tree_kernels: expected True, False, 'expand' or 'select', got 'both'"):
        DraftTree(2, 3, 6, tree_kernels="both")


@pytest.mark.parametrize("mode, kernels", [("ties", True), ("nan_rows", True), ("ties", "expand")])
def test_tree_kernels_give_the_same_lanes_and_trees(mode, kernels, monkeypatch, kernel_device):
    """``DraftTree(tree_kernels=True)`` through the ops' Triton launchers (on CPU forced on, in the interpreter):
    the same lanes and trees as the torch references for configs up to 84 candidates, NaN rows and ties too;
    "expand" (the lanes by the op, the selection by torch) for two of them."""
    from treecompile.ops import expand_lanes, select_tree

    if kernel_device == "cpu":
        for module in (expand_lanes, select_tree):
            monkeypatch.setattr(module, "use_triton", lambda *tensors: True)
    configs = [(1, 3, 2), (2, 3, 7), (3, 5, 33), (4, 6, 63), (64, 1, 64)] if kernels is True else [(2, 3, 7), (4, 5, 64)]
    for K, S, N in configs:
        logp0, tokens0, steps, roots = make_inputs(K, S, 3, mode, torch.float32, seed=9)
        want_lanes, want = run_round(DraftTree(K, S, N), logp0, tokens0, steps, roots)
        on = [t.to(kernel_device) for t in (logp0, tokens0, roots)]
        steps = [(cl.to(kernel_device), ct.to(kernel_device)) for cl, ct in steps]
        got_lanes, got = run_round(DraftTree(K, S, N, tree_kernels=kernels), on[0], on[1], steps, on[2])
        for name in ("tokens", "parents", "depth", "ancestor_mask", "candidate"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (K, S, N, name)
        for g, w in zip(got_lanes, want_lanes):
            for name in ("tokens", "mask", "candidate", "parent_lane"):
                assert torch.equal(getattr(g, name).cpu(), getattr(w, name)), (K, S, N, name)
            torch.testing.assert_close(g.scores.cpu(), w.scores, rtol=0, atol=0, equal_nan=True)


def test_ancestor_mask_matches_build_ancestor_mask():
    op = torch.ops.treespec.build_ancestor_mask
    for K, S, N in [(2, 3, 7), (4, 6, 63), (8, 6, 64), (1, 64, 64)]:
        logp0, tokens0, steps, roots = make_inputs(K, S, 3, "some_nan", torch.float32, seed=1)
        _, t = run_round(DraftTree(K, S, N), logp0, tokens0, steps, roots)
        mask, depth = op(t.parents)
        assert torch.equal(mask, t.ancestor_mask) and torch.equal(depth, t.depth)


@pytest.mark.parametrize(
    "topk, steps, num_nodes, match",
    [
        (0, 2, 8, "topk: must be >= 1"),
        (2, 0, 8, "steps: must be >= 1"),
        (2, 2, 0, "num_nodes: the tree must have 1..64"),
        (2, 2, 65, "num_nodes: the tree must have 1..64"),
        (4, 4, 11, r"\(steps-1\)\*topk = 12 must be <= num_nodes = 11"),
        (8, 10, 64, r"\(steps-1\)\*topk = 72 must be <= num_nodes = 64"),
        (3, 1, 5, "num_nodes-1 = 4 exceeds the 3 candidates"),
        (1, 3, 5, "num_nodes-1 = 4 exceeds the 3 candidates"),
        (2.0, 2, 8, "topk: expected a Python int"),
        (2, True, 8, "steps: expected a Python int"),
    ],
)
def test_bad_config_raises(topk, steps, num_nodes, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(topk, steps, num_nodes)


def test_bad_round_calls_raise():
    K, S, N, B = 2, 3, 7, 2
    tree = DraftTree(K, S, N)
    logp0, tokens0, steps, roots = make_inputs(K, S, B, "smooth", torch.float32, seed=0)
    with pytest.raises(ValueError, match="select: needs begin"):
        tree.select(roots)
    with pytest.raises(ValueError, match="logp0: expected \\[B, topk=2\\]"):
        tree.begin(logp0[:, :1], tokens0[:, :1])
    with pytest.raises(ValueError, match="tokens0: expected dtype torch.int64"):
        tree.begin(logp0, tokens0.int())
    with pytest.raises(ValueError, match="logp0: expected a floating dtype"):
        tree.begin(tokens0, tokens0)
    lanes = tree.begin(logp0, tokens0)
    with pytest.raises(ValueError, match="select: needs begin\\(\\) and 2 expand"):
        tree.select(roots)
    with pytest.raises(ValueError, match="child_logp: expected \\[B=2, topk=2, topk=2\\]"):
        tree.expand(lanes, steps[0][0][:, :1], steps[0][1][:, :1])
    lanes2 = tree.expand(lanes, *steps[0])
    with pytest.raises(ValueError, match="lanes.step: expected step 2"):
        tree.expand(lanes, *steps[0])
    lanes3 = tree.expand(lanes2, *steps[1])
    with pytest.raises(ValueError, match="lanes.step: expected step 3"):
        tree.expand(lanes3, *steps[1])
    with pytest.raises(ValueError, match="root_tokens: expected \\[B=2\\]"):
        tree.select(roots[:1])
    with pytest.raises(ValueError, match="root_tokens: expected a 1-d tensor"):
        tree.select(roots[:, None])
    check_valid_tree(tree.select(roots), N)


def test_round_compiles_fullgraph():
    """A whole round traces into one graph: no host syncs, no data-dependent shapes or branches."""
    K, S, N, B = 3, 4, 20, 3
    logp0, tokens0, steps, roots = make_inputs(K, S, B, "some_nan", torch.float32, seed=4)
    tree = DraftTree(K, S, N)

    def round_fn(logp0, tokens0, steps, roots):
        lanes = tree.begin(logp0, tokens0)
        for child_logp, child_tokens in steps:
            lanes = tree.expand(lanes, child_logp, child_tokens)
        t = tree.select(roots)
        return t.tokens, t.parents, t.depth, t.ancestor_mask, t.candidate, lanes.mask

    torch._dynamo.reset()
    compiled = torch.compile(round_fn, backend="eager", fullgraph=True)
    got = compiled(logp0, tokens0, steps, roots)
    want = round_fn(logp0, tokens0, steps, roots)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_inductor_round_equals_eager():
    """``DraftTree(inductor=True)`` compiles begin / expand / select (one graph each, every step's constants
    passed as tensors) and selects exactly the eager tree, lanes included, NaNs and ties too."""
    import torch._dynamo.utils as dynamo_utils

    K, S, N, B = 3, 4, 20, 3
    inputs = make_inputs(K, S, B, "ties", torch.float32, seed=11)  # equal scores, -inf, NaN, clamped > 0
    frames = dynamo_utils.counters["stats"]["unique_graphs"]
    compiled_tree = DraftTree(K, S, N, inductor=True)
    for _ in range(2):  # the second round reuses the graphs: expand's step changes only tensor inputs
        got_lanes, got = run_round(compiled_tree, *inputs)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - frames == 3
    want_lanes, want = run_round(DraftTree(K, S, N), *inputs)
    for name in ("tokens", "parents", "depth", "ancestor_mask", "candidate"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for g, w in zip(got_lanes, want_lanes):
        for name in ("tokens", "mask", "candidate", "parent_lane"):
            assert torch.equal(getattr(g, name), getattr(w, name)), name
        torch.testing.assert_close(g.scores, w.scores, rtol=0, atol=0, equal_nan=True)
    # The pairwise ranks and the select_tree op under Inductor: the same tree again.
    for variant in ({"pairwise_rank": True}, {"tree_kernels": True}):
        _, again = run_round(DraftTree(K, S, N, inductor=True, **variant), *inputs)
        for name in ("tokens", "parents", "depth", "ancestor_mask", "candidate"):
            assert torch.equal(getattr(again, name), getattr(want, name)), (variant, name)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sort", "pairwise", "kernel"])
@pytest.mark.parametrize("config", [(4, 6, 63), (8, 9, 64)], ids=_cid)
def test_cuda_matches_cpu_without_syncs(config, variant):
    K, S, N = config
    B = 6
    inputs = make_inputs(K, S, B, "some_nan", torch.float32, seed=7)
    _, want = run_round(DraftTree(K, S, N), *inputs)
    logp0, tokens0, steps, roots = inputs
    cuda_steps = [(cl.cuda(), ct.cuda()) for cl, ct in steps]
    # Host-to-device copies of the inputs are syncs themselves: do them before the checked region.
    logp0, tokens0, roots = logp0.cuda(), tokens0.cuda(), roots.cuda()
    tree = DraftTree(K, S, N, pairwise_rank=variant == "pairwise", tree_kernels=variant == "kernel")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, got = run_round(tree, logp0, tokens0, cuda_steps, roots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("tokens", "parents", "depth", "ancestor_mask", "candidate"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
