"""prefetch_weights (opt-in, TREECOMPILE_WEIGHT_PREFETCH=1): each fused attention call gets the weight of the
projection that reads it as its ``prefetch`` (an L2 hint on CUDA). The pass runs on CUDA bindings only; here
CPU counts too (as for fuse_cache_write), so the rewrite itself is checked: which weight each layer hints,
that the logits do not change, and that a speculative generate through it still equals HF greedy in float64.
The kernel side (hints in the PTX before the dependency wait): tests/ops/test_sm90_compile.py; the op's
bad input: tests/ops/test_tree_attention_write.py."""

import importlib

import pytest
import torch

from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator

from test_rewrite_attention import rewrite_and_capture, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

fuse_module = importlib.import_module("treecompile.passes.fuse_cache_write")
prefetch_module = importlib.import_module("treecompile.passes.prefetch_weights")

WRITE = torch.ops.treespec.tree_attention_paged_write.default


@pytest.fixture
def cpu_counts(monkeypatch):
    monkeypatch.setattr(fuse_module, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(prefetch_module, "_DEVICE_TYPES", ("cuda", "cpu"))


def _logits(runner):
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        return runner(ids, torch.arange(9).expand(2, 9).contiguous())[0]


def _hinted(gm):
    """Per fused attention call, the tensor its prefetch names (None where it has none)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is WRITE:
            weight = node.kwargs.get("prefetch")
            if weight is None:
                out.append(None)
            elif weight.op == "get_attr":
                out.append(getattr(gm, weight.target))
            else:
                out.append(weight.meta.get("example_value"))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_attention_hints_its_o_projection_and_logits_do_not_change(family, cpu_counts, monkeypatch):
    model = tiny_model(family)
    torch._dynamo.reset()
    monkeypatch.setenv(prefetch_module.ENV, "0")
    _, runner_off, gm_off = rewrite_and_capture(model)
    assert _hinted(gm_off) == [None] * model.config.num_hidden_layers
    plain = _logits(runner_off)

    torch._dynamo.reset()
    monkeypatch.setenv(prefetch_module.ENV, "1")
    _, runner, gm = rewrite_and_capture(model)
    hinted = _hinted(gm)
    assert len(hinted) == model.config.num_hidden_layers
    for layer, weight in zip(model.model.layers, hinted):
        o = layer.self_attn.o_proj.weight
        # the layer's own o projection: its shape, and (a placeholder's fake) or the very parameter
        assert weight is not None and tuple(weight.shape) == tuple(o.shape)
    shapes = {tuple(w.shape) for w in hinted}
    assert shapes == {tuple(model.model.layers[0].self_attn.o_proj.weight.shape)}
    assert torch.equal(plain, _logits(runner))


def test_off_by_default_and_bad_switch_values_are_refused(cpu_counts, monkeypatch):
    monkeypatch.delenv(prefetch_module.ENV, raising=False)
    assert prefetch_module.enabled() is False
    monkeypatch.setenv(prefetch_module.ENV, "yes")
    with pytest.raises(ValueError, match="TREECOMPILE_WEIGHT_PREFETCH: expected 0, 1 or end"):
        prefetch_module.enabled()


def test_cpu_bindings_are_left_alone(monkeypatch):
    monkeypatch.setattr(fuse_module, "_DEVICE_TYPES", ("cuda", "cpu"))  # fused calls exist, but the pass is CUDA-only
    monkeypatch.setenv(prefetch_module.ENV, "1")
    torch._dynamo.reset()
    _, _, gm = rewrite_and_capture(tiny_model("llama"))
    hinted = _hinted(gm)
    assert hinted and all(w is None for w in hinted)


def test_generate_with_hints_equals_hf_greedy(cpu_counts, monkeypatch):
    """Target layers and the drafter's steps both hint (the drafter reads the switch when built); the
    hints reach the op's boundary checks on every call, and the text is HF greedy's."""
    monkeypatch.setenv(prefetch_module.ENV, "1")
    model = tiny_model("llama", layers=2)
    model.generation_config.eos_token_id = None
    torch._dynamo.reset()
    drafter = EagleDrafter.for_target(model, seed=0)
    assert drafter.midlayer.self_attn.prefetch_o is True
    monkeypatch.setenv(prefetch_module.ENV, "0")
    assert EagleDrafter.for_target(model, seed=0).midlayer.self_attn.prefetch_o is False
    monkeypatch.setenv(prefetch_module.ENV, "1")
    from treecompile.kv_cache import PagedKVCache

    hinted = []
    real = PagedKVCache.attention

    def spy(self, *args, **kwargs):  # the drafter's steps attend through the cache's own op
        hinted.append(kwargs.get("prefetch") is drafter.midlayer.self_attn.o_proj.weight)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PagedKVCache, "attention", spy)
    spec = TreeSpeculator(model, drafter, topk=3, steps=3, num_nodes=8,
                          max_batch_size=2, max_seq_len=96)  # fmt: skip
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    got = spec.generate(ids, max_new_tokens=20, eos_token_id=[])
    assert hinted and all(hinted)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(got.sequences, want)
