"""Every treespec op on its Triton kernel inside a whole speculative generate, against HF greedy (float32).

The CPU suite otherwise checks each kernel alone (tests/ops, the interpreter) and the runtime through the ops'
CPU paths. Neither sees how the runtime lays out the kernels' arguments. A fused-write kernel that read a
strided column of the slot table as contiguous passed both and failed only on the GPU. Here every op module's
``use_triton`` answers yes, so the kernels, in the interpreter, take the runtime's own tensors: views of state
tables, padded ragged batches, verify windows, draft lanes, commits. The fused cache write is on, as it is on
CUDA. Families: attention (Llama), GDN + attention (Qwen3.5), Mamba2. Small vocabularies make deeper accepted
paths happen. Where CUDA is present each test runs in a child process without it (the ``interpreter`` marker):
the exact equality with HF greedy holds for the interpreter's float32, and the device's own runs of the same
layouts are test_speculator_gpu's.
"""

import importlib
import pkgutil

import pytest
import torch

import treecompile.ops as ops_package
from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.interpreter]  # kernels on the CPU model's tensors


@pytest.fixture
def kernels_everywhere(monkeypatch):
    patched = []
    for info in pkgutil.iter_modules(ops_package.__path__):
        module = importlib.import_module(f"treecompile.ops.{info.name}")
        if info.name != "_common" and hasattr(module, "use_triton"):
            monkeypatch.setattr(module, "use_triton", lambda *tensors: True)
            patched.append(info.name)
    fuse = importlib.import_module("treecompile.passes.fuse_cache_write")
    monkeypatch.setattr(fuse, "_DEVICE_TYPES", ("cuda", "cpu"))
    torch._dynamo.reset()
    return patched


def tiny(family: str, vocab: int):
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=vocab, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64))  # fmt: skip
    elif family == "qwen3_5":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, linear_num_value_heads=2, linear_num_key_heads=1,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
            max_position_embeddings=256))  # fmt: skip
    else:
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, head_dim=16, num_heads=8,
            n_groups=2, conv_kernel=4, chunk_size=4))  # fmt: skip
    model = model.float().eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("family,vocab,batch,new", [("llama", 128, 3, 6), ("qwen3_5", 8, 2, 10), ("mamba2", 8, 2, 6)])
def test_generate_on_kernels_equals_hf_greedy(kernels_everywhere, family, vocab, batch, new):
    assert {"tree_attention", "kv_write", "verify", "compact", "draft_topk"} <= set(kernels_everywhere)
    model = tiny(family, vocab)
    ids = torch.randint(1, vocab, (batch, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # ragged: HF left padding
    if batch > 2:
        mask[2, :6] = 0
    ids = ids * mask
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=2, steps=2, num_nodes=4,
                          max_batch_size=batch, max_seq_len=48)  # fmt: skip
    got = spec.generate(ids, mask, max_new_tokens=new, eos_token_id=[])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert torch.equal(got.sequences, want)
