"""oneDNN-packed linears on the CPU: the op follows its weights, the pass rewrites every float32 linear (fused
or not) and nothing else, tree logits equal the per-path reference, and generate equals HF greedy."""

from __future__ import annotations

import copy

import pytest
import torch

from treecompile.drafter import EagleDrafter
from treecompile.packed_linear import (
    _PACKED, is_packed, pack_module_linears, packed_linear, packed_weight, packing_available,
)
from treecompile.speculator import TreeSpeculator, packed_linears_default
from treecompile.target import chain_mask

from test_rewrite_attention import FAMILIES, path_to, random_tree, rewrite_and_capture, tiny_model, tree_metadata

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear prepacking")


@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 48), (1, 1, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_linear_and_follows_its_weight(shape, with_bias):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 48, generator=g)
    bias = torch.randn(40, generator=g) if with_bias else None
    x = torch.randn(*shape, generator=g)
    op = packed_linear
    torch.testing.assert_close(op(x, weight, bias), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    packed = packed_weight(weight)
    op(x, weight, bias)
    assert packed_weight(weight) is packed  # same weight: one copy, no re-pack
    with torch.no_grad():
        weight.mul_(-2.0)  # in place: the version counter moves
    torch.testing.assert_close(op(x, weight, bias), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    other = torch.randn(40, 48, generator=g)  # another tensor altogether
    torch.testing.assert_close(op(x, other, bias), torch.nn.functional.linear(x, other, bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        weight.data = torch.randn(40, 48, generator=g)  # new storage under the same tensor
    torch.testing.assert_close(op(x, weight, bias), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    gone = id(other)
    del other
    assert gone not in _PACKED  # the packed copy goes with its weight


def test_packed_linear_runs_plain_linear_for_other_dtypes():
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)
    assert torch.equal(packed_linear(x, weight), torch.nn.functional.linear(x, weight))
    assert id(weight) not in _PACKED


def test_packed_linears_under_autograd_run_plain_linear_and_give_gradients():
    """A packed head trained later (grad mode, parameters requiring grad): gradients equal an unpacked copy's
    (oneDNN's _linear_pointwise has no backward: packed, they would silently be None)."""
    g = torch.Generator().manual_seed(2)
    head = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5, bias=False))
    plain = copy.deepcopy(head)
    assert pack_module_linears(head) == 2
    x = torch.randn(3, 12, generator=g)
    head(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, p), q in zip(head.named_parameters(), plain.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # inference keeps the packed path
        head(x)
    assert id(head[0].weight) in _PACKED


def _capture(model, **binding_kwargs):
    return rewrite_and_capture(model, **binding_kwargs)


def _ops(gm):
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    packed = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is packed_linear]
    return linears, packed


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
def test_pass_packs_every_float32_linear(fuse):
    model = tiny_model("qwen2").float()  # q/k/v with biases
    layers = model.config.num_hidden_layers
    _, _, gm = _capture(model, packed_linears=True, fuse_projections=fuse)
    linears, packed = _ops(gm)
    assert linears == []
    assert len(packed) == (4 if fuse else 7) * layers + 1  # + the LM head


def test_pass_leaves_float64_and_unasked_graphs_alone():
    model = tiny_model("llama")  # float64: oneDNN has no float64 matmul
    _, _, gm = _capture(model, packed_linears=True)
    linears, packed = _ops(gm)
    assert packed == [] and len(linears) == 7 * model.config.num_hidden_layers + 1
    _, _, gm = _capture(tiny_model("llama").float())  # packed_linears off
    assert _ops(gm)[1] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_tree_logits_equal_per_path_reference(family):
    """float32 packed GEMMs against the float64 model run path by path (tolerance: float32 rounding)."""
    reference = tiny_model(family)
    model = copy.deepcopy(reference).float()
    binding, runner, _ = _capture(model, packed_linears=True)
    g = torch.Generator().manual_seed(3)
    B, T, P = 2, 9, 5
    prompt = torch.randint(0, 96, (B, P), generator=g)
    binding.load(torch.zeros(B, dtype=torch.int64), torch.where(torch.arange(9) < P, chain_mask(9), 0).expand(B, 9))
    with torch.no_grad():
        runner(torch.cat([prompt, torch.zeros(B, T - P, dtype=torch.int64)], 1), torch.arange(T).expand(B, T).contiguous())
    trees = [random_tree(T, g) for _ in range(B)]
    meta = [tree_metadata(t) for t in trees]
    tokens = torch.randint(0, 96, (B, T), generator=g)
    binding.load(torch.full((B,), P, dtype=torch.int64), torch.stack([m[1] for m in meta]))
    with torch.no_grad():
        logits, _ = runner(tokens, torch.stack([P + m[0] for m in meta]))
    for b in range(B):
        for i in range(T):
            seq = torch.cat([prompt[b], tokens[b, path_to(trees[b], i)]])[None]
            with torch.no_grad():
                ref = reference(input_ids=seq, use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits[b, i].double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_packed_linears_equals_hf_greedy(family):
    model = tiny_model(family, seed=2, vocab_size=24).float()  # a small vocabulary: drafts get accepted
    model.generation_config.eos_token_id = None
    drafter = EagleDrafter.for_target(model, seed=1).float()
    spec = TreeSpeculator(model, drafter, topk=3, steps=3, num_nodes=8, max_batch_size=2, max_seq_len=64,
                          page_size=8, packed_linears=True)  # fmt: skip
    ids = torch.randint(1, 24, (2, 6), generator=torch.Generator().manual_seed(4))
    got = spec.generate(ids, max_new_tokens=12)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got.sequences, want)
    assert bool((got.accept_lengths > 1).any())  # a draft was accepted: the tree path ran
    # The user's model is untouched (only the compiled graph packs); the drafter, treecompile's, is packed.
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert is_packed(drafter.lm_head)


def test_default_and_refusals():
    assert packed_linears_default(None, torch.device("cpu"), torch.float32) is True
    assert packed_linears_default(None, torch.device("cpu"), torch.float64) is False
    assert packed_linears_default(None, torch.device("cuda"), torch.float32) is False
    assert packed_linears_default(False, torch.device("cpu"), torch.float32) is False
    assert packed_linears_default(None, torch.device("cpu"), torch.float32, inductor=True) is False
    with pytest.raises(ValueError, match=r"packed_linears: packs eager graphs only"):
        packed_linears_default(True, torch.device("cpu"), torch.float32, inductor=True)
    with pytest.raises(ValueError, match=r"packed_linears: only float32 CPU models .*torch.float64 on cpu"):
        packed_linears_default(True, torch.device("cpu"), torch.float64)
    with pytest.raises(ValueError, match=r"packed_linears: only float32 CPU models .*on cuda"):
        packed_linears_default(True, torch.device("cuda"), torch.float32)
    model = tiny_model("llama", layers=1)  # float64
    with pytest.raises(ValueError, match="packed_linears"):
        TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=2, steps=2, num_nodes=3, max_batch_size=1,
                       max_seq_len=32, page_size=8, packed_linears=True)  # fmt: skip


def test_drafter_packing_keeps_values_state_and_follows_dtype():
    model = tiny_model("llama").float()
    drafter = EagleDrafter.for_target(model, seed=1).float()
    keys = list(drafter.state_dict())
    plain = copy.deepcopy(drafter)
    x = torch.randn(2, 3, drafter.lm_head.in_features, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = drafter.logits(x)
        assert pack_module_linears(drafter) == pack_module_linears(drafter)  # idempotent
        torch.testing.assert_close(drafter.logits(x), before, rtol=1e-5, atol=1e-5)
        assert list(drafter.state_dict()) == keys
        drafter.double()  # another dtype: F.linear again, exactly the unpacked head's result
        assert torch.equal(drafter.logits(x.double()), plain.double().logits(x.double()))


def test_packed_drafter_traced_by_torch_compile_runs_plain_linears():
    """A drafter packed by an eager speculator and later compiled (an Inductor speculator on the CPU) traces
    F.linear, not the host-side packed path."""
    model = tiny_model("llama").float()
    drafter = EagleDrafter.for_target(model, seed=1).float()
    pack_module_linears(drafter)
    x = torch.randn(2, 3, drafter.lm_head.in_features, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        eager = drafter.logits(x)
        compiled = torch.compile(drafter.logits, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
