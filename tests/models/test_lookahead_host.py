"""The lookahead's host logic on the CPU: which captured graphs it launches and when it stops.

The lookahead runs only with CUDA graphs, so the CPU suite would never execute it. Here, stand-ins for the
captured graphs replay the round's parts eagerly on the state they were "captured" with, and they log each
launch. Plain tensors and no-op events stand in for the pinned flags. On a CPU everything is synchronous, so
these tests check the control flow only: what is launched, in which order, when the loop stops, and how a
batch shrink lands. The GPU test ``test_lookahead_rounds_equal_synced_rounds`` checks the real graphs.

Float64, tiny Llama, a noisy oracle head (requests accept different lengths and stop at different rounds):
- with the next draft sent ahead (``split_lookahead``, the default), with whole rounds ahead, and with no
  lookahead, the outputs and accept lengths equal HF greedy and each other;
- after the last stop, the split form has run one draft that no verify followed, and the whole-round form
  has run one whole round.
"""

from __future__ import annotations

import pytest
import torch
from test_lossless import OracleDrafter, assert_same, hf_greedy, ragged_batch
from test_lossless import tiny_model as tiny_attention_model

from treecompile.speculator import TreeSpeculator

pytestmark = pytest.mark.usefixtures("one_thread")


class _Replay:
    """A captured graph's stand-in: ``replay`` logs its name and runs the part eagerly."""

    def __init__(self, name: str, fn, log: list):
        self.name, self.fn, self.log = name, fn, log

    def replay(self) -> None:
        self.log.append(self.name)
        self.fn()


class _Event:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def host_graphs(spec: TreeSpeculator, log: list) -> TreeSpeculator:
    """Make ``spec`` take its CUDA-graph paths on the CPU: the round is "captured" as two replays (draft;
    verify + commit) after its first eager run; the prefill stays eager."""
    spec.cuda_graphs = True
    spec._prefill_graph = lambda st: None

    def capture(st):
        spec._graphs[st["B"]] = (
            _Replay("draft", lambda: spec._draft_fn(st), log),
            _Replay("verify", lambda: (spec._verify_round(st), spec._commit(st)), log),
        )

    spec._capture = capture
    spec._flag_buffers = lambda B: (torch.zeros(2, B, dtype=torch.bool), [_Event(), _Event()])
    return spec


def speculators(model, drafter, **kwargs):
    """(split lookahead, whole rounds ahead, no lookahead) speculators and their launch logs."""
    logs = {"split": [], "whole": []}
    split = host_graphs(TreeSpeculator(model, drafter, **kwargs), logs["split"])
    whole = host_graphs(TreeSpeculator(model, drafter, **kwargs), logs["whole"])
    whole.split_lookahead = False
    synced = TreeSpeculator(model, drafter, lookahead=False, **kwargs)
    assert split.split_lookahead and split.round_graphs == 2 and split.lookahead
    return split, whole, synced, logs


@pytest.mark.parametrize("stop", ["max_new_tokens", "eos"])
def test_split_lookahead_runs_one_draft_past_the_last_stop(stop):
    model = tiny_attention_model("llama", seed=4)
    # Noise per scored sequence: the forms launch different numbers of drafts (the split one drafts once past
    # the last stop), and with call-order noise their later accept lengths would differ for that reason alone.
    drafter = OracleDrafter.build(model, noise=0.6, seed=2, per_sequence=True)
    kwargs = dict(topk=3, steps=4, num_nodes=10, max_batch_size=3, max_seq_len=96, page_size=8, shrink_batch=False)
    split, whole, synced, logs = speculators(model, drafter, **kwargs)
    g = torch.Generator().manual_seed(7)
    for request in range(3):  # the first captures; the later ones replay
        ids, mask = ragged_batch(g, 3)
        eos = None
        if stop == "eos":  # request 0 stops at its fifth new token: the others run on
            eos = int(hf_greedy(model, ids, mask, 16)[0, ids.shape[1] + 4])
        ref = hf_greedy(model, ids, mask, 16, eos=eos)
        outs = {}
        for name, spec in (("split", split), ("whole", whole), ("synced", synced)):
            outs[name] = spec.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
            assert_same(outs[name], ref)
        for name in ("split", "whole"):
            assert torch.equal(outs[name].accept_lengths, outs["synced"].accept_lengths), name
        rounds = outs["synced"].accept_lengths.shape[0]
        log_s, log_w = logs["split"], logs["whole"]
        if request == 0:  # the first round ran eagerly and was captured: the replays start at round 1
            rounds -= 1
        # Split: every round's draft and verify, then one more draft. Whole: one more whole round.
        assert log_s == ["draft", "verify"] * rounds + ["draft"], (request, log_s)
        assert log_w == ["draft", "verify"] * (rounds + 1), (request, log_w)
        log_s.clear()
        log_w.clear()


def test_split_lookahead_lands_the_round_before_a_shrink():
    """Requests stop at different rounds and the batch shrinks onto the sizes that ran before: the split form
    launches the verify of the round in flight before it shrinks, and every output equals HF greedy."""
    model = tiny_attention_model("llama", seed=3)
    # Noise per scored sequence: the forms launch different numbers of drafts (the split one drafts once past
    # the last stop), and with call-order noise their later accept lengths would differ for that reason alone.
    drafter = OracleDrafter.build(model, noise=0.6, seed=2, per_sequence=True)
    kwargs = dict(topk=2, steps=3, num_nodes=6, max_batch_size=3, max_seq_len=96, page_size=8)
    split, whole, synced, logs = speculators(model, drafter, **kwargs)
    g = torch.Generator().manual_seed(9)
    for spec in (split, whole):
        assert spec.warm_up((1, 2)) == [1, 2]
    ids, mask = ragged_batch(g, 3)
    plain = hf_greedy(model, ids, mask, 20)
    eos = int(plain[0, ids.shape[1] + 4])  # request 0 stops early
    ref = hf_greedy(model, ids, mask, 20, eos=eos)
    logs["split"].clear()
    outs = {}
    for name, spec in (("split", split), ("whole", whole), ("synced", synced)):
        before = spec.shrinks
        outs[name] = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
        assert_same(outs[name], ref)
        if name != "synced":
            assert spec.shrinks > before, f"{name}: no batch shrank, the path went untested"
    assert torch.equal(outs["split"].accept_lengths, outs["whole"].accept_lengths)
    log = logs["split"]
    assert log[-1] == "draft" and log.count("draft") == log.count("verify") + 1  # one draft past the last stop
    assert all(a != b for a, b in zip(log, log[1:]))  # a verify after every draft but the last
