"""treespec::expand_lanes: the one-kernel draft step record against its torch reference (DraftTree's sorts and
gathers), step by step through whole rounds of tests/runtime/test_draft_tree.py's inputs, NaN and ties too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import poisoned

from treecompile.ops.expand_lanes import MAX_CHILDREN, _empty_outputs, _launch_expand_lanes, expand_lanes_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from test_draft_tree import MODES, make_inputs  # noqa: E402

NAMES = ("scores", "parents", "next_tokens", "next_scores", "next_mask", "next_candidate", "next_parent_lane")
CONFIGS = [(1, 3), (2, 3), (3, 5), (4, 5), (8, 4), (16, 2), (64, 1)]  # (K, S): chains, the shipped (4, 5), wide K


def _own_bits(K, step):
    slots = torch.arange(K) + step * K
    return torch.where(slots < 63, torch.bitwise_left_shift(torch.ones_like(slots), slots % 64), 0)


def run_kernel(child_logp, child_tokens, own_bits, first_id, lanes=(None, None, None), outputs=None, device="cpu"):
    """Launch on ``device`` (inputs moved there, outputs poisoned there unless given); the outputs on the CPU."""
    inputs = tuple(t.to(device) for t in (child_logp, child_tokens, own_bits, first_id))
    lanes = tuple(t if t is None else t.to(device) for t in lanes)
    outs = outputs
    if outs is None:
        outs = tuple(poisoned(t.shape, t.dtype, device) for t in _empty_outputs(child_logp, lanes[0]))
    _launch_expand_lanes(*inputs, *lanes, *outs)
    return tuple(o.cpu() for o in outs)


def assert_same(got, want, where):
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (where, name)
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=f"{where} {name}")


def rounds_of(K, S, B, mode, dtype, seed):
    """Yield (inputs, reference outputs) of every step of a round: the root's children, then each lane step
    fed the reference's own next lanes."""
    logp0, tokens0, steps, _ = make_inputs(K, S, B, mode, dtype, seed)
    first = torch.tensor(0)
    args = (logp0.unsqueeze(1), tokens0.unsqueeze(1), _own_bits(K, 0), first, (None, None, None))
    for s in range(S):
        want = expand_lanes_reference(*args[:4], *args[4])
        yield args, want
        if s + 1 == S:
            return
        child_logp, child_tokens = steps[s]
        lanes = (want[3], want[4], want[5])
        args = (child_logp, child_tokens, _own_bits(K, s + 1), torch.tensor(K + s * K * K), lanes)


# K = 64 (64 rounds of a 64-wide max: slow in the interpreter) with ties only
ROUND_CASES = [(c, m) for c in CONFIGS for m in MODES if c[0] < 64 or m == "ties"]


@pytest.mark.parametrize("config, mode", ROUND_CASES, ids=lambda v: "K{}-S{}".format(*v) if isinstance(v, tuple) else v)
def test_kernel_matches_reference_through_a_round(config, mode, kernel_device):
    """Poisoned outputs; float64 scores for half the configs."""
    d = kernel_device
    K, S = config
    dtype = torch.float64 if (K + S) % 2 else torch.float32
    for step, (args, want) in enumerate(rounds_of(K, S, 3, mode, dtype, seed=4)):
        got = run_kernel(*args[:4], lanes=args[4], device=d)
        assert_same(got, want, (dtype, step))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_16_bit_log_probs(dtype, kernel_device):
    """A 16-bit drafter's log-probs widen exactly: root scores in float32, lane steps in the lanes' dtype."""
    d = kernel_device
    K, S = 4, 3
    for step, (args, _) in enumerate(rounds_of(K, S, 2, "ties", torch.float32, seed=1)):
        args = (args[0].to(dtype), *args[1:])
        want = expand_lanes_reference(*args[:4], *args[4])
        assert want[0].dtype == torch.float32
        assert_same(run_kernel(*args[:4], lanes=args[4], device=d), want, step)


def test_strided_inputs_and_outputs(kernel_device):
    d = kernel_device
    K, S, B = 4, 3, 3
    for step, (args, want) in enumerate(rounds_of(K, S, B, "some_nan", torch.float32, seed=2)):
        child_logp, child_tokens, own_bits, first_id = (t.to(d) for t in args[:4])  # the views below made on d
        lanes = tuple(t if t is None else t.to(d) for t in args[4])
        child_logp = child_logp.transpose(1, 2).contiguous().transpose(1, 2)  # r and c strides swapped
        child_tokens = torch.stack([child_tokens, child_tokens], -1)[..., 1]  # last-dim stride 2
        own_bits = torch.stack([own_bits, own_bits], 1)[:, 0]
        if lanes[0] is not None:
            lanes = tuple(t.t().contiguous().t() for t in lanes)  # column-major [B, R]
        outs = tuple(poisoned(t.shape[::-1], t.dtype, d).t() for t in _empty_outputs(args[0], args[4][0]))
        got = run_kernel(child_logp, child_tokens, own_bits, first_id, lanes, outputs=outs, device=d)
        assert_same(got, want, step)


def test_the_largest_step(kernel_device):
    """R * K = 4096 children (64 lanes of 64), the kernel's limit, with ties and NaN."""
    d = kernel_device
    B, R, K = 1, 64, 64
    g = torch.Generator().manual_seed(0)
    choices = torch.tensor([0.0, -0.5, -1.0, float("-inf"), float("nan"), 0.25])
    child_logp = choices[torch.randint(0, len(choices), (B, R, K), generator=g)]
    child_tokens = torch.randint(0, 1000, (B, R, K), generator=g)
    lanes = (choices[torch.randint(0, 4, (B, R), generator=g)], torch.randint(0, 1 << 62, (B, R), generator=g),
             torch.arange(R).expand(B, R).contiguous())  # fmt: skip
    args = (child_logp, child_tokens, torch.zeros(K, dtype=torch.int64), torch.tensor(100))
    assert R * K == MAX_CHILDREN
    assert_same(run_kernel(*args, lanes=lanes, device=d), expand_lanes_reference(*args, *lanes), "4096")


def test_op_on_cpu_is_the_reference_and_traces():
    (args, want), (args1, want1) = list(rounds_of(4, 2, 2, "smooth", torch.float32, seed=3))
    op = torch.ops.treespec.expand_lanes
    assert_same(op(*args[:4]), want, "root")
    assert_same(op(*args1[:4], *args1[4]), want1, "lanes")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(*a), backend="eager", fullgraph=True)
    assert_same(compiled(*args1[:4], *args1[4]), want1, "compiled")


def _good():
    (_, _), (args, _) = list(rounds_of(2, 2, 2, "smooth", torch.float32, seed=0))
    return args[:4], args[4]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a, l: ((a[0].long(), *a[1:]), l), "child_logp: expected dtype torch.float16 or"),
        (lambda a, l: ((a[0][0], *a[1:]), l), r"child_logp: expected a 3-d tensor \[B, R, K\]"),
        (lambda a, l: ((a[0], a[1][:, :1], *a[2:]), l), r"child_tokens: expected shape \(2, 2, 2\) like child_logp"),
        (lambda a, l: ((a[0], a[1].int(), *a[2:]), l), "child_tokens: expected dtype torch.int64"),
        (lambda a, l: ((*a[:2], a[2][:1], a[3]), l), r"own_bits: expected \[K=2\]"),
        (lambda a, l: ((*a[:3], a[3][None]), l), "first_id: expected a 0-d tensor"),
        (lambda a, l: (a, (l[0], None, l[2])), "lane_mask: pass all three lane tensors, or none"),
        (lambda a, l: (a, (None, None, None)), "child_logp: without lane tensors .* R must be 1, got R = 2"),
        (lambda a, l: (a, (l[0].half(), *l[1:])), "lane_scores: expected dtype torch.float32 or torch.float64"),
        (lambda a, l: (a, (l[0][:1], *l[1:])), r"lane_scores: expected \[B=2, R=2\]"),
        (lambda a, l: (a, (l[0], l[1].to("meta"), l[2])), "all tensors must be on one device"),
        (lambda a, l: ((torch.zeros(1, 65, 64), torch.zeros(1, 65, 64, dtype=torch.int64),
                        torch.zeros(64, dtype=torch.int64), a[3]), (torch.zeros(1, 65), ) * 3),
         "R \\* K = 4160 children a request exceed the limit of 4096"),
    ],
)  # fmt: skip
def test_bad_input_raises(change, match):
    args, lanes = change(*_good())
    with pytest.raises(ValueError, match=match):
        torch.ops.treespec.expand_lanes(*args, *lanes)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(4, 5), (8, 4), (64, 1)], ids=lambda c: "K{}-S{}".format(*c))
def test_cuda_kernel_equals_reference_and_replays(config):
    """On the GPU every step equals the CPU reference, and a captured lane step replays onto new inputs."""
    K, S = config
    steps = list(rounds_of(K, S, 5, "some_nan", torch.float32, seed=6))
    op = torch.ops.treespec.expand_lanes
    for step, (args, want) in enumerate(steps):
        lanes = tuple(t.cuda() for t in args[4]) if args[4][0] is not None else ()
        got = op(*(t.cuda() for t in args[:4]), *lanes)
        assert_same(tuple(t.cpu() for t in got), want, step)
    if S < 3:
        return
    bound = [t.cuda() for t in (*steps[1][0][:4], *steps[1][0][4])]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = op(*bound)
    args, want = steps[2]
    for dst, src in zip(bound, (*args[:4], *args[4])):
        dst.copy_(src)
    graph.replay()
    assert_same(tuple(t.cpu() for t in outs), want, "replay")
