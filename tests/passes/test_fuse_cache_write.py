"""fuse_cache_write: on CUDA graphs each layer's kv_write + tree_attention_paged becomes one
tree_attention_paged_write call. The pass runs on CUDA bindings only; here it is told the CPU counts too, so
the rewrite runs on this machine (the fused op's CPU path is the two ops in order: identical logits), and a
speculative generate through it still equals HF greedy in float64. The fused kernel itself:
tests/ops/test_tree_attention_write.py."""

import importlib

import pytest
import torch

from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator

from test_rewrite_attention import _targets, rewrite_and_capture, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

fuse_module = importlib.import_module("treecompile.passes.fuse_cache_write")  # the package attribute is the pass


@pytest.fixture
def cpu_counts(monkeypatch):
    monkeypatch.setattr(fuse_module, "_DEVICE_TYPES", ("cuda", "cpu"))


def _logits(runner, binding):
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        return runner(ids, torch.arange(9).expand(2, 9).contiguous())[0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_layer_becomes_one_fused_call_with_identical_logits(family, cpu_counts):
    model = tiny_model(family)
    binding, runner, gm = rewrite_and_capture(model)
    targets = _targets(gm)
    layers = model.config.num_hidden_layers
    assert targets.count(torch.ops.treespec.tree_attention_paged_write.default) == layers
    assert torch.ops.treespec.kv_write.default not in targets
    assert torch.ops.treespec.tree_attention_paged.default not in targets
    fused = _logits(runner, binding)
    fuse_module._DEVICE_TYPES = ("cuda",)  # the same model without the fold (the fixture restores it)
    torch._dynamo.reset()
    binding2, runner2, gm2 = rewrite_and_capture(model)
    assert torch.ops.treespec.kv_write.default in _targets(gm2)
    assert torch.equal(fused, _logits(runner2, binding2))


def test_cpu_bindings_keep_the_pair():
    model = tiny_model("llama")
    _, _, gm = rewrite_and_capture(model)
    assert torch.ops.treespec.tree_attention_paged_write.default not in _targets(gm)


def test_generate_through_the_fused_op_equals_hf_greedy(cpu_counts):
    model = tiny_model("llama", layers=2)
    model.generation_config.eos_token_id = None  # no stop token: every row runs the full 20 tokens
    torch._dynamo.reset()
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=0), topk=3, steps=3, num_nodes=8,
                          max_batch_size=2, max_seq_len=96)  # fmt: skip
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    got = spec.generate(ids, max_new_tokens=20, eos_token_id=[])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(got.sequences, want)


@pytest.mark.interpreter  # Triton on the CPU model's tensors; on the GPU, test_speculator_gpu covers the kernel
@pytest.mark.parametrize("tree", [(1, 1, 1), (2, 2, 4)], ids=["plain", "tree"])
def test_batched_decode_through_the_fused_kernel_equals_hf_greedy(cpu_counts, monkeypatch, tree):
    """The fused op's Triton kernel (the interpreter here), not its CPU path, under a batched ragged decode.
    Plain: the speculator hands it a strided column of its slot table, which the kernel once indexed as if
    contiguous (requests 1 and 2 then attended other requests' rows; only the GPU caught it; this case fails
    on that kernel). Tree: the verify's windows with padded rows, and the drafter's lanes, through kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import treecompile.ops.tree_attention as tree_attention

    monkeypatch.setattr(tree_attention, "use_triton", lambda *tensors: True)  # kernels on CPU tensors
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    model = LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, 128, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :6] = 0
    ids = ids * mask
    torch._dynamo.reset()
    topk, steps, nodes = tree
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=topk, steps=steps, num_nodes=nodes,
                          max_batch_size=3, max_seq_len=48)  # fmt: skip
    got = spec.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got.sequences, want)
