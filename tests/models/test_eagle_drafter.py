"""EagleDrafter: the EAGLE-3 layer over the paged draft cache against a dense reference, lanes against the
per-path chain, the public checkpoint layout (safetensors and .bin), d2t scoring, and clear errors."""

import json

import pytest
import torch

from treecompile.drafter import EagleDrafter, default_aux_layers
from treecompile.target import chain_mask

VOCAB = 64


def tiny_llama(hidden=32, layers=4, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip
    return LlamaForCausalLM(config).double().eval()


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.fixture(scope="module")
def head(target):
    return EagleDrafter.for_target(target, seed=5)


def dense_reference(head, hidden, tokens, positions):
    """The EAGLE-3 midlayer as a plain causal sequence (no cache, no custom ops), float64: [1, T, H]."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    emb = head.embed(tokens)
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    cos, sin = head.rotary_emb(hidden, positions)
    cos, sin = cos[:, None], sin[:, None]
    rot = lambda t: torch.cat([-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    groups = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
    h = hidden + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64}], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_equals_hf_rotary_embedding_bitwise(rope, dtype):
    """The head's elementwise frequencies give HF's cos / sin exactly (HF 5.17 forms them by a K = 1 matmul)."""
    target = tiny_llama()
    if rope is not None:
        target.config.rope_parameters = dict(rope)
    head = EagleDrafter.for_target(target, seed=1).to(dtype)
    assert head.rotary_emb.rope_type == (rope or {"rope_type": "default"})["rope_type"]
    positions = torch.tensor([[0, 1, 7, 63, 64, 200, 4095, 70000]])
    x = torch.zeros(1, 8, 4, dtype=dtype)
    cos, sin = head.rope(x, positions)
    ref_cos, ref_sin = head.rotary_emb(x, positions)
    assert cos.dtype == dtype and cos.shape == ref_cos.shape == (1, 8, head.midlayer.self_attn.head_dim)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_chain_forward_equals_dense_reference(head):
    """Two chunks through the paged draft cache (prefix then window) equal one dense causal pass."""
    T = 10
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, T, head.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (1, T), generator=g)
    positions = torch.arange(T)[None]
    cache = head.new_cache(1, 32, page_size=4)
    outs = []
    with torch.no_grad():
        for start, stop in ((0, 6), (6, T)):
            rows = stop - start
            outs.append(head.forward_rows(
                cache, hidden[:, start:stop], tokens[:, start:stop], positions[:, start:stop],
                cache.slots(positions[:, start:stop]), torch.tensor([start]), chain_mask(rows)[None], rows,
            ))  # fmt: skip
        ref = dense_reference(head, hidden, tokens, positions)
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-10, atol=1e-10)


def test_lanes_equal_the_per_path_chain(head):
    """K=2 lanes over 2 steps (lane window 4): each lane row equals its root-to-lane path run as a chain."""
    P, K, steps = 5, 2, 2
    g = torch.Generator().manual_seed(1)
    H = head.hidden_size
    prefix_h = torch.randn(1, P, H, generator=g, dtype=torch.float64)
    prefix_t = torch.randint(0, VOCAB, (1, P), generator=g)
    lane_h = torch.randn(1, steps * K, H, generator=g, dtype=torch.float64)
    lane_t = torch.randint(0, VOCAB, (1, steps * K), generator=g)
    parent = {0: None, 1: None, 2: 1, 3: 0}  # step-2 lanes: lane 0 under step-1 lane 1, lane 1 under lane 0
    masks = []
    for slot in range(steps * K):
        bits, j = 0, slot
        while j is not None:
            bits |= 1 << j
            j = parent[j]
        masks.append(bits)
    cache = head.new_cache(1, 32, page_size=4)
    with torch.no_grad():
        head.forward_rows(cache, prefix_h, prefix_t, torch.arange(P)[None], cache.slots(torch.arange(P)[None]),
                          torch.tensor([0]), chain_mask(P)[None], P)  # fmt: skip
        lane_out = []
        for s in range(steps):
            cols = slice(s * K, (s + 1) * K)
            lane_out.append(head.forward_rows(
                cache, lane_h[:, cols], lane_t[:, cols], torch.full((1, K), P + s),
                cache.slots(P + torch.arange(s * K, (s + 1) * K)[None]), torch.tensor([P]),
                torch.tensor([masks[s * K : (s + 1) * K]]), steps * K,
            ))  # fmt: skip
        lane_out = torch.cat(lane_out, 1)
        for slot in range(steps * K):
            path, j = [], slot
            while j is not None:
                path.append(j)
                j = parent[j]
            path = path[::-1]
            ref = dense_reference(
                head, torch.cat([prefix_h, lane_h[:, path]], 1), torch.cat([prefix_t, lane_t[:, path]], 1),
                torch.arange(P + len(path))[None],
            )  # fmt: skip
            torch.testing.assert_close(lane_out[0, slot], ref[0, -1], rtol=1e-10, atol=1e-10)


def _save(head, path, fmt="safetensors", drop=None, config_extra=None):
    path.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config.update(config_extra or {})
    (path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary_emb")}
    if drop:
        state.pop(drop)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    return sorted(state)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_from_pretrained_loads_the_public_layout(tmp_path, target, head, fmt):
    names = _save(head, tmp_path / fmt, fmt)
    assert {n.split(".")[0] for n in names} == {"fc", "midlayer", "norm", "lm_head", "d2t", "t2d"}
    loaded = EagleDrafter.from_pretrained(tmp_path / fmt, target)
    assert loaded.aux_layers == head.aux_layers == default_aux_layers(4)
    x = torch.randn(2, 3, head.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded.logits(x), head.logits(x))
    torch.testing.assert_close(loaded.project(torch.ones(1, 3 * 32, dtype=torch.float64)),
                               head.project(torch.ones(1, 3 * 32, dtype=torch.float64)))  # fmt: skip


def test_from_pretrained_refuses_a_head_for_another_hidden_size(tmp_path):
    other = tiny_llama(hidden=48)
    _save(EagleDrafter.for_target(other), tmp_path / "h48")
    with pytest.raises(ValueError, match="hidden size"):
        EagleDrafter.from_pretrained(tmp_path / "h48", tiny_llama(hidden=32))


def test_from_pretrained_reports_missing_weights(tmp_path, target, head):
    _save(head, tmp_path / "partial", drop="midlayer.hidden_norm.weight")
    with pytest.raises(ValueError, match="missing weights .*midlayer.hidden_norm.weight"):
        EagleDrafter.from_pretrained(tmp_path / "partial", target)
    with pytest.raises(ValueError, match="no config.json"):
        EagleDrafter.from_pretrained(tmp_path / "nowhere", target)


def test_score_candidates_maps_draft_ids_through_d2t(target):
    """target_id = draft_id + d2t[draft_id]; log-probs are over the draft vocabulary."""
    head = EagleDrafter.for_target(target, draft_vocab_size=16)
    head.d2t.copy_(torch.arange(16) * 2)  # draft id i -> target id 3i
    logits = torch.full((2, 16), -5.0, dtype=torch.float64)
    logits[0, 3], logits[0, 7] = 4.0, 3.0
    logits[1, 15] = 9.0
    logp, tokens = head.score_candidates(logits, 2)
    assert tokens[0].tolist() == [9, 21] and tokens[1, 0].item() == 45
    torch.testing.assert_close(logp.exp().sum(-1) <= 1, torch.tensor([True, True]))
    torch.testing.assert_close(logp[0, 0], torch.log_softmax(logits[0], -1)[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_score_candidates_on_cuda_take_the_fused_top_k(target, dtype):
    """On CUDA scoring runs treespec::draft_topk: the top-4 of log_softmax (ties to the lower id) and the
    log-probs to float32 rounding, for step 0 [B, Vd] and lanes [B, K, Vd]."""
    head = EagleDrafter.for_target(target).cuda()  # the kernel's multi-slice cases: tests/ops/test_draft_topk.py
    vd = head.d2t.shape[0]
    head.d2t.copy_(torch.arange(vd, device="cuda") % 7)
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((3, vd), (3, 4, vd)):
        logits = torch.randn(shape, generator=g, device="cuda").to(dtype)
        logp, tokens = head.score_candidates(logits, 4)
        # bf16 has ties: the op orders them by lower index, i.e. a stable descending sort
        want = torch.sort(-logits.double(), dim=-1, stable=True).indices[..., :4]
        assert tokens.shape == (*shape[:-1], 4) and logp.dtype == torch.float32
        assert torch.equal(tokens, want + head.d2t[want])
        torch.testing.assert_close(logp.double(), torch.log_softmax(logits.double(), -1).gather(-1, want),
                                   rtol=0, atol=1e-5)  # fmt: skip


def test_fused_projections_give_the_same_draft_steps(target):
    """EagleDrafter.fuse_projections: q/k/v and gate/up as one GEMM each over storage the parameters view;
    step 0 and a lane step give the unfused outputs (float64), the state dict is unchanged, and .to()
    drops the fused path (new storage) instead of reading stale weights."""
    head = EagleDrafter.for_target(target, seed=3).to(torch.float64)
    B, T, H = 2, 3, target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(B, T, len(head.aux_layers) * H, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, head.d2t.shape[0], (B, T), generator=g)
    positions = torch.arange(T).expand(B, T)
    zero = torch.zeros(B, dtype=torch.int64)

    def steps():
        cache = head.new_cache(B, 16, page_size=8)
        slots = cache.slots(positions)
        hidden, logits = head.draft_step0(cache, feats, tokens, positions, slots, zero, chain_mask(T).expand(B, T),
                                          torch.full((B,), T - 1), None)  # fmt: skip
        lane, lane_logits = head.draft_lanes(cache, hidden[:, None].expand(B, 2, H).contiguous(), tokens[:, :2],
                                             (positions[:, :2] + T), cache.slots(positions[:, :2] + T), zero + T,
                                             torch.tensor([1, 2]).expand(B, 2), 2, None)  # fmt: skip
        return hidden, logits, lane, lane_logits

    before_state = {k: v.clone() for k, v in head.state_dict().items()}
    want = steps()
    head.fuse_projections()
    attn = head.midlayer.self_attn
    assert attn.qkv_weight is not None and head.midlayer.mlp.gate_up_weight is not None
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert all(torch.equal(head.state_dict()[k], v) for k, v in before_state.items())
    for got, ref in zip(steps(), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    head.to(torch.float32)
    assert attn.qkv_weight is None and head.midlayer.mlp.gate_up_weight is None


def test_default_aux_layers_follow_eagle3_and_clamp_for_tiny_targets():
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(2) == (1, 1, 1)
    assert default_aux_layers(4) == (2, 2, 1)


def test_for_target_sizes_a_head_for_a_model_without_attention():
    """Pure Mamba2 configs have no attention heads or MLP width: the head picks 64-channel heads."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                          head_dim=16, num_heads=8, n_groups=1, conv_kernel=4, chunk_size=8)  # fmt: skip
    drafter = EagleDrafter.for_target(Mamba2ForCausalLM(config), seed=0)
    assert drafter.config.num_attention_heads == 1 and drafter.config.head_dim == 64
    assert drafter.config.intermediate_size == 256


def test_lane_step_gathers_its_parents_inside(target):
    """``draft_lanes(..., parent_lane)``: handed the previous step's rows ``[B, K', H]`` and each lane's parent
    row, the step equals the same step on the rows gathered beforehand (float64, distinct parents per lane:
    a wrong or reordered gather changes the outputs)."""
    head = EagleDrafter.for_target(target, seed=3).to(torch.float64)
    assert head.gathers_parents
    B, Kp, K, H = 2, 3, 4, target.config.hidden_size
    g = torch.Generator().manual_seed(1)
    prev = torch.randn(B, Kp, H, generator=g, dtype=torch.float64)
    parent_lane = torch.tensor([[2, 0, 1, 2], [1, 1, 0, 2]])
    tokens = torch.randint(0, head.d2t.shape[0], (B, K), generator=g)
    positions = torch.full((B, K), 5)
    mask = (1 << torch.arange(K)).expand(B, K)
    prefix = torch.full((B,), 5, dtype=torch.int64)
    outs = []
    for inside in (False, True):
        cache = head.new_cache(B, 32, page_size=8)
        slots = cache.slots(5 + torch.arange(K).expand(B, K))
        if inside:
            args = (cache, prev, tokens, positions, slots, prefix, mask, K, None, parent_lane)
        else:
            parents = prev.gather(1, parent_lane[:, :, None].expand(B, K, H))
            args = (cache, parents, tokens, positions, slots, prefix, mask, K, None)
        outs.append(head.draft_lanes(*args))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    flipped = head.draft_lanes(head.new_cache(B, 32, page_size=8), prev, tokens, positions, slots, prefix, mask, K,
                               None, parent_lane.flip(-1))[0]  # fmt: skip
    assert not torch.allclose(flipped, outs[0][0])
