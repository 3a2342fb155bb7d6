"""TreeSpeculator: bad input is refused before any work; state never leaks between requests; edge cases
(length-1 and chunked prompts, 1-D input) stay equal to HF greedy; no silent eager fallback."""

import pytest
import torch

from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator

VOCAB = 80


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def tiny_llama(seed=0, hidden=32, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def spec(llama):
    """K=2, S=3, N=6; prefill in chunks of N rows (one compiled graph per batch size)."""
    return TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                          max_batch_size=2, max_seq_len=48, page_size=8)  # fmt: skip


def hf_greedy(model, ids, mask=None, max_new_tokens=8, eos=None):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=0)  # fmt: skip


# ---- bad input: clear errors before any device work -------------------------------------------------------


def test_prompt_longer_than_the_cache_is_refused(spec):
    with pytest.raises(ValueError, match="exceeds the cache capacity max_seq_len=48"):
        spec.generate(torch.ones(1, 40, dtype=torch.int64), max_new_tokens=4)


@pytest.mark.parametrize("case", ["no-columns", "all-masked-row"])
def test_empty_prompt_is_refused(spec, case):
    if case == "no-columns":
        ids, mask = torch.zeros(1, 0, dtype=torch.int64), None
    else:
        ids, mask = torch.ones(2, 3, dtype=torch.int64), torch.tensor([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match="empty prompt"):
        spec.generate(ids, attention_mask=mask, max_new_tokens=4)


def test_right_padding_is_refused(spec):
    with pytest.raises(ValueError, match="left padding"):
        spec.generate(torch.ones(1, 3, dtype=torch.int64), attention_mask=torch.tensor([[1, 1, 0]]))


@pytest.mark.parametrize("eos", ["two", [3, "x"], 1.5, [VOCAB]], ids=["str", "list-with-str", "float", "out-of-vocab"])
def test_bad_eos_token_id_is_refused(spec, eos):
    with pytest.raises(ValueError, match="eos_token_id"):
        spec.generate(torch.ones(1, 3, dtype=torch.int64), eos_token_id=eos)


def test_too_many_eos_ids_are_refused_and_repeats_are_not_counted(spec):
    from treecompile.speculator import MAX_EOS_IDS

    ids = torch.ones(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"eos_token_id: at most {MAX_EOS_IDS} distinct ids, got {MAX_EOS_IDS + 1}"):
        spec.generate(ids, eos_token_id=list(range(MAX_EOS_IDS + 1)))
    assert spec._eos_ids([5, 3, 5] * MAX_EOS_IDS) == [5, 3]  # order kept: the first is the default pad


@pytest.mark.parametrize(
    "kwargs,match",
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"input_ids": torch.ones(3, 2, dtype=torch.int64)}, "max_batch_size 2"),
     ({"input_ids": torch.full((1, 2), VOCAB)}, r"token ids must be in \[0, 80\)"),
     ({"input_ids": torch.ones(1, 2)}, "expected int64")],
    ids=["max-new-0", "batch-over-max", "token-out-of-vocab", "float-ids"],
)  # fmt: skip
def test_other_bad_arguments_are_refused(spec, kwargs, match):
    args = {"input_ids": torch.ones(1, 2, dtype=torch.int64), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        spec.generate(**args)


def test_unsupported_dtype_is_refused():
    model = tiny_llama(dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype torch.float16 on cpu is not supported"):
        TreeSpeculator(model, EagleDrafter.for_target(model), topk=2, steps=2, num_nodes=4, max_seq_len=32)


def test_drafter_hidden_size_mismatch_is_refused(llama):
    other = tiny_llama(hidden=48)
    with pytest.raises(ValueError, match="target hidden size 48, but the model's hidden size is 32"):
        TreeSpeculator(llama, EagleDrafter.for_target(other), topk=2, steps=2, num_nodes=4, max_seq_len=32)


def test_drafter_on_another_dtype_is_refused(llama):
    drafter = EagleDrafter.for_target(llama).float()
    with pytest.raises(ValueError, match="drafter: is torch.float32"):
        TreeSpeculator(llama, drafter, topk=2, steps=2, num_nodes=4, max_seq_len=32)


@pytest.mark.parametrize("topk,steps,num_nodes", [(4, 5, 8), (2, 2, 65), (0, 3, 4)], ids=["lanes>N", "N65", "K0"])
def test_inconsistent_tree_shape_is_refused(llama, topk, steps, num_nodes):
    with pytest.raises(ValueError):
        TreeSpeculator(llama, EagleDrafter.for_target(llama), topk=topk, steps=steps, num_nodes=num_nodes, max_seq_len=32)


def test_training_mode_is_refused():
    model = tiny_llama().train()
    with pytest.raises(ValueError, match="training mode"):
        TreeSpeculator(model, EagleDrafter.for_target(model), topk=2, steps=2, num_nodes=4, max_seq_len=32)


# ---- behaviour ---------------------------------------------------------------------------------------------


def test_nothing_leaks_between_requests(spec):
    """The same request before and after an unrelated (longer, EOS-stopped) one gives identical output."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 7), generator=g)
    first = spec.generate(ids, max_new_tokens=10)
    other = torch.randint(1, VOCAB, (2, 20), generator=g)
    spec.generate(other, max_new_tokens=12, eos_token_id=[int(other[0, 3]), int(other[1, 5])])
    again = spec.generate(ids, max_new_tokens=10)
    assert torch.equal(first.sequences, again.sequences)
    assert torch.equal(first.accept_lengths, again.accept_lengths)
    assert torch.equal(first.sequences, hf_greedy(spec.model, ids, max_new_tokens=10))


def test_a_request_that_fails_mid_draft_leaves_nothing_for_the_next(llama):
    """A request whose drafter raises in its third lane step (after prefill, verifies and commits have written
    the caches) must leave no state that changes the next request's output."""
    spec = TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                          max_batch_size=2, max_seq_len=48, page_size=8)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (2, 7), generator=g)
    first = spec.generate(ids, max_new_tokens=10)
    real, calls = spec.draft_hooks.draft_lanes, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("drafter failed mid-request")
        return real(*args, **kwargs)

    spec.draft_hooks.draft_lanes = failing
    other = torch.randint(1, VOCAB, (2, 15), generator=g)
    with pytest.raises(RuntimeError, match="drafter failed mid-request"):
        spec.generate(other, max_new_tokens=12)
    spec.draft_hooks.draft_lanes = real
    again = spec.generate(ids, max_new_tokens=10)
    assert torch.equal(first.sequences, again.sequences)
    assert torch.equal(first.accept_lengths, again.accept_lengths)
    assert torch.equal(again.sequences, hf_greedy(llama, ids, max_new_tokens=10))
    # and the failed request's own prompts, asked again, come out as HF's
    assert torch.equal(spec.generate(other, max_new_tokens=12).sequences, hf_greedy(llama, other, max_new_tokens=12))


def test_length_one_and_chunked_prompts_match_hf(spec):
    """A 1-token prompt (no draft pairs to prefill) next to a 17-token one (three prefill chunks of N=6)."""
    ids = torch.zeros(2, 17, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    ids[0, -1], mask[0, -1] = 42, 1
    ids[1] = torch.randint(1, VOCAB, (17,), generator=torch.Generator().manual_seed(1))
    mask[1] = 1
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=9)
    assert torch.equal(out.sequences, hf_greedy(spec.model, ids, mask, max_new_tokens=9))
    assert out.sequences.shape == (2, 17 + 9)  # max_new_tokens exactly, HF's left padding kept


def test_one_dimensional_prompt_and_max_new_tokens_one(spec):
    ids = torch.tensor([5, 6, 7])
    out = spec.generate(ids, max_new_tokens=1)
    assert out.sequences.shape == (1, 4) and out.accept_lengths.shape == (0, 1)
    assert torch.equal(out.sequences, hf_greedy(spec.model, ids[None], max_new_tokens=1))


def test_eos_from_the_generation_config_when_none_is_given(llama):
    """``eos_token_id=None`` falls back to ``model.generation_config.eos_token_id`` as HF does."""
    spec = TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                          max_batch_size=2, max_seq_len=48, page_size=8)  # fmt: skip
    ids = torch.tensor([[9, 8, 7, 6]])
    free = hf_greedy(llama, ids, max_new_tokens=8)
    eos = int(free[0, 4 + 3])
    llama.generation_config.eos_token_id = eos
    try:
        out = spec.generate(ids, max_new_tokens=8, eos_token_id=None)
        ref = hf_greedy(llama, ids, max_new_tokens=8, eos=eos)
    finally:
        llama.generation_config.eos_token_id = None
    assert torch.equal(out.sequences, ref) and out.sequences.shape[1] <= 4 + 4


def test_no_silent_fallback_to_untouched_attention(spec):
    """If Dynamo ran the model eagerly (here: forced), HF's own attention would ignore the tree caches."""
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(RuntimeError, match="did not run the rewritten graph"):
            spec.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)


def test_one_node_tree_is_plain_decoding(llama):
    """topk=1, num_nodes=1: every round verifies the root alone — treecompile's non-speculative decode."""
    plain = TreeSpeculator(llama, EagleDrafter.for_target(llama), topk=1, steps=1, num_nodes=1, max_batch_size=2,
                           max_seq_len=48, page_size=8, prefill_chunk=4)  # fmt: skip
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    out = plain.generate(ids, max_new_tokens=6)
    assert out.accept_lengths.tolist() == [[1, 1]] * 5
    assert torch.equal(out.sequences, hf_greedy(llama, ids, max_new_tokens=6))


@pytest.mark.parametrize("topk", [2, 1], ids=["tree", "chain"])
def test_compiled_draft_round_matches_hf_without_graph_breaks(monkeypatch, topk):
    """``TREECOMPILE_COMPILED_DRAFT=1``: the whole draft round compiled as one region (the hooks' compiled
    functions traced through). Two ragged requests with an EOS inside the text, then a second request on the
    same speculator, equal HF greedy in float32; the round compiles without a graph break. Lossless output
    alone would not show the drafts are right (any draft is lossless), so from the state the requests left
    behind, the compiled round must draft the very tree the per-hook round drafts: tokens, parents, masks."""
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setenv("TREECOMPILE_COMPILED_DRAFT", "1")
    model = tiny_llama(dtype=torch.float32, seed=2)
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=topk, steps=3, num_nodes=6,
                          max_batch_size=2, max_seq_len=64, page_size=8, inductor=True)  # fmt: skip
    assert spec._draft_fn is not spec._draft_round
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, 6), generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    breaks = sum(dynamo_utils.counters["graph_break"].values())
    free = hf_greedy(model, ids, mask, 12)[:, ids.shape[1]:]
    eos = [int(free[1, 4])]
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, hf_greedy(model, ids, mask, 12, eos=eos))
    st = dict(spec._buffers[2], B=2)
    trees = []
    for draft in (spec._draft_round, spec._draft_fn):  # per-hook compiled, then whole-round compiled
        st["tree_tokens"].fill_(-1)
        draft(st)
        tree = st["spec"]
        trees.append([t.clone() for t in (st["tree_tokens"], tree.parents, tree.ancestor_mask, tree.depth)])
    for got, want in zip(trees[1], trees[0]):
        assert torch.equal(got, want)
    assert (trees[0][0] >= 0).all()
    # A second request of the same size (its compiled code is reused: a new size would compile it all again)
    again = torch.randint(3, VOCAB, (2, 5), generator=gen)
    got = spec.generate(again, max_new_tokens=9, eos_token_id=None).sequences
    assert torch.equal(got, hf_greedy(model, again, max_new_tokens=9))
    assert sum(dynamo_utils.counters["graph_break"].values()) == breaks


def test_inductor_compiled_target_and_draft_hooks_match_hf(monkeypatch):
    """inductor=True compiles the rewritten target, the drafter's round hooks (DraftHooks) and the commit
    (``TREECOMPILE_COMPILED_COMMIT=0`` keeps that one eager); the float32 output still equals HF greedy and the
    compiled hooks really ran (Dynamo compiled a frame for each)."""
    import torch._dynamo.utils as dynamo_utils

    from treecompile.speculator import _commit_tokens

    model = tiny_llama(dtype=torch.float32)
    drafter = EagleDrafter.for_target(model, seed=1)
    kw = dict(topk=2, steps=3, num_nodes=6, max_batch_size=1, max_seq_len=64, page_size=8, inductor=True)
    monkeypatch.setenv("TREECOMPILE_COMPILED_COMMIT", "0")
    assert TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), **kw)._commit_fn is _commit_tokens
    monkeypatch.delenv("TREECOMPILE_COMPILED_COMMIT")
    spec = TreeSpeculator(model, drafter, **kw)
    assert spec.draft_hooks.inductor and spec._commit_fn is not _commit_tokens
    frames = dynamo_utils.counters["stats"]["unique_graphs"]
    ids = torch.randint(3, 64, (1, 7), generator=torch.Generator().manual_seed(5))
    got = spec.generate(ids, max_new_tokens=10, eos_token_id=None).sequences
    assert torch.equal(got, hf_greedy(model, ids, max_new_tokens=10))
    # target (prefill / verify shape) + step 0 + lanes + scoring at two shapes + the commit
    assert dynamo_utils.counters["stats"]["unique_graphs"] - frames >= 5


@pytest.mark.parametrize("raw, graphs", [("", 2), ("2", 2), (" 1 ", 1)])
def test_round_graphs_env(monkeypatch, raw, graphs):
    """``TREECOMPILE_ROUND_GRAPHS``: two captured graphs a round (draft, verify) by default, one on request."""
    from treecompile.speculator import round_graphs_from_env

    monkeypatch.setenv("TREECOMPILE_ROUND_GRAPHS", raw)
    assert round_graphs_from_env() == graphs


@pytest.mark.parametrize("raw", ["0", "3", "two"])
def test_round_graphs_env_refuses_other_values_by_name(monkeypatch, llama, raw):
    monkeypatch.setenv("TREECOMPILE_ROUND_GRAPHS", raw)
    with pytest.raises(ValueError, match=r"TREECOMPILE_ROUND_GRAPHS: must be 1 .* or 2"):
        TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                       max_batch_size=1, max_seq_len=48, page_size=8)  # fmt: skip


@pytest.mark.parametrize(
    "raw, device, on",
    [("", "cuda", True), ("", "cpu", False), (" 0 ", "cuda", False), ("1", "cpu", True), ("1", "cuda", True)],
)
def test_compiled_draft_env(monkeypatch, raw, device, on):
    """``TREECOMPILE_COMPILED_DRAFT``: the whole-round draft region is the CUDA default (measured there), off on
    CPU unless asked for, and "0" turns it off anywhere."""
    from treecompile.speculator import compiled_draft_from_env

    monkeypatch.setenv("TREECOMPILE_COMPILED_DRAFT", raw)
    assert compiled_draft_from_env(device) is on


@pytest.mark.parametrize("raw", ["2", "yes", "on"])
def test_compiled_draft_env_refuses_other_values_by_name(monkeypatch, llama, raw):
    monkeypatch.setenv("TREECOMPILE_COMPILED_DRAFT", raw)
    with pytest.raises(ValueError, match=r"TREECOMPILE_COMPILED_DRAFT='.*': expected '0' .* or '1'"):
        TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                       max_batch_size=1, max_seq_len=48, page_size=8)  # fmt: skip


@pytest.mark.parametrize(
    "raw, want",
    [("", {}), (" ", {}), ("deterministic=1", {"deterministic": True}),
     ("test_configs.force_filter_reduction_configs = true, coordinate_descent_tuning=False",
      {"test_configs.force_filter_reduction_configs": True, "coordinate_descent_tuning": False}),
     ("combo_kernels=0,coordinate_descent_search_radius=2", {"combo_kernels": False, "coordinate_descent_search_radius": 2})],
)  # fmt: skip
def test_draft_inductor_env_parses_inductor_options(monkeypatch, raw, want):
    """``TREECOMPILE_DRAFT_INDUCTOR``: key=value items, each value as its config's type (bools from 1/0/true/false)."""
    from treecompile.speculator import draft_inductor_options_from_env

    monkeypatch.setenv("TREECOMPILE_DRAFT_INDUCTOR", raw)
    assert draft_inductor_options_from_env() == want


@pytest.mark.parametrize(
    "raw, match",
    [("no_such_option=1", r"'no_such_option' is not an Inductor config"), ("deterministic", r"expected key=value"),
     ("=1", r"expected key=value"), ("deterministic=1,,", r"expected key=value"),
     ("deterministic=yes", r"deterministic='yes' is not a bool"),
     ("coordinate_descent_search_radius=two", r"coordinate_descent_search_radius='two' is not a int")],
)  # fmt: skip
def test_draft_inductor_env_refuses_bad_items_by_name_before_any_work(monkeypatch, llama, raw, match):
    monkeypatch.setenv("TREECOMPILE_COMPILED_DRAFT", "1")
    monkeypatch.setenv("TREECOMPILE_DRAFT_INDUCTOR", raw)
    with pytest.raises(ValueError, match=r"TREECOMPILE_DRAFT_INDUCTOR.*" + match):
        TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                       max_batch_size=1, max_seq_len=48, page_size=8, inductor=True)  # fmt: skip


@pytest.mark.parametrize("raw", ["", "test_configs.force_filter_reduction_configs=1,coordinate_descent_tuning=1"])
def test_draft_inductor_options_reach_the_draft_round_compile_only(monkeypatch, llama, raw):
    """The options go to the compiled draft round's ``compile_inference`` (and so to ``torch.compile``, which
    accepts them here), not to the commit's; unset, the draft round's compile gets none of its own."""
    import treecompile.speculator as speculator

    calls = []
    real = speculator.compile_inference

    def spy(fn, name, key=None, **kwargs):
        calls.append((name, kwargs))
        return real(fn, name, key, **kwargs)

    monkeypatch.setattr(speculator, "compile_inference", spy)
    monkeypatch.setenv("TREECOMPILE_COMPILED_DRAFT", "1")
    monkeypatch.setenv("TREECOMPILE_DRAFT_INDUCTOR", raw)
    TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                   max_batch_size=1, max_seq_len=48, page_size=8, inductor=True)  # fmt: skip
    draft = [kwargs for name, kwargs in calls if name.startswith("_draft_round")]
    others = [kwargs for name, kwargs in calls if not name.startswith("_draft_round")]
    assert len(draft) == 1 and others and all("options" not in kwargs for kwargs in others)
    if raw:
        assert draft[0]["options"] == {"test_configs.force_filter_reduction_configs": True, "coordinate_descent_tuning": True}
    else:
        assert "options" not in draft[0]


def test_draft_inductor_env_without_a_compiled_draft_round_warns(monkeypatch, llama, caplog):
    """Set where the draft round is not one compiled region (a CPU speculator without
    ``TREECOMPILE_COMPILED_DRAFT=1``), the options would do nothing: a warning says so instead of silence."""
    import logging

    monkeypatch.delenv("TREECOMPILE_COMPILED_DRAFT", raising=False)
    monkeypatch.setenv("TREECOMPILE_DRAFT_INDUCTOR", "coordinate_descent_tuning=1")
    with caplog.at_level(logging.WARNING, logger="treecompile.speculator"):
        TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                       max_batch_size=1, max_seq_len=48, page_size=8, inductor=True)  # fmt: skip
    assert any("TREECOMPILE_DRAFT_INDUCTOR is set but has no effect" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("TREECOMPILE_DRAFT_INDUCTOR", "no_such_option=1")  # unused, but still refused by name
    with pytest.raises(ValueError, match="TREECOMPILE_DRAFT_INDUCTOR: 'no_such_option' is not an Inductor config"):
        TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                       max_batch_size=1, max_seq_len=48, page_size=8, inductor=True)  # fmt: skip
    caplog.clear()
    monkeypatch.delenv("TREECOMPILE_DRAFT_INDUCTOR")
    with caplog.at_level(logging.WARNING, logger="treecompile.speculator"):
        TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                       max_batch_size=1, max_seq_len=48, page_size=8, inductor=True)  # fmt: skip
    assert not any("TREECOMPILE_DRAFT_INDUCTOR" in r.getMessage() for r in caplog.records)


def test_inductor_on_cpu_keeps_the_per_hook_draft_by_default(monkeypatch, llama):
    """Unset, a CPU speculator with Inductor hooks drafts hook by hook (the compiled round is a CUDA default),
    and a plain decode (one node) never compiles a draft round it would not use."""
    monkeypatch.delenv("TREECOMPILE_COMPILED_DRAFT", raising=False)
    spec = TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=2, steps=3, num_nodes=6,
                          max_batch_size=1, max_seq_len=48, page_size=8, inductor=True)  # fmt: skip
    assert spec._draft_fn == spec._draft_round
    monkeypatch.setenv("TREECOMPILE_COMPILED_DRAFT", "1")
    plain = TreeSpeculator(llama, EagleDrafter.for_target(llama, seed=3), topk=1, steps=1, num_nodes=1,
                           max_batch_size=1, max_seq_len=48, page_size=8, inductor=True)  # fmt: skip
    assert plain._draft_fn == plain._draft_round


@pytest.mark.parametrize("compiled_draft", ["0", "1"], ids=["per-hook", "whole-round"])
def test_new_batch_sizes_compile_new_code_not_recompiles(monkeypatch, compiled_draft):
    """Each compiled function of a round (the target's forward, the drafter's hooks, the draft tree, the
    commit, the whole draft round) keeps a private code object per batch size (and per draft step): a
    speculator serving a new batch size compiles new code and never recompiles old code, so Dynamo's
    recompile limit (8 a code object; past it the fullgraph commit raised) never bounds the batch sizes. The
    rounds after a size's first also compile nothing: the draft tree's step tables, once built lazily inside the
    whole round's first trace, made its second call compile the round again."""
    monkeypatch.setenv("TREECOMPILE_COMPILED_DRAFT", compiled_draft)
    model = tiny_llama(dtype=torch.float32, seed=5)
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=2, steps=3, num_nodes=6,
                          max_batch_size=2, max_seq_len=64, page_size=8, inductor=True, shrink_batch=False)  # fmt: skip
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in (2, 1, 2):  # a new size after another, then the first again (no recompile)
            out = spec.generate(ids[:b], max_new_tokens=8, eos_token_id=None)
            assert torch.equal(out.sequences, hf_greedy(model, ids[:b], max_new_tokens=8))
