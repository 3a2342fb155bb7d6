"""Capability resolution: each backend declares verify / lane support; one error lists every blocker."""

import re

import pytest
import torch

from treecompile.drafter import EagleDrafter
from treecompile.registry import (
    GreedySampler,
    PagedTreeAttentionBackend,
    attention_layers,
    resolve_tree_support,
)


def tiny(family="llama", layers=2, **overrides):
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    )  # fmt: skip

    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}  # fmt: skip
    config_cls, model_cls = kinds[family]
    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs)).eval()


def blockers(excinfo) -> list[str]:
    return [line[4:] for line in str(excinfo.value).splitlines() if line.startswith("  - ")]


def test_supported_model_and_drafter_resolve():
    model = tiny()
    resolved = resolve_tree_support(model, EagleDrafter.for_target(model), max_seq_len=64)
    assert [layer.name for layer in resolved.target_layers] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert resolved.draft_layers and isinstance(resolved.sampler, GreedySampler)
    layer = resolved.target_layers[0]
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.family) == (4, 2, 8, "llama")


def test_each_backend_declares_verify_and_lanes():
    model = tiny()
    layer = attention_layers(model)[0][0]
    support = PagedTreeAttentionBackend().tree_support(layer, max_seq_len=64)
    assert support.verify.ok and not support.lanes.ok
    (name, draft), = EagleDrafter.for_target(model).tree_layers()
    assert draft.lanes.ok and not draft.verify.ok
    assert GreedySampler().tree_support(do_sample=False).verify.ok


@pytest.mark.parametrize("window,max_seq_len,blocked", [(8, 64, True), (64, 64, False), (4096, 64, False)],
                         ids=["W8-cap64", "W64-cap64", "W4096-cap64"])  # fmt: skip
def test_sliding_window_in_a_target_layer(window, max_seq_len, blocked):
    """A window that covers every key the cache can hold never clips anything."""
    model = tiny("mistral", sliding_window=window)
    if not blocked:
        resolve_tree_support(model, max_seq_len=max_seq_len)
        return
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(model, max_seq_len=max_seq_len)
    found = blockers(excinfo)
    assert len(found) == 2  # both layers, each named
    assert found[0].startswith("target layer 0 (model.layers.0.self_attn, MistralAttention): sliding window 8")


def test_sliding_window_only_in_the_layers_that_use_it():
    model = tiny("qwen2", layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(model, max_seq_len=64)
    found = blockers(excinfo)
    assert [re.match(r"target layer (\d)", b).group(1) for b in found] == ["2", "3"]


def test_attention_sinks_are_refused():
    model = tiny()
    model.model.layers[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(model, max_seq_len=64)
    assert blockers(excinfo) == ["target layer 1 (model.layers.1.self_attn, LlamaAttention): attention sinks in a target layer"]


def test_unrecognised_attention_class_is_refused_never_passed_through():
    """A layer whose attention class the registry does not know is refused, never run untouched: here a
    Llama whose second layer carries a user-defined attention module and whose first carries a subclass
    of a supported class from outside transformers (a patched class may compute something else)."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    class FancyAttention(torch.nn.Module):
        def forward(self, hidden_states, **kwargs):
            return hidden_states, None

    class PatchedLlamaAttention(LlamaAttention):
        pass

    model = tiny()
    first = model.model.layers[0].self_attn
    patched = PatchedLlamaAttention(model.config, layer_idx=0)
    patched.load_state_dict(first.state_dict())
    model.model.layers[0].self_attn = patched
    model.model.layers[1].self_attn = FancyAttention()
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(model, max_seq_len=64)
    found = blockers(excinfo)
    assert len(found) == 2, found
    assert any("FancyAttention): unrecognised attention class" in b for b in found)
    assert any("PatchedLlamaAttention): unrecognised attention class" in b for b in found)


def test_greedy_only_sampler_asked_to_sample():
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(tiny(), do_sample=True, max_seq_len=64)
    assert blockers(excinfo) == ["sampler greedy: greedy-only, asked to sample (supports_tree_verify False for do_sample=True)"]


def test_eager_attention_implementation_is_refused():
    with pytest.raises(ValueError, match="attention implementation 'eager'"):
        resolve_tree_support(tiny(attn_implementation="eager"), max_seq_len=64)


def test_cuda_kernel_limits_are_declared_without_a_gpu():
    """The declaration reads metadata only: head_dim 8 and float64 have no CUDA kernel."""
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(tiny(layers=1), max_seq_len=64, device="cuda", dtype=torch.float64)
    (only,) = blockers(excinfo)
    assert "head_dim 8 has no CUDA kernel" in only and "dtype torch.float64 has no CUDA kernel" in only


def test_draft_layer_with_sliding_window_is_refused():
    model = tiny()
    drafter = EagleDrafter.for_target(model)
    drafter.midlayer.self_attn.sliding_window = 16
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(model, drafter, max_seq_len=64)
    assert blockers(excinfo) == [
        "draft layer 0 (midlayer.self_attn, EagleAttention): sliding window 16 in a draft layer "
        "(frozen-window lanes are not implemented)"
    ]


def test_every_blocker_is_listed_in_one_error():
    model = tiny("mistral", layers=2, sliding_window=8)
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    drafter = EagleDrafter.for_target(model)
    drafter.midlayer.self_attn.sliding_window = 4
    with pytest.raises(ValueError) as excinfo:
        resolve_tree_support(model, drafter, do_sample=True, max_seq_len=64)
    message = str(excinfo.value)
    assert message.startswith("tree speculation is not supported here (4 blockers):")
    found = blockers(excinfo)
    assert "sliding window 8" in found[0] and "attention sinks" in found[0]  # one line per layer
    assert found[1].startswith("target layer 1") and found[2].startswith("draft layer 0")
    assert found[3].startswith("sampler greedy")


def test_speculator_startup_reports_blockers_before_any_work():
    from treecompile.speculator import TreeSpeculator

    model = tiny("mistral", sliding_window=8).double()
    with pytest.raises(ValueError, match=r"\(3 blockers\)"):
        TreeSpeculator(model, EagleDrafter.for_target(model), topk=2, steps=2, num_nodes=4, max_seq_len=64,
                       do_sample=True)  # fmt: skip
