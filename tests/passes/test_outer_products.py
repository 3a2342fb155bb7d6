"""outer_products: a matmul with a contraction of 1 becomes a broadcast multiply, bit for bit.

transformers 5.17 (the GPU machine's) forms the rotary frequencies as ``inv_freq @ positions`` in float32; 5.24
(this machine's) multiplies. The tests trace the 5.17 form, check the rewrite and its exactness, the cases left
alone, and a speculative generate through the treespec backend with the 5.17 form patched into a Llama.
"""

import logging
import operator

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from treecompile.drafter import EagleDrafter
from treecompile.passes import PASSES, outer_products
from treecompile.speculator import TreeSpeculator

from test_rewrite_attention import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def rope_517(inv_freq, position_ids, scaling=1.0, autocast=False, dtype=torch.float32):
    """transformers 5.17's LlamaRotaryEmbedding arithmetic (the K = 1 matmul), ``dtype`` the operands'."""
    inv = inv_freq[None, :, None].to(dtype).expand(position_ids.shape[0], -1, 1)
    pos = position_ids[:, None, :].to(dtype)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=autocast):
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scaling, emb.sin() * scaling


def capture(fn, *args, inputs=None):
    """The Dynamo graph of ``fn(*args)`` (fullgraph), before any pass; ``inputs`` gets its placeholders' values
    (lifted globals included)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        if inputs is not None:
            inputs.extend(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def matmuls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (operator.matmul, torch.matmul, torch.bmm)]


INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
POSITIONS = torch.tensor([[0, 1, 2, 7, 63, 64, 511, 4095, 70000], [5, 5, 5, 9, 100, 101, 102, 103, 104]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rope_frequencies_become_a_multiply_with_identical_values(dtype):
    fn = lambda pos: rope_517(INV_FREQ, pos, 0.5, dtype=dtype)  # noqa: E731
    inputs = []
    gm = capture(fn, POSITIONS, inputs=inputs)
    assert len(matmuls(gm)) == 1
    expected = fn(POSITIONS)
    gm = outer_products(gm)
    assert matmuls(gm) == [] and any(n.target is torch.mul for n in gm.graph.nodes)
    got = gm(*inputs)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_other_matmuls_are_left_alone():
    two = capture(lambda a, b: a @ b, torch.rand(3, 4, 2), torch.rand(3, 2, 5))  # K = 2: a real sum
    half = capture(lambda a, b: a @ b, torch.rand(3, 4, 1).bfloat16(), torch.rand(3, 1, 5).bfloat16())
    vector = capture(lambda a, b: a @ b, torch.rand(1), torch.rand(1, 5))  # 1-d operand: other semantics
    autocast = capture(lambda pos: rope_517(INV_FREQ, pos, autocast=True), POSITIONS)  # autocast would cast it
    for gm in (two, half, vector, autocast):
        before = len(matmuls(gm))
        assert before == 1 and len(matmuls(outer_products(gm))) == before


def test_the_pass_runs_in_the_backend_and_generate_stays_lossless(monkeypatch, caplog):
    """A Llama with 5.17's rotary arithmetic: the treespec backend rewrites its frequencies, and speculative
    generate (float64 weights, float32 rotary as HF computes it) equals HF greedy token for token."""
    assert outer_products in PASSES

    def forward_517(self, x, position_ids):
        cos, sin = rope_517(self.inv_freq, position_ids, self.attention_scaling)
        return cos.to(x.dtype), sin.to(x.dtype)

    monkeypatch.setattr(LlamaRotaryEmbedding, "forward", forward_517)
    model = tiny_model("llama")
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=3, steps=3, num_nodes=8,
                          max_batch_size=2, max_seq_len=64, page_size=8)  # fmt: skip
    ids = torch.randint(1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # ragged: HF left padding
    with caplog.at_level(logging.INFO, logger="treecompile.passes.outer_products"):
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert any("outer_products: 1 matmul" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)  # fmt: skip
    assert torch.equal(out.sequences, ref)
