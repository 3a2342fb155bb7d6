"""A batch shrinks onto a smaller batch size as its requests stop (``TreeSpeculator(shrink_batch=...)``).

Float64 on the CPU, where shrinking is the default: requests of a ragged batch stop at different rounds (a
noisy oracle head accepts different lengths per request; an EOS stops one early), the running ones move onto the
smaller batch sizes the speculator ran before, and every output still equals HF greedy, request by request;
accept lengths come back by original request. Hybrid targets permute their conv / recurrent state rows too."""

from __future__ import annotations

import pytest
import torch
from test_lossless import OracleDrafter, assert_same, hf_greedy, ragged_batch
from test_lossless import tiny_model as tiny_attention_model
from test_lossless_hybrid import tiny_model as tiny_hybrid_model

from treecompile.drafter import EagleDrafter
from treecompile.speculator import _REQUEST_BUFFERS, TreeSpeculator

pytestmark = pytest.mark.usefixtures("one_thread")


def _warm(spec, sizes, g):
    """Run each smaller batch size once: a shrink only lands on sizes that already ran."""
    for b in sizes:
        ids, mask = ragged_batch(g, b)
        spec.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "mamba2"])
def test_shrinking_batch_matches_hf_greedy(family):
    model = tiny_attention_model(family) if family == "llama" else tiny_hybrid_model(family)
    # A noisy oracle accepts different lengths per request, so requests stop at different rounds.
    spec = TreeSpeculator(model, OracleDrafter.build(model, noise=0.6, seed=2), topk=3, steps=4, num_nodes=10,
                          max_batch_size=4, max_seq_len=96, page_size=8)  # fmt: skip
    assert spec.shrink_batch is True  # the default (with or without CUDA graphs)
    g = torch.Generator().manual_seed(5)
    _warm(spec, (1, 2), g)
    before = spec.shrinks
    for _ in range(2):
        ids, mask = ragged_batch(g, 4)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
        assert_same(out, hf_greedy(model, ids, mask, 24), 24)  # tokens and per-request accept totals
    assert spec.shrinks > before, "no batch shrank: the path went untested"


def test_warm_up_prepares_the_sizes_a_batch_shrinks_onto_and_leaves_no_state():
    """``warm_up`` runs each size once (smallest first): a later batch of 3 shrinks onto them, and its outputs
    equal HF greedy, as they do on a speculator that never warmed up."""
    model = tiny_attention_model("llama", seed=3)
    drafter = OracleDrafter.build(model, noise=0.6, seed=2)
    kwargs = dict(topk=2, steps=3, num_nodes=6, max_batch_size=3, max_seq_len=96, page_size=8)
    spec = TreeSpeculator(model, drafter, **kwargs)
    assert spec.warm_up((2, 1, 2)) == [1, 2]
    assert {1, 2} <= set(spec._buffers) and 3 not in spec._buffers
    assert spec.shrinks == 0 and spec.shrink_batch is True  # no shrink inside the warm-up; the flag is back
    g = torch.Generator().manual_seed(9)
    ids, mask = ragged_batch(g, 3)
    plain = hf_greedy(model, ids, mask, 20)
    eos = int(plain[0, ids.shape[1] + 4])  # request 0 stops early: the other two run on in a smaller batch
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert_same(out, hf_greedy(model, ids, mask, 20, eos=eos))
    assert spec.shrinks > 0
    cold = TreeSpeculator(model, drafter, **kwargs).generate(ids, attention_mask=mask, max_new_tokens=20,
                                                             eos_token_id=eos, pad_token_id=0)  # fmt: skip
    assert torch.equal(out.sequences, cold.sequences)


@pytest.mark.parametrize(
    "args,match",
    [
        (((),), "batch_sizes: expected at least one batch size"),
        (((1, 4),), "batch_sizes: 4 exceeds max_batch_size 3"),
        (((0,),), "batch_sizes: expected a positive int, got 0"),
        (("12",), "batch_sizes: expected a positive int, got '1'"),
        ((None,), "batch_sizes: expected an int or a sequence of positive ints, got None"),
        (((1,), 0), "prompt_len: expected a positive int, got 0"),
        (((1,), 90), "prompt_len: 90 \\+ 9 warm-up tokens \\+ num_nodes 6 exceeds the cache capacity max_seq_len=96"),
    ],
    ids=["empty", "past-max-batch", "zero", "string", "none", "prompt-len-0", "prompt-len-too-long"],
)
def test_warm_up_refuses_bad_sizes_before_running_anything(args, match):
    model = tiny_attention_model("llama", seed=3)
    spec = TreeSpeculator(model, OracleDrafter.build(model, noise=0.6, seed=2), topk=2, steps=3, num_nodes=6,
                          max_batch_size=3, max_seq_len=96, page_size=8)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        spec.warm_up(*args)
    assert not spec._buffers  # nothing ran


def test_an_early_eos_shrinks_the_batch_and_every_request_keeps_its_tokens():
    model = tiny_attention_model("llama", seed=3)
    drafter = OracleDrafter.build(model, noise=0.6, seed=2)
    spec = TreeSpeculator(model, drafter, topk=2, steps=3, num_nodes=6, max_batch_size=3, max_seq_len=96,
                          page_size=8)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    _warm(spec, (1, 2), g)
    ids, mask = ragged_batch(g, 3)
    plain = hf_greedy(model, ids, mask, 20)
    eos = int(plain[0, ids.shape[1] + 4])  # request 0 stops by its fifth token; the others when they meet it
    before = spec.shrinks
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert_same(out, hf_greedy(model, ids, mask, 20, eos=eos))
    assert spec.shrinks > before
    # Accept lengths by original request: a request's counts are positive until it stops, zero after, and
    # some request stopped before the last round (the one the batch shrank for).
    alen = out.accept_lengths
    assert alen.shape[1] == 3
    ran = alen > 0
    assert bool((ran[1:] <= ran[:-1]).all()), alen.T.tolist()  # no count after a zero
    assert not bool(ran[-1].all())
    # The next request at full batch sees nothing of this one (the permuted page tables stay valid).
    ids, mask = ragged_batch(g, 3)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    assert_same(out, hf_greedy(model, ids, mask, 16), 16)


def test_no_shrink_when_off_or_no_smaller_size_ran():
    model = tiny_attention_model("llama")
    g = torch.Generator().manual_seed(2)
    off = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=3, steps=4, num_nodes=10,
                         max_batch_size=3, max_seq_len=64, page_size=8, shrink_batch=False)  # fmt: skip
    _warm(off, (1, 2), g)
    ids, mask = ragged_batch(g, 3)
    assert_same(off.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0),
                hf_greedy(model, ids, mask, 16), 16)  # fmt: skip
    assert off.shrinks == 0
    cold = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=3, steps=4, num_nodes=10,
                          max_batch_size=3, max_seq_len=64, page_size=8)  # fmt: skip
    cold.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    assert cold.shrinks == 0  # batch 3 was the only size it had run: nothing to move onto


def test_every_per_request_round_buffer_is_gathered():
    """A round buffer added with a row per request must join _REQUEST_BUFFERS, or a shrink would leave it
    behind: every bound tensor whose first dim is the batch size is in the list or is a constant."""
    model = tiny_attention_model("llama")
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=3, steps=4, num_nodes=10,
                          max_batch_size=5, max_seq_len=64, page_size=8)  # fmt: skip
    bound = spec._bind_buffers(5)
    per_request = {name for name, t in bound.items() if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 5
                   and not name.startswith(("rows_", "chain_"))}  # fmt: skip
    assert per_request == set(_REQUEST_BUFFERS)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_gpu_captured_rounds_shrink_onto_captured_sizes(family, device="cuda"):
    """float32 on CUDA with captured rounds and lookahead: request 0 of a batch of 3 stops early at an EOS, the
    batch shrinks onto the captured sizes (the round in flight lands first), and the tokens agree with the
    same captured rounds without shrinking (>= 0.9: other batch sizes run other GEMM tiles, whose float32
    roundings may flip a near tie); accept lengths come back by original request."""
    from test_lossless_hybrid import gpu_model

    model = gpu_model(family, torch.float32, device)
    drafter = EagleDrafter.for_target(model, seed=1)
    kwargs = dict(topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256, inductor=False)
    spec = TreeSpeculator(model, drafter, shrink_batch=True, **kwargs)
    assert spec.cuda_graphs and spec.lookahead
    g = torch.Generator().manual_seed(0)
    assert spec.warm_up((1, 2)) == [1, 2]  # capture the smaller sizes
    assert set(spec._graphs) == {1, 2} and set(spec._prefill_graphs) == {1, 2}
    ids = torch.randint(1, 128, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    ids, mask = (ids * mask).to(device), mask.to(device)
    base = TreeSpeculator(model, drafter, shrink_batch=False, **kwargs)
    plain = base.generate(ids, mask, max_new_tokens=48, eos_token_id=None)
    eos = int(plain.sequences[0, ids.shape[1] + 5])
    want = base.generate(ids, mask, max_new_tokens=48, eos_token_id=eos, pad_token_id=0)
    out = spec.generate(ids, mask, max_new_tokens=48, eos_token_id=eos, pad_token_id=0)
    assert spec.shrinks > 0, "no batch shrank: the path went untested"
    assert out.sequences.shape == want.sequences.shape
    agreement = (out.sequences == want.sequences).float().mean().item()
    assert agreement >= 0.9, agreement
    ran = out.accept_lengths > 0  # by original request: positive until it stopped, zero after
    assert bool((ran[1:] <= ran[:-1]).all()) and not bool(ran[-1].all())
