"""``treecompile train-drafter``: the training forward is exactly what the drafter computes at inference
(step 0 and training-time-test steps against the paged draft cache and lanes, float64), the draft
vocabulary, resumability (interrupted data generation, checkpoints, Ctrl-C, resume == uninterrupted run),
the exported layout loading into a lossless TreeSpeculator, and clear errors on bad input.

The CLI runs end to end on a tiny random Llama with a character-level tokenizer saved as an HF directory
(``--target <path>``), so these tests need neither the network nor SmolLM2.
"""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch

import treecompile.train as train
from treecompile.cli import main
from treecompile.drafter import EagleDrafter
from treecompile.target import chain_mask

VOCAB_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def char_tokenizer():
    """A character-level HF tokenizer (vocab 99: <unk>, <eos>, <pad>, printable ASCII, newline) with a
    tiny chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2}
    for c in VOCAB_CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def tiny_llama(vocab=99, seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    tiny_llama().save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def cli_args(target_dir, out, steps, *extra):
    return ["train-drafter", "--target", str(target_dir), "--out", str(out), "--prompts", "6",
            "--max-new-tokens", "6", "--gen-batch-size", "4", "--steps", str(steps), "--batch-size", "2",
            "--draft-vocab", "40", "--checkpoint-every", "2", "--threads", "1", "--no-progress", "--device", "cpu",
            *extra]  # fmt: skip


def checkpoint(out):
    return torch.load(out / train.CHECKPOINT, weights_only=False)


# ---- the training forward is the inference forward ------------------------------------------------------


@pytest.mark.parametrize("T,J", [(1, 1), (9, 3), (33, 2)], ids=["T1-J1", "T9-J3", "T33-J2"])
def test_ttt_forward_equals_the_drafters_chain_and_lanes(T, J):
    """Row b of TTT step j equals a lane row at depth j of the round whose step-0 row sat at position b:
    step 0 through the paged draft cache, then j chain lanes (K=1) over the lane window, float64."""
    model = tiny_llama(vocab=64, dtype=torch.float64)
    head = EagleDrafter.for_target(model, seed=1)
    g = torch.Generator().manual_seed(T)
    feats = torch.randn(1, T, 3 * 32, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 64, (1, T + J + 1), generator=g)
    with torch.no_grad():
        outs = train.ttt_forward(head, feats, tokens, J)
        assert [tuple(o.shape) for o in outs] == [(1, T, 32)] * (J + 1)
        for b in sorted({0, T // 2, T - 1}):
            cache = head.new_cache(1, T + J + 8, page_size=4)
            pos = torch.arange(b + 1)[None]
            out0 = head.forward_rows(cache, head.project(feats[:, : b + 1]), tokens[:, 1 : b + 2], pos,
                                     cache.slots(pos), torch.tensor([0]), chain_mask(b + 1)[None], b + 1)  # fmt: skip
            torch.testing.assert_close(outs[0][0, b], out0[0, b], rtol=1e-10, atol=1e-10)
            hidden, vc = out0[:, b : b + 1], b + 1
            for s in range(1, J + 1):
                hidden = head.forward_rows(
                    cache, hidden, tokens[:, b + s + 1 : b + s + 2], torch.tensor([[vc - 1 + s]]),
                    cache.slots(torch.tensor([[vc + s - 1]])), torch.tensor([vc]), torch.tensor([[(1 << s) - 1]]), J,
                )  # fmt: skip
                torch.testing.assert_close(outs[s][0, b], hidden[0, 0], rtol=1e-10, atol=1e-10)


def test_ttt_forward_has_gradients_for_everything_the_head_owns():
    model = tiny_llama(vocab=64)
    head = EagleDrafter.for_target(model, seed=1)
    for p in head.embed.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    outs = train.ttt_forward(head, torch.randn(2, 5, 96, generator=g), torch.randint(0, 64, (2, 8), generator=g), 2)
    sum(head.logits(o).square().mean() for o in outs).backward()
    missing = [n for n, p in head.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert missing == [] and model.get_input_embeddings().weight.grad is None


def test_step_loss_weights_out_rows_without_a_target():
    """The loss over every row with the target-less rows weighted 0 equals the mean over the selected rows
    (float64 reference; the loss takes its log-softmax in float32, as for a 16-bit head); a step with no target reads NaN and adds nothing; a batch with none gives None."""
    model = tiny_llama(vocab=64, dtype=torch.float64)
    head = EagleDrafter.for_target(model, seed=1, draft_vocab_size=16).double()
    g = torch.Generator().manual_seed(5)
    B, T, J, k = 2, 6, 2, 3
    outs = [torch.randn(B, T, 32, generator=g, dtype=torch.float64) for _ in range(J + 1)]
    tgt = torch.randint(0, 16, (B, T + J + 1, k), generator=g)
    tgt_p = torch.rand(B, T + J + 1, k, generator=g, dtype=torch.float64)
    tgt[:, :2], tgt[1, 5:], tgt[:, T + 1 :] = -1, -1, -1  # prompt rows, a short sequence, past the end
    tgt_p[tgt[..., 0] < 0] = 0
    loss, losses, accs = train._step_loss(head, outs, tgt, tgt_p)
    want = 0.0
    for j, out in enumerate(outs):
        t, p = tgt[:, j + 1 : j + 1 + T], tgt_p[:, j + 1 : j + 1 + T]
        valid = t[..., 0] >= 0
        logp = torch.log_softmax(head.logits(out[valid]), -1)
        ce = -(p[valid] * logp.gather(1, t[valid])).sum(-1).mean()
        want = want + 0.8**j * ce
        assert losses[j] == pytest.approx(float(ce.detach()), rel=1e-6)
        assert accs[j] == pytest.approx(float((logp.argmax(-1) == t[valid][:, 0]).double().mean()), rel=1e-12)
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=0)
    tgt[:, 3:] = -1  # step 2's rows (positions 3..8) have no target left
    loss, losses, accs = train._step_loss(head, outs, tgt, tgt_p * (tgt >= 0))
    assert math.isnan(losses[2]) and math.isnan(accs[2]) and not math.isnan(losses[1])
    assert train._step_loss(head, outs, torch.full_like(tgt, -1), torch.zeros_like(tgt_p))[0] is None


# ---- draft vocabulary --------------------------------------------------------------------------------------


def _record(prompt, generated, alternatives):
    tokens = torch.tensor(prompt + generated, dtype=torch.int32)
    return {"tokens": tokens, "prompt_len": len(prompt), "features": torch.zeros(len(tokens) - 1, 3),
            "target_ids": torch.tensor(alternatives, dtype=torch.int32),
            "target_logp": torch.zeros(len(alternatives), len(alternatives[0]), dtype=torch.float16)}  # fmt: skip


def test_draft_vocab_takes_the_most_frequent_generated_tokens():
    # Generated: 7 x3, 5 x2, 9 x1; prompt tokens (30, 31) never count; alternatives 20 (x2) > 21 (x1).
    records = [_record([30, 31], [7, 5, 7], [[7, 20], [5, 21], [7, 20]]), _record([31], [7, 9, 5], [[7, 1], [9, 1], [5, 1]])]
    draft_ids, d2t, t2d = train.build_draft_vocab(records, vocab_size=40, draft_vocab=3)
    assert draft_ids.tolist() == [5, 7, 9]
    assert (torch.arange(3) + d2t).tolist() == [5, 7, 9] and t2d.nonzero().flatten().tolist() == [5, 7, 9]
    # Fewer distinct generated tokens than asked: alternatives by count (1 x3 > 20 x2 > 21 x1), then low ids.
    draft_ids, _, t2d = train.build_draft_vocab(records, vocab_size=40, draft_vocab=7)
    assert draft_ids.tolist() == [0, 1, 5, 7, 9, 20, 21] and int(t2d.sum()) == 7
    with pytest.raises(ValueError, match="draft_vocab: must be in 1..40"):
        train.build_draft_vocab(records, vocab_size=40, draft_vocab=41)


# ---- online features: the target in the training step ------------------------------------------------------


@pytest.mark.parametrize("temperature", [None, 1.5], ids=["greedy", "sampled"])
def test_online_features_equal_what_generate_recorded(monkeypatch, temperature):
    """The aux hidden states both feature modes use (parallel forwards over finished sequences: stored ones
    once after ``generate``, online ones in every training step) equal what ``generate`` itself returns with
    ``output_hidden_states`` (left-padded batch, step by step with a cache), float64; for ragged sequences
    right-padded in a batch, one sequence per forward (a budget of one row), and the rest of the batch left
    as it was."""
    model = tiny_llama(dtype=torch.float64, seed=3)
    prompts = [[5, 9, 11, 3], [7, 8], [12, 4, 4, 30, 31, 6, 40]]
    aux = [2, 2, 1]
    seen = {}
    real_generate = model.generate

    def generate_with_states(**kw):  # the oracle: generate's own states, as stored features were once made
        out = real_generate(**kw, output_hidden_states=True)
        seen["states"], seen["width"] = out.hidden_states, kw["input_ids"].shape[1]
        return out

    monkeypatch.setattr(model, "generate", generate_with_states)
    records = train._generate_shard(model, prompts, 9, aux, 6, [1], 2, temperature=temperature, seed=4)
    monkeypatch.undo()
    steps = [torch.cat([h[i] for i in aux], dim=-1) for h in seen["states"]]  # prefill [B, width, F], then [B, 1, F]
    states, width = torch.cat(steps, dim=1), seen["width"]
    for b, r in enumerate(records):
        n, L = len(r["tokens"]), r["prompt_len"]
        assert r["features"].dtype == torch.float16 and r["features"].shape == (n - 1, 96)
        torch.testing.assert_close(r["features"].double(), states[b, width - L : width + n - 1 - L],
                                   rtol=1e-3, atol=1e-3)  # float16 storage  # fmt: skip
    lean = train._generate_shard(model, prompts, 9, aux, 6, [1], 2, temperature=temperature, seed=4,
                                 features=False)  # fmt: skip
    assert all(set(r) == {"tokens", "prompt_len", "target_ids", "target_logp"} for r in lean)
    for a, b in zip(lean, records):  # the same continuations and targets, without the hidden states
        assert all(torch.equal(a[k], b[k]) for k in ("tokens", "target_ids", "target_logp"))
    assert len({len(r["tokens"]) for r in records}) > 1  # ragged
    t2d_index = torch.full((99,), -1, dtype=torch.long)
    t2d_index[3:90] = torch.arange(87)
    want = train._collate(records, [0, 1, 2], t2d_index, 2, "cpu")
    got = train._collate(lean, [0, 1, 2], t2d_index, 2, "cpu", online=True)
    assert got[0] is None and all(torch.equal(g, w) for g, w in zip(got[1:], want[1:]))
    T = want[0].shape[1]
    monkeypatch.setattr(train, "ONLINE_HIDDEN_BUDGET", T * 32 * 3)  # one sequence per forward
    (feats,) = train._online_features(model, lean, [[0, 1, 2]], [2, 2, 1], "cpu")
    assert feats.shape == want[0].shape and feats.dtype == torch.float32
    for b, r in enumerate(records):  # the stored features are float16; padded rows are never read
        n = len(r["tokens"])
        torch.testing.assert_close(feats[b, : n - 1], want[0][b, : n - 1], rtol=2e-3, atol=2e-3)
    # Several steps' batches in one round of forwards (padded to the longest, cut back to each batch's own
    # length), with the layer hooks and with HF's output_hidden_states, all budgets: the same features.
    monkeypatch.setattr(train, "ONLINE_HIDDEN_BUDGET", 1 << 28)
    split = train._online_features(model, lean, [[1], [0, 2], [1]], [2, 2, 1], "cpu")
    monkeypatch.setattr(train, "_decoder_layers", lambda *a: None)
    fallback = train._online_features(model, lean, [[1], [0, 2], [1]], [2, 2, 1], "cpu")
    for got in (split, fallback):
        assert [tuple(f.shape) for f in got] == [(1, len(lean[1]["tokens"]) - 1, 96), (2, T, 96), tuple(got[0].shape)]
        torch.testing.assert_close(got[1], feats[[0, 2]], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[0], feats[[1], : got[0].shape[1]], rtol=1e-12, atol=1e-12)


def test_stored_features_groups_and_float16_overflow(caplog, monkeypatch):
    """``_stored_features`` pairs every record with its own states however the rows are grouped into calls
    (sorted by length, so groups mix the records' order), and a record whose states overflow float16 keeps
    them in float32 with a warning while the others stay float16."""
    model = tiny_llama(dtype=torch.float64, seed=5)
    g = torch.Generator().manual_seed(2)
    lengths = (9, 3, 12, 5, 7)
    records = [{"tokens": torch.randint(3, 99, (n,), generator=g, dtype=torch.int32), "prompt_len": 2} for n in lengths]
    aux = [1, 3, 2]
    train._stored_features(model, records, aux)
    pairs = [dict(r) for r in records]
    train._stored_features(model, pairs, aux, rows_a_call=2)
    budget = [dict(r) for r in records]  # a hidden-state budget of one longest row: one row a group
    monkeypatch.setattr(train, "ONLINE_HIDDEN_BUDGET", (max(lengths) - 1) * 96)
    train._stored_features(model, budget, aux)
    monkeypatch.undo()
    with torch.no_grad():
        for r in records:
            out = model(input_ids=r["tokens"][None, :-1].long(), output_hidden_states=True)
            want = torch.cat([out.hidden_states[j] for j in aux], dim=-1)[0]
            assert r["features"].dtype == torch.float16 and r["features"].shape == (len(r["tokens"]) - 1, 96)
            torch.testing.assert_close(r["features"].double(), want, rtol=1e-3, atol=1e-3)
    for other in (pairs, budget):  # other groupings pad differently: the same values up to float16 rounding
        for a, r in zip(other, records):
            assert a["features"].dtype == torch.float16
            torch.testing.assert_close(a["features"].double(), r["features"].double(), rtol=1e-3, atol=1e-3)
    big = 1e8  # one token's embedding row past float16's range (65504) in every state it reaches
    with torch.no_grad():
        model.model.embed_tokens.weight[77] *= big
    hot = [{"tokens": torch.tensor([5, 77, 6, 7], dtype=torch.int32), "prompt_len": 2},
           {"tokens": torch.tensor([5, 8, 6, 7], dtype=torch.int32), "prompt_len": 2}]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="treecompile.train"):
        train._stored_features(model, hot, aux)
    assert hot[0]["features"].dtype == torch.float32 and bool(torch.isfinite(hot[0]["features"]).all())
    assert hot[0]["features"].abs().max() > 65504
    assert hot[1]["features"].dtype == torch.float16
    for r in hot:  # each record owns its storage (torch.save writes a view's whole storage)
        f = r["features"]
        assert f.untyped_storage().nbytes() == f.numel() * f.element_size()
    assert "exceed the float16 range" in caplog.text
    # Padding never decides: a group pads its shorter rows with token 0; make that token overflow too, and rows
    # that do not hold it keep float16.
    with torch.no_grad():
        model.model.embed_tokens.weight[0] *= big
    cool = [{"tokens": torch.tensor(t, dtype=torch.int32), "prompt_len": 2} for t in ([5, 8, 6], [5, 8, 6, 7, 9, 11])]
    train._stored_features(model, cool, aux)
    assert [r["features"].dtype for r in cool] == [torch.float16, torch.float16]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3_next", "bamba"])
def test_online_features_hooks_equal_hidden_states_across_families(family):
    """The layer hooks catch HF ``hidden_states[i]`` (layer i-1's output) in other families too, hybrid
    linear-attention and Mamba layers included: equal to the ``output_hidden_states`` fallback, float64."""
    import transformers as tf

    small = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=512)  # fmt: skip
    gdn = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4, full_attention_interval=2)  # fmt: skip
    configs = {
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**small)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**small)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**small, sliding_window=None)),
        "qwen3_next": lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            **small, **gdn, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
            num_experts_per_tok=1, mlp_only_layers=[0, 1, 2, 3])),
        "bamba": lambda: tf.BambaForCausalLM(tf.BambaConfig(
            **{k: v for k, v in small.items() if k != "head_dim"}, attn_layer_indices=[1], mamba_n_heads=4,
            mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4)),
    }  # fmt: skip
    torch.manual_seed(0)
    model = configs[family]().to(torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    records = [{"tokens": torch.randint(3, 99, (n,), generator=g, dtype=torch.int32), "prompt_len": 2} for n in (7, 4, 9)]
    aux = [1, 3, 2]
    assert train._decoder_layers(model, aux) is not None
    hooked = train._online_features(model, records, [[0, 1], [2]], aux, "cpu")
    with torch.no_grad():
        for idx, got in zip([[0, 1], [2]], hooked):
            for b, i in enumerate(idx):
                n = len(records[i]["tokens"])
                out = model(input_ids=records[i]["tokens"][None, :-1].long(), output_hidden_states=True)
                want = torch.cat([out.hidden_states[j] for j in aux], dim=-1)[0].float()
                torch.testing.assert_close(got[b, : n - 1], want, rtol=1e-6, atol=1e-6)


def test_online_shards_hold_no_features_and_train_like_stored(target_dir, tmp_path, capsys):
    """``--features online`` keeps shards without hidden states and trains on the same batches, targets and
    draft vocabulary as ``--features stored`` (what ``auto`` picks for data this small); the two runs'
    losses agree (their features differ by float16 rounding only). Resuming a directory under the other
    mode is refused, naming ``features``; under ``auto`` it keeps its mode."""
    online, stored = tmp_path / "online", tmp_path / "stored"
    sched = ("--schedule-steps", "4")  # the resume below must see the same learning-rate schedule
    assert main(cli_args(target_dir, online, 3, "--features", "online", *sched)) == 0
    assert main(cli_args(target_dir, stored, 3, *sched)) == 0
    shards = [torch.load(d / "data" / "gen_00000_00004.pt", weights_only=True) for d in (online, stored)]
    assert all("features" not in r for r in shards[0]["records"])
    assert all("features" in r for r in shards[1]["records"])
    for a, b in zip(*(s["records"] for s in shards)):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["target_ids"], b["target_ids"])
    runs = [checkpoint(online), checkpoint(stored)]
    assert torch.equal(runs[0]["draft_ids"], runs[1]["draft_ids"])
    for j in range(3):
        torch.testing.assert_close(runs[0]["history"][j]["loss"], runs[1]["history"][j]["loss"], rtol=1e-3, atol=1e-3)
    summaries = [json.loads((d / "training.json").read_text()) for d in (online, stored)]
    assert [s["features"] for s in summaries] == ["online", "stored"]
    assert summaries[0]["generated_tokens"] == summaries[1]["generated_tokens"] > 0
    capsys.readouterr()
    assert main(cli_args(target_dir, online, 4, "--resume", "--features", "stored")) == 2
    assert "features" in capsys.readouterr().err
    assert main(cli_args(target_dir, online, 4, "--resume", *sched)) == 0  # auto: the data's own mode
    assert json.loads((online / "training.json").read_text())["features"] == "online"
    # Resumed at step 3, inside a prefetch window (steps 0..7): equal to an uninterrupted online run.
    straight = tmp_path / "straight"
    assert main(cli_args(target_dir, straight, 4, "--features", "online", *sched)) == 0
    for name, tensor in checkpoint(online)["head"].items():
        assert torch.equal(tensor, checkpoint(straight)["head"][name]), name


def test_auto_features_store_what_fits_and_go_online_otherwise(target_dir, tmp_path, monkeypatch, caplog):
    """``--features auto`` stores the features when their upper bound fits a quarter of the memory and
    half the free disk, and goes online when it does not, saying which and why."""
    real = os.sysconf
    monkeypatch.setattr(train.os, "sysconf", lambda name: 1 if name == "SC_PHYS_PAGES" else real(name))
    with caplog.at_level(logging.INFO, logger="treecompile.train"):
        assert main(cli_args(target_dir, tmp_path / "no_memory", 1)) == 0
    assert "features: online (stored ones would take up to" in caplog.text
    assert json.loads((tmp_path / "no_memory" / "training.json").read_text())["features"] == "online"
    monkeypatch.setattr(train.os, "sysconf", real)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="treecompile.train"):
        assert main(cli_args(target_dir, tmp_path / "memory", 1)) == 0
    assert "features: stored (stored ones would take up to" in caplog.text


def test_sampled_shards_share_generate_calls_up_to_the_batch_size():
    """Every shard is made exactly once; a call never holds more than ``batch_size`` rows, never mixes
    prompt spans or greedy with sampled rows, and fills up when the prompts are fewer than the batch."""
    spans = [(0, 3), (3, 5)]
    todo = [(a, b, f"s{s}_{a}", s, None if s == 0 else 0.8) for s in range(5) for a, b in spans]
    for batch_size in (3, 5, 6, 9, 100):
        calls = train._group_samples(todo, batch_size)
        assert sorted(i for c in calls for i in c) == sorted(todo)
        for call in calls:
            rows = len(call) * (call[0][1] - call[0][0])
            assert rows <= max(batch_size, call[0][1] - call[0][0])
            assert len({(i[0], i[1]) for i in call}) == 1
            assert all(i[4] is None for i in call) == (call[0][4] is None)
            assert call[0][4] is not None or len(call) == 1
    assert sorted(len(c) for c in train._group_samples(todo, 9) if c[0][4] is not None) == [1, 3, 4]  # 3 + 1 of 3 rows, 4 of 2


# ---- the CLI end to end: resume, interruption, export ---------------------------------------------------


def test_resume_continues_from_the_checkpoint_and_equals_an_uninterrupted_run(target_dir, tmp_path, caplog):
    out = tmp_path / "head"
    assert main(cli_args(target_dir, out, 4, "--schedule-steps", "8")) == 0
    assert checkpoint(out)["step"] == 4
    shards = sorted((out / "data").glob("gen_*.pt"))
    assert [s.name for s in shards] == ["gen_00000_00004.pt", "gen_00004_00006.pt"]
    stamps = [s.stat().st_mtime_ns for s in shards]
    with caplog.at_level(logging.INFO, logger="treecompile.train"):
        assert main(cli_args(target_dir, out, 8, "--resume")) == 0
    assert "resuming from step 4" in caplog.text
    assert "2 of 2 shards already generated" in caplog.text  # finished data is not regenerated
    assert [s.stat().st_mtime_ns for s in shards] == stamps
    state = checkpoint(out)
    assert state["step"] == 8 and [h["step"] for h in state["history"]] == list(range(1, 9))

    straight = tmp_path / "straight"
    assert main(cli_args(target_dir, straight, 8)) == 0
    other = checkpoint(straight)
    for name, tensor in state["head"].items():
        assert torch.equal(tensor, other["head"][name]), name
    summary = json.loads((out / "training.json").read_text())
    assert summary["steps"] == 8 and summary["sequences"] == 6 and summary["draft_vocab"] == 40
    assert summary["command"].startswith("treecompile train-drafter --target")


def test_max_minutes_stops_with_a_checkpoint_mid_interval(target_dir, tmp_path, monkeypatch):
    """--max-minutes stops after the step that passes it and checkpoints there, between two scheduled
    checkpoints (--checkpoint-every 2): nothing trained is lost, and --resume goes on. A fake clock makes
    each training step take 10 s, so 0.4 minutes stop the run after step 3."""
    now = [0.0]
    step_loss = train._step_loss

    def slow_step_loss(*args, **kwargs):
        now[0] += 10.0
        return step_loss(*args, **kwargs)

    monkeypatch.setattr(train, "_step_loss", slow_step_loss)
    monkeypatch.setattr(train.time, "perf_counter", lambda: now[0])
    out = tmp_path / "head"
    assert main(cli_args(target_dir, out, 8, "--max-minutes", "0.4")) == 0
    state = checkpoint(out)
    assert state["step"] == 3 and [h["step"] for h in state["history"]] == [1, 2, 3]
    assert json.loads((out / "training.json").read_text())["steps"] == 3
    monkeypatch.undo()
    assert main(cli_args(target_dir, out, 8, "--resume")) == 0
    assert checkpoint(out)["step"] == 8


def test_init_from_trains_on_from_an_exported_head(target_dir, tmp_path, caplog):
    """--init-from starts from a head's exported weights and draft vocabulary, not from a fresh init: with a
    learning rate too small to move a float16 weight, the new run exports the old head again, bit for bit
    (new data: another seed's samples, vocabulary counted from it ignored)."""
    from safetensors.torch import load_file

    first = tmp_path / "first"
    assert main(cli_args(target_dir, first, 2)) == 0
    again = tmp_path / "again"
    extra = ("--seed", "1", "--samples-per-prompt", "2", "--lr", "1e-12")
    with caplog.at_level(logging.INFO, logger="treecompile.train"):
        assert main(cli_args(target_dir, again, 1, "--init-from", str(first), *extra)) == 0
    assert "warm start from" in caplog.text
    old, new = load_file(str(first / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert sorted(old) == sorted(new)
    for name in old:
        assert torch.equal(old[name], new[name]), name
    assert torch.equal(checkpoint(again)["draft_ids"], checkpoint(first)["draft_ids"])
    # The new head's training.json carries the one it started from, whose own has no warm start.
    summary, base = (json.loads((d / "training.json").read_text()) for d in (again, first))
    assert summary["init_from"] == {"path": str(first), "training": base} and base["init_from"] is None
    fresh = tmp_path / "fresh"  # the same run without the warm start exports another head
    assert main(cli_args(target_dir, fresh, 1, *extra)) == 0
    assert not torch.equal(load_file(str(fresh / "model.safetensors"))["fc.weight"], old["fc.weight"])


def test_ctrl_c_saves_a_checkpoint_that_resumes(target_dir, tmp_path, monkeypatch):
    out = tmp_path / "head"
    calls = []
    real = train.ttt_forward

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "ttt_forward", interrupted)
    assert main(cli_args(target_dir, out, 6)) == 130
    assert checkpoint(out)["step"] == 2  # steps 1 and 2 finished; step 3 was cut
    monkeypatch.setattr(train, "ttt_forward", real)
    assert main(cli_args(target_dir, out, 6, "--resume")) == 0
    assert checkpoint(out)["step"] == 6


def test_interrupted_generation_regenerates_only_what_is_missing(target_dir, tmp_path, monkeypatch):
    out = tmp_path / "head"
    assert main(cli_args(target_dir, out, 1)) == 0
    (out / "data" / "gen_00004_00006.pt").unlink()  # as if the run died during the second batch
    (out / "data" / "gen_00000_00004.pt").with_name(".gen_00004_00006.pt.tmp-1").write_bytes(b"partial")
    spans = []
    real = train._generate_shard

    def counting(model, prompt_ids, *args, **kwargs):
        spans.append(len(prompt_ids))
        return real(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(train, "_generate_shard", counting)
    assert main(cli_args(target_dir, out, 2, "--resume")) == 0
    assert spans == [2]
    assert checkpoint(out)["step"] == 2


def test_sampled_continuations_extend_the_data_and_record_the_untempered_target(target_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "head"
    assert main(cli_args(target_dir, out, 1, "--features", "stored")) == 0
    calls = []
    real = train._generate_shard

    def counting(model, prompt_ids, *args, **kwargs):
        calls.append((kwargs.get("temperature"), len(prompt_ids)))
        return real(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(train, "_generate_shard", counting)
    # Two more samples per prompt: the greedy shards are reused, only the sampled ones are generated; the
    # last span's two prompts get both their samples from one call of 4 rows (--gen-batch-size 4).
    assert main(cli_args(target_dir, out, 2, "--resume", "--samples-per-prompt", "3", "--temperature", "1.5",
                         "--features", "stored")) == 0  # fmt: skip
    assert calls == [(1.5, 4)] * 3
    data = out / "data"
    pair = [torch.load(data / f"gen_s{i}_00004_00006.pt", weights_only=True) for i in (1, 2)]
    assert [len(p["records"]) for p in pair] == [2, 2] and pair[0]["prompts"] == pair[1]["prompts"]
    assert any(not torch.equal(a["tokens"], b["tokens"]) for a, b in zip(pair[0]["records"], pair[1]["records"]))
    greedy = torch.load(data / "gen_00000_00004.pt", weights_only=True)
    sampled = torch.load(data / "gen_s1_00000_00004.pt", weights_only=True)
    assert greedy["temperature"] is None and sampled["temperature"] == 1.5
    assert json.loads((out / "training.json").read_text())["sequences"] == 18
    # At temperature 1.5 some sampled continuation leaves the greedy one ...
    pairs = zip(greedy["records"], sampled["records"])
    assert any(not torch.equal(g["tokens"], s["tokens"]) for g, s in pairs)
    # ... and its recorded targets are still the target's own (untempered) distribution at each position.
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    rec = sampled["records"][0]
    L, m = rec["prompt_len"], len(rec["target_ids"])
    with torch.no_grad():
        logp = torch.log_softmax(model(rec["tokens"][None].long()).logits[0].float(), -1)
    top = logp[L - 1 : L - 1 + m].topk(rec["target_ids"].shape[1], dim=-1)
    assert torch.equal(top.indices.int(), rec["target_ids"])
    torch.testing.assert_close(top.values.half(), rec["target_logp"], atol=2e-3, rtol=2e-3)


def assert_speculates_like_greedy(model, head) -> None:
    """A short tree-speculated generate with ``head`` equals HF greedy on ``model``."""
    from treecompile.speculator import TreeSpeculator

    spec = TreeSpeculator(model, head, topk=2, steps=3, num_nodes=6, max_batch_size=1, max_seq_len=128, page_size=16)
    ids = torch.tensor([train.chat_ids(char_tokenizer(), "hello")])
    got = spec.generate(ids, max_new_tokens=12, eos_token_id=1).sequences
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=1, pad_token_id=2)  # fmt: skip
    assert torch.equal(got, want)


def test_exported_head_loads_and_speculates_losslessly(target_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / "head"
    assert main(cli_args(target_dir, out, 2)) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["target_hidden_size"] == 32
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in (2, 2, 1)]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.float16
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert any(n.startswith("midlayer.") for n in names) and not any(n.startswith("embed_tokens") for n in names)

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    head = EagleDrafter.from_pretrained(out, model)
    draft_ids = checkpoint(out)["draft_ids"]
    assert torch.equal(torch.arange(40) + head.d2t, draft_ids) and torch.equal(head.t2d.nonzero().flatten(), draft_ids)
    assert_speculates_like_greedy(model, head)


def test_frozen_lm_head_ships_without_it_and_loads_from_the_target(target_dir, tmp_path):
    """--freeze-lm-head keeps the target's own output rows: the export leaves them out (the draft vocabulary then
    costs nothing to ship), the config says lm_head_from_target, and from_pretrained takes them from the target
    again, equal to what was trained with; speculation with the reloaded head is lossless."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from treecompile.drafter import target_lm_head_rows

    out = tmp_path / "head"
    assert main(cli_args(target_dir, out, 2, "--freeze-lm-head")) == 0
    assert json.loads((out / "config.json").read_text())["lm_head_from_target"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys()) and "d2t" in set(f.keys())
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    head = EagleDrafter.from_pretrained(out, model)
    draft_ids = checkpoint(out)["draft_ids"]
    assert torch.equal(head.lm_head.weight, model.get_output_embeddings().weight[draft_ids])
    trained = checkpoint(out)["head"]["lm_head.weight"]  # frozen through training: still the target's rows
    assert torch.equal(trained, model.get_output_embeddings().weight[draft_ids].float())
    assert_speculates_like_greedy(model, head)
    # A head that holds rows and also claims to take them from the target is refused, as is a target without
    # an output embedding of the head's width, and an export whose lm_head is not the target's rows.
    config = json.loads((out / "config.json").read_text())
    both = tmp_path / "both"
    both.mkdir()
    (both / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    state["lm_head.weight"] = torch.zeros(40, 32, dtype=torch.float16)
    save_file(state, str(both / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head_from_target"):
        EagleDrafter.from_pretrained(both, model)
    with pytest.raises(ValueError, match="target: a head with lm_head_from_target"):
        target_lm_head_rows(torch.nn.Module(), head.d2t, 32)
    head.lm_head.weight.data.add_(1.0)
    with pytest.raises(ValueError, match="lm_head_from: the head's lm_head is not the target's"):
        train.export_head(head, tmp_path / "bad", lm_head_from=model)


def test_quantize_rows_int8_is_within_half_a_step_of_each_row():
    """Symmetric per-row int8: every weight comes back within half its row's step (absmax / 127), the row's
    largest magnitude exactly; an all-zero row stays zero (scale 1, no division by zero)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 19, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 37, dtype=torch.float64)[:, None]
    w[5] = 0.0
    q, scale = train.quantize_rows_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape and scale.shape == (37,)
    back = q.double() * scale.double()[:, None]
    step = w.abs().amax(dim=1) / 127
    assert (back - w).abs().le(step[:, None] * 0.5 * (1 + 1e-6) + 1e-12).all()
    assert q.abs().amax(dim=1)[torch.arange(37) != 5].eq(127).all()
    assert q[5].eq(0).all() and scale[5] == 1.0


def test_int8_lm_head_ships_half_the_bytes_and_loads_dequantized(target_dir, tmp_path):
    """--lm-head-int8 writes the lm_head rows as int8 + one float32 scale a row (config lm_head_int8);
    from_pretrained dequantizes them to within half a step of the trained rows, and speculation with the
    reloaded head is lossless. Files that disagree with their config are refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "head"
    assert main(cli_args(target_dir, out, 2, "--lm-head-int8")) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["lm_head_int8"] is True and "lm_head_from_target" not in config
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.int8
        assert tuple(f.get_tensor("lm_head.weight_scale").shape) == (40,)
        assert f.get_tensor("fc.weight").dtype == torch.float16  # the rest keeps the export dtype
    assert json.loads((out / "training.json").read_text())["lm_head_int8"] is True
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    head = EagleDrafter.from_pretrained(out, model)
    trained = checkpoint(out)["head"]["lm_head.weight"].double()
    step = trained.abs().amax(dim=1, keepdim=True) / 127
    assert head.lm_head.weight.dtype == torch.float64
    assert (head.lm_head.weight - trained).abs().le(step * 0.5 * (1 + 1e-5)).all()
    assert not torch.equal(head.lm_head.weight, trained)  # it did go through int8
    assert_speculates_like_greedy(model, head)

    state = load_file(str(out / "model.safetensors"))
    cases = {  # config lm_head_int8, the file's tensors -> the error
        "float_rows": (True, {**state, "lm_head.weight": state["lm_head.weight"].half()}, "expected int8 rows"),
        "no_scale": (True, {k: v for k, v in state.items() if k != "lm_head.weight_scale"}, "expected int8 rows"),
        "bad_scale": (True, {**state, "lm_head.weight_scale": state["lm_head.weight_scale"][:7]},
                      r"weight_scale has shape \(7,\), expected \(40,\)"),
        "unflagged": (False, state, "does not say lm_head_int8"),
    }  # fmt: skip
    for name, (flag, tensors, match) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        cfg = dict(config)
        if not flag:
            cfg.pop("lm_head_int8")
        (bad / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            EagleDrafter.from_pretrained(bad, model)
    with pytest.raises(ValueError, match="lm_head_int8: a frozen lm_head"):
        train.TrainConfig(out=str(tmp_path / "x"), lm_head_int8=True, freeze_lm_head=True).validate()
    with pytest.raises(ValueError, match="lm_head_int8: the lm_head is taken from the target"):
        train.export_head(head, tmp_path / "both_ways", lm_head_from=model, lm_head_int8=True)


# ---- bad input ----------------------------------------------------------------------------------------------


def test_bad_input_is_refused_with_the_argument_named(target_dir, tmp_path, capsys):
    out = tmp_path / "head"
    assert main(cli_args(target_dir, out, 1, "--resume")) == 2
    assert "resume:" in capsys.readouterr().err and not (out / "data").exists()
    assert main(cli_args(target_dir, out, 1)) == 0
    assert main(cli_args(target_dir, out, 2)) == 2  # a checkpoint exists: never silently start over
    assert "pass --resume" in capsys.readouterr().err
    big = cli_args(target_dir, tmp_path / "memory", 1)
    big[big.index("--draft-vocab") + 1] = "500"
    assert main(big) == 2
    assert "draft_vocab: must be in 1..99" in capsys.readouterr().err
    changed = cli_args(target_dir, out, 2, "--resume")
    changed[changed.index("--max-new-tokens") + 1] = "7"
    assert main(changed) == 2  # cached data from other settings is never mixed in
    assert "max_new_tokens" in capsys.readouterr().err
    assert main(cli_args(target_dir, tmp_path / "zero", 0)) == 2
    assert "steps: expected a positive int" in capsys.readouterr().err
    assert main(cli_args(target_dir, tmp_path / "hot", 1, "--samples-per-prompt", "2", "--temperature", "0")) == 2
    assert "temperature: expected a float in (0, 2]" in capsys.readouterr().err
    assert main(cli_args(target_dir, tmp_path / "k0", 1, "--topk-targets", "0")) == 2
    assert "topk_targets: expected a positive int, got 0" in capsys.readouterr().err
    assert main(cli_args(target_dir, tmp_path / "cold", 1, "--init-from", str(tmp_path / "nowhere"))) == 2
    assert "init_from: " in capsys.readouterr().err
    other = cli_args(target_dir, tmp_path / "vocab", 1, "--init-from", str(out))
    other[other.index("--draft-vocab") + 1] = "30"
    assert main(other) == 2
    assert "init_from: the head has 40 draft ids, --draft-vocab is 30; pass --draft-vocab 40" in capsys.readouterr().err
    assert main(cli_args(target_dir, out, 1, "--init-from", str(out))) == 2
    assert "init_from: " in (err := capsys.readouterr().err) and "is also --out" in err
    assert main(cli_args(target_dir, tmp_path / "minutes", 1, "--max-minutes", "0")) == 2
    assert "max_hours: expected a positive number" in capsys.readouterr().err
    with pytest.raises(ValueError, match="features: one of auto, online, stored; got 'disk'"):
        train.TrainConfig(out=str(tmp_path / "x"), features="disk").validate()


def test_init_from_grows_the_draft_vocabulary(target_dir, tmp_path, caplog):
    """--init-from with a larger --draft-vocab keeps every id of the head, its lm_head row and the rest of its
    weights (a learning rate too small to move a float16 weight exports them again bit for bit), adds the ids the
    run's data generates most, their rows the target's own carried by the least-squares map from the target's
    rows of the old ids to the head's, and the grown head speculates losslessly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    first = tmp_path / "first"
    assert main(cli_args(target_dir, first, 2)) == 0  # 40 ids
    grown = tmp_path / "grown"
    args = cli_args(target_dir, grown, 1, "--init-from", str(first), "--seed", "1", "--lr", "1e-12")
    args[args.index("--draft-vocab") + 1] = "60"
    with caplog.at_level(logging.INFO, logger="treecompile.train"):
        assert main(args) == 0
    assert "draft vocabulary 40 -> 60 ids (new lm_head rows: the target's, mapped" in caplog.text
    old_ids, new_ids = checkpoint(first)["draft_ids"], checkpoint(grown)["draft_ids"]
    assert len(new_ids) == 60 and bool((new_ids[1:] > new_ids[:-1]).all())
    assert set(old_ids.tolist()) <= set(new_ids.tolist())
    old, new = load_file(str(first / "model.safetensors")), load_file(str(grown / "model.safetensors"))
    for name in old:
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(old[name], new[name]), name
    position = torch.searchsorted(new_ids, old_ids)
    assert torch.equal(new["lm_head.weight"][position], old["lm_head.weight"])
    added = torch.tensor([i for i in range(60) if i not in set(position.tolist())])
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    target = model.get_output_embeddings().weight.detach().float().double()  # the float32 head's copy, widened
    trained = checkpoint(first)["head"]["lm_head.weight"].double()
    mapping = torch.linalg.lstsq(target[old_ids], trained).solution
    want = (target[new_ids[added]] @ mapping).float().to(torch.float16)
    torch.testing.assert_close(new["lm_head.weight"][added], want, rtol=0, atol=2e-3)
    assert not torch.equal(want, target[new_ids[added]].to(torch.float16))  # the map moved them off the raw rows
    head = EagleDrafter.from_pretrained(grown, model)
    assert head.draft_vocab_size == 60 and torch.equal(torch.arange(60) + head.d2t, new_ids)
    assert_speculates_like_greedy(model, head)
