"""Lossless greedy speculation: ``TreeSpeculator.generate`` equals HF ``generate(do_sample=False)`` token for
token on tiny random float64 models of every supported family, with ragged left-padded batches.

A random EAGLE-3 head rarely agrees with a random target, so most rounds accept the root only. To reach
deep paths (and non-trivial KV compaction) the oracle drafter below scores with the target itself, with
noise, so the target's token is usually among the top-k but often not first: accepted paths then run
through second and third children.
"""

import zlib

import pytest
import torch

from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
VOCAB = 96


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def tiny_model(family: str, seed: int = 0, layers: int = 3):
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
        Qwen3Config, Qwen3ForCausalLM,
    )  # fmt: skip

    kinds = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    config_cls, model_cls = kinds[family]
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)  # fmt: skip
    if family == "mistral":
        kwargs["sliding_window"] = None
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    return model


class OracleDrafter(EagleDrafter):
    """Scores every draft step with the target's own (noisy) logits over the request's history plus the
    lane's path; the EAGLE head still runs so the draft cache and hidden rows flow as in production."""

    @classmethod
    def build(cls, target, noise: float, seed: int = 0, per_sequence: bool = False) -> "OracleDrafter":
        """``per_sequence``: the noise a function of the scored sequence (its own seed), not of how many
        drafts ran before; for comparing runs that launch different numbers of drafts."""
        head = cls.for_target(target, seed=seed)
        object.__setattr__(head, "oracle", target)
        head.noise = noise
        head.generator = torch.Generator().manual_seed(seed)
        head.per_sequence = per_sequence
        return head

    def _scored(self, sequences: list[list[int]]) -> torch.Tensor:
        logits = []
        for seq in sequences:
            with torch.no_grad():
                out = self.oracle(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            g = self.generator
            if self.per_sequence:
                g = torch.Generator().manual_seed(zlib.crc32(torch.tensor(seq, dtype=torch.int64).numpy().tobytes()))
            logits.append(out + self.noise * out.std() * torch.randn(out.shape, generator=g, dtype=out.dtype))
        return torch.stack(logits)

    def draft_step0(self, cache, features, tokens, positions, slots, prefix_len, ancestor_mask, last_row, context):
        hidden, _ = super().draft_step0(cache, features, tokens, positions, slots, prefix_len, ancestor_mask, last_row, context)
        vc = context.vc.tolist()
        return hidden, self._scored([context.history[b, : vc[b] + 1].tolist() for b in range(len(vc))])

    def draft_lanes(self, cache, hidden, tokens, positions, slots, prefix_len, ancestor_mask, window, context):
        out, _ = super().draft_lanes(cache, hidden, tokens, positions, slots, prefix_len, ancestor_mask, window, context)
        B, K = tokens.shape
        vc, masks, lanes = context.vc.tolist(), ancestor_mask.tolist(), context.lane_tokens.tolist()
        sequences = []
        for b in range(B):
            for r in range(K):
                path = [lanes[b][j] for j in range(window) if (masks[b][r] >> j) & 1]
                sequences.append(context.history[b, : vc[b] + 1].tolist() + path)
        return out, self._scored(sequences).view(B, K, -1)


def ragged_batch(generator, batch: int, shortest: int = 3, longest: int = 12):
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=generator)
    width = int(lengths.max())
    ids = torch.zeros(batch, width, dtype=torch.int64)
    mask = torch.zeros(batch, width, dtype=torch.int64)
    for b, length in enumerate(lengths.tolist()):
        ids[b, width - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[b, width - length :] = 1
    return ids, mask


def hf_greedy(model, ids, mask, max_new_tokens, eos=None, pad=0):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=pad)  # fmt: skip


def assert_same(spec_out, ref, max_new_tokens=None):
    seq = spec_out.sequences
    assert seq.shape == ref.shape, (seq.shape, ref.shape)
    if not torch.equal(seq, ref):
        bad = (seq != ref).nonzero()[0].tolist()
        raise AssertionError(f"first difference at {bad}:\nours {seq.tolist()}\nHF   {ref.tolist()}")
    if max_new_tokens is not None:  # without EOS every request emits exactly max_new_tokens:
        # the prefill's first token, then accept_lengths (bonus included) per round
        assert spec_out.accept_lengths.sum(0).tolist() == [max_new_tokens - 1] * seq.shape[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_random_drafter_matches_hf_greedy(family):
    """K=3, S=4, N=10 with a random EAGLE-3 head; four ragged batches of 3 prompts, 16 new tokens each."""
    model = tiny_model(family)
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=3, steps=4, num_nodes=10,
                          max_batch_size=3, max_seq_len=64, page_size=8)  # fmt: skip
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        ids, mask = ragged_batch(g, 3)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
        ref = hf_greedy(model, ids, mask, 16)
        assert_same(out, ref, 16)


SHAPES = [(2, 3, 6), (4, 5, 32), (3, 4, 12), (1, 4, 5)]


@pytest.mark.parametrize("topk,steps,num_nodes", SHAPES, ids=[f"K{k}-S{s}-N{n}" for k, s, n in SHAPES])
def test_oracle_drafter_accepts_deep_paths_and_stays_lossless(topk, steps, num_nodes):
    family = "llama" if topk != 3 else "qwen3"
    model = tiny_model(family, seed=3)
    drafter = OracleDrafter.build(model, noise=0.0 if topk == 1 else 0.6, seed=2)
    spec = TreeSpeculator(model, drafter, topk=topk, steps=steps, num_nodes=num_nodes, max_batch_size=2,
                          max_seq_len=96, page_size=8)  # fmt: skip
    g = torch.Generator().manual_seed(11)
    deep = 0
    for _ in range(2):
        ids, mask = ragged_batch(g, 2)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
        assert_same(out, hf_greedy(model, ids, mask, 20), 20)
        deep = max(deep, int(out.accept_lengths.max()))
        assert out.accept_lengths.float().mean() > 1.5  # the oracle really speculates
    assert deep >= 3  # some round accepted at least two drafted tokens plus the bonus
    if topk == 1:
        assert spec.tree is None  # the chain path: no DraftTree, no tree state


def test_eos_inside_an_accepted_path_truncates_there():
    """Pick EOS ids that HF's greedy continuation emits mid-stream; the oracle accepts deep paths, so the
    EOS lands inside a multi-token accept and everything after it must be dropped and padded."""
    model = tiny_model("mistral", seed=5)
    spec = TreeSpeculator(model, OracleDrafter.build(model, noise=0.3, seed=4), topk=2, steps=4, num_nodes=8,
                          max_batch_size=3, max_seq_len=96, page_size=8)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    ids, mask = ragged_batch(g, 3)
    free = hf_greedy(model, ids, mask, 24)[:, ids.shape[1]:]
    eos = [int(free[0, 9]), int(free[2, 5])]  # one id per row stopping mid-stream (lists: any stops)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    ref = hf_greedy(model, ids, mask, 24, eos=eos, pad=0)
    assert torch.equal(out.sequences, ref), (out.sequences.tolist(), ref.tolist())
    assert out.sequences.shape[1] < ids.shape[1] + 24 or (ref[:, -1] == 0).any()


@pytest.mark.parametrize("topk,steps,num_nodes", [(3, 4, 10), (1, 4, 5)], ids=["tree", "chain"])
def test_folded_draft_cache_write_stays_lossless(monkeypatch, topk, steps, num_nodes):
    """``fold_cache_write``: every draft step's cache write goes through ``write_attention`` (one op with the
    attention; its boundary refuses a lane offset outside the window), step 0 at offset 0 and lane step s
    at (s - 1) K; the output equals HF greedy and the unfolded run's."""
    from treecompile.kv_cache import PagedKVCache

    calls = []
    real = PagedKVCache.write_attention

    def spy(self, layer, q, k, v, slots, mask, window, scale, prefix_len=None, window_offset=0):
        calls.append((q.shape[1], window, window_offset))
        return real(self, layer, q, k, v, slots, mask, window, scale, prefix_len, window_offset)

    monkeypatch.setattr(PagedKVCache, "write_attention", spy)
    model = tiny_model("llama", seed=5)
    g = torch.Generator().manual_seed(3)
    ids, mask = ragged_batch(g, 2)
    outs = []
    for fold in (False, True):
        drafter = EagleDrafter.for_target(model, seed=1)
        drafter.fold_cache_write = fold
        spec = TreeSpeculator(model, drafter, topk=topk, steps=steps, num_nodes=num_nodes, max_batch_size=2,
                              max_seq_len=64, page_size=8)  # fmt: skip
        outs.append(spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0))
        assert bool(calls) == fold
    assert_same(outs[1], hf_greedy(model, ids, mask, 12), 12)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    lane_window = (steps - 1) * topk
    lane_offsets = {off for rows, window, off in calls if window == lane_window and rows == topk}
    assert lane_offsets == {s * topk for s in range(steps - 1)}


def test_only_drafters_that_override_a_hook_get_the_lane_tokens():
    """The round copies each lane step's tokens into ``DraftContext.lane_tokens`` only for a drafter that may
    read them: the EAGLE head does not (one copy kernel a lane step saved), a hook-overriding oracle does
    (the oracle tests above read them to score paths)."""
    model = tiny_model("llama", seed=5)
    assert EagleDrafter.for_target(model, seed=1).reads_draft_context is False
    assert OracleDrafter.build(model, noise=0.0, seed=2).reads_draft_context is True



@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_commit_keeps_eos_and_max_new_tokens_exact(backend):
    """``TREECOMPILE_COMPILED_COMMIT``: the commit compiled whole (fullgraph; in-place updates of the request
    state written back by the compiler). EOS inside an accepted path and the max_new_tokens cut must come out
    as HF greedy's, over two requests in a row on the same speculator (no state leaks)."""
    from treecompile.compiling import compile_inference
    from treecompile.speculator import _commit_tokens

    model = tiny_model("mistral", seed=5)
    spec = TreeSpeculator(model, OracleDrafter.build(model, noise=0.3, seed=4), topk=2, steps=4, num_nodes=8,
                          max_batch_size=3, max_seq_len=96, page_size=8)  # fmt: skip
    spec._commit_fn = compile_inference(_commit_tokens, f"_commit_tokens_test_{backend}", fullgraph=True,
                                        backend=backend)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    ids, mask = ragged_batch(g, 3)
    free = hf_greedy(model, ids, mask, 24)[:, ids.shape[1]:]
    eos = [int(free[0, 9]), int(free[2, 5])]
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, hf_greedy(model, ids, mask, 24, eos=eos, pad=0))
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=13, eos_token_id=None, pad_token_id=0)
    assert_same(out, hf_greedy(model, ids, mask, 13), 13)
