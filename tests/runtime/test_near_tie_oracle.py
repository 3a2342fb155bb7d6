"""The bf16 agreement oracle of the GPU tests (``conftest.assert_partings_are_near_ties``) on the CPU: it passes
equal decodes and a parting at the model's tightest near-tie, and fails a parting at a clear margin, on the
same tiny random bf16 Llama and ragged prompts the GPU tests use."""

import copy

import pytest
import torch
from conftest import assert_partings_are_near_ties

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 40


@pytest.fixture(scope="module")
def decode():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    ids = ids * mask
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             eos_token_id=None)  # fmt: skip
        am = torch.cat([mask, mask.new_ones(3, NEW)], dim=1)
        logits = copy.deepcopy(model).float()(out, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0))
    # float32 logits of each new token's step: [B, NEW, V]
    return model, ids, mask, out, logits.logits[:, ids.shape[1] - 1 : -1].double()


def swapped(out, L, r, j, token):
    """``out`` with row r's new token j replaced and the rest of the row scrambled (a parted decode)."""
    b = out.clone()
    b[r, L + j] = token
    b[r, L + j + 1 :] = (out[r, L + j + 1 :] + 1) % 128
    return b


def test_equal_decodes_pass(decode):
    model, ids, mask, out, _ = decode
    assert assert_partings_are_near_ties(model, ids, mask, out, out.clone()) == [None, None, None]


def test_a_parting_at_the_tightest_near_tie_passes(decode):
    model, ids, mask, out, logits = decode
    top2 = logits.topk(2, dim=-1)
    gaps = top2.values[..., 0] - top2.values[..., 1]  # [B, NEW]
    r, j = divmod(gaps.argmin().item(), NEW)
    assert gaps[r, j] < 1e-3  # the premise: this random model has near-ties (bf16 logit error here ~6e-3)
    runner_up = top2.indices[r, j, 1] if top2.indices[r, j, 0] == out[r, ids.shape[1] + j] else top2.indices[r, j, 0]
    b = swapped(out, ids.shape[1], r, j, runner_up)
    firsts = assert_partings_are_near_ties(model, ids, mask, out, b)
    assert firsts[r] == j and firsts.count(None) == 2


def test_a_parting_at_a_clear_margin_fails(decode):
    model, ids, mask, out, logits = decode
    top2 = logits.topk(2, dim=-1)
    gaps = top2.values[..., 0] - top2.values[..., 1]
    r, j = divmod(gaps.argmax().item(), NEW)
    assert gaps[r, j] > 0.1  # the premise: a margin far past bf16 rounding
    b = swapped(out, ids.shape[1], r, j, top2.indices[r, j, 1])
    with pytest.raises(AssertionError, match=f"row {r} parts at new token {j}"):
        assert_partings_are_near_ties(model, ids, mask, out, b)
