"""Lossless greedy speculation on hybrid and SSM models: ``TreeSpeculator.generate`` equals HF
``generate(do_sample=False)`` token for token on tiny random float64 Qwen3-Next, Qwen3.5 (gated delta net
+ gated attention), Mamba2, and Bamba (Mamba2 + attention), with ragged left-padded batches.

The drafters are the ones ``test_lossless`` uses: a random EAGLE-3 head (mostly root-only accepts), and the
oracle that scores with the target itself plus noise, so accepted paths run through second and third
children and the recurrent state commits deep, branching paths. HF runs the delta rule and the SSM scan
in float32 inside the float64 model while treecompile keeps float64 states, so logits agree to ~1e-7,
far inside the margins greedy argmax needs here.
"""

import pytest
import torch
from test_lossless import VOCAB, OracleDrafter, assert_same, hf_greedy, ragged_batch

from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def tiny_model(family: str, seed: int = 0):
    """Tiny float64 models; Qwen3-Next runs dense MLPs (grouped_mm, its MoE kernel, has no float64)."""
    import transformers as tf

    torch.manual_seed(seed)
    gdn = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
               max_position_embeddings=512)  # fmt: skip
    if family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            **gdn, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
            num_experts_per_tok=1, mlp_only_layers=[0, 1, 2, 3]))  # fmt: skip
    elif family == "qwen3_5":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**gdn))
    elif family == "mamba2":
        config = tf.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, state_size=8, expand=2,
                                 head_dim=8, num_heads=8, n_groups=2, conv_kernel=4, chunk_size=4)  # fmt: skip
        # EagleDrafter.for_target sizes its head from these attention fields, which an SSM config lacks.
        config.num_attention_heads, config.intermediate_size = 4, 64
        model = tf.Mamba2ForCausalLM(config)
    elif family == "bamba":
        model = tf.BambaForCausalLM(tf.BambaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4,
            max_position_embeddings=512))  # fmt: skip
    else:
        raise KeyError(family)
    model = model.to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    return model


FAMILIES = ("qwen3_next", "qwen3_5", "mamba2", "bamba")


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_drafter_matches_hf_greedy(family, fuse):
    """K=3, S=4, N=10 with a random EAGLE-3 head; two ragged batches of 3 prompts through one speculator
    (the second batch must see nothing of the first's recurrent state), 12 new tokens each. Also with fused
    projections, the default on CUDA: hybrids' attention and MLP layers fuse, their linear layers do not."""
    model = tiny_model(family)
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=3, steps=4, num_nodes=10,
                          max_batch_size=3, max_seq_len=64, page_size=8, fuse_projections=fuse)  # fmt: skip
    assert bool(spec.binding.projection_groups) == (fuse and family != "mamba2")
    assert spec.binding.linear_layers
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        ids, mask = ragged_batch(g, 3)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
        assert_same(out, hf_greedy(model, ids, mask, 12), 12)


# (family, topk, steps, num_nodes, replay_ssm): the chain (topk=1), wide and deep trees, the staged path;
# "chunked": GDN runs the chunked tree form (8..16 nodes), Mamba2 the chunked form (any size).
SHAPES = [
    ("qwen3_next", 2, 4, 8, "chunked"),
    ("qwen3_5", 3, 4, 12, "chunked"),
    ("qwen3_next", 2, 3, 6, False),
    ("qwen3_5", 1, 4, 5, True),
    ("qwen3_5", 3, 2, 6, False),
    ("mamba2", 3, 4, 12, True),
    ("mamba2", 2, 3, 6, False),
    ("mamba2", 4, 4, 16, "chunked"),
    ("bamba", 4, 5, 16, "chunked"),
]


@pytest.mark.parametrize(
    "family,topk,steps,num_nodes,replay", SHAPES,
    ids=[f"{f}-K{k}-S{s}-N{n}{'-chunked' if r == 'chunked' else '' if r else '-staged'}" for f, k, s, n, r in SHAPES],
)  # fmt: skip
def test_oracle_drafter_accepts_deep_paths_and_stays_lossless(family, topk, steps, num_nodes, replay):
    model = tiny_model(family, seed=3)
    drafter = OracleDrafter.build(model, noise=0.0 if topk == 1 else 0.6, seed=2)
    spec = TreeSpeculator(model, drafter, topk=topk, steps=steps, num_nodes=num_nodes, max_batch_size=2,
                          max_seq_len=96, page_size=8, replay_ssm=bool(replay), gdn_chunked=replay == "chunked",
                          mamba2_chunked=replay == "chunked")  # fmt: skip
    g = torch.Generator().manual_seed(11)
    accepted = []
    for _ in range(2):
        ids, mask = ragged_batch(g, 2)
        out = spec.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
        assert_same(out, hf_greedy(model, ids, mask, 16), 16)
        accepted.append(out.accept_lengths[out.accept_lengths > 0])  # rounds a request still ran
    accepted = torch.cat(accepted)
    assert accepted.float().mean() > 1.5  # the oracle really speculates
    assert int(accepted.max()) >= 3  # some round accepted at least two drafted tokens plus the bonus
    if topk == 1:
        assert spec.tree is None  # the chain path: no DraftTree, no tree state
    if not replay:
        assert spec.binding.scratch and not spec.binding.payload
        assert not spec.binding.gdn_workspace  # the staged path keeps every node's state in the scratch


# ---------------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU; the lead runs these): kernel-sized hybrid models, captured rounds
# ---------------------------------------------------------------------------------------------------------


def gpu_model(family: str, dtype: torch.dtype, device="cuda"):
    """Hybrid models with head dims the CUDA kernels take (attention 64; GDN 64 x 64; Mamba2 64 x 32)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=2, num_experts_per_tok=1,
            mlp_only_layers=[0, 1, 2, 3], max_position_embeddings=512))  # fmt: skip
    else:
        config = tf.Mamba2Config(vocab_size=128, hidden_size=256, num_hidden_layers=3, state_size=32, expand=2,
                                 head_dim=64, num_heads=8, n_groups=2, conv_kernel=4, chunk_size=16)  # fmt: skip
        config.num_attention_heads, config.intermediate_size = 4, 512  # the EAGLE head's size (see tiny_model)
        model = tf.Mamba2ForCausalLM(config)
    model = model.to(device, dtype).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_gpu_captured_rounds_equal_eager_and_agree_with_hf(family, device="cuda"):
    """float32 on CUDA: captured rounds give the eager rounds' tokens and accept lengths exactly; tokens
    agree with HF greedy (>= 0.9: HF's chunked float32 prefill and our recurrent kernels round differently)."""
    model = gpu_model(family, torch.float32, device)
    drafter = EagleDrafter.for_target(model, seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    ids, mask = (ids * mask).to(device), mask.to(device)
    kwargs = dict(topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256, inductor=False)
    graphs = TreeSpeculator(model, drafter, cuda_graphs=device == "cuda", **kwargs)
    graphs = graphs.generate(ids, mask, max_new_tokens=32)
    eager = TreeSpeculator(model, drafter, cuda_graphs=False, **kwargs).generate(ids, mask, max_new_tokens=32)
    assert torch.equal(graphs.sequences, eager.sequences)
    assert torch.equal(graphs.accept_lengths, eager.accept_lengths)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    agreement = (graphs.sequences[:, ids.shape[1]:] == hf[:, ids.shape[1]:]).float().mean().item()
    print(f"{family}: token agreement with HF greedy {agreement:.3f}")
    assert agreement >= 0.9


@pytest.mark.gpu
def test_gpu_hybrid_round_makes_no_host_sync(device="cuda"):
    """After the warm-up round, draft + verify + commit (linear-state replay included) never sync."""
    model = gpu_model("qwen3_next", torch.bfloat16, device)
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=4, steps=5, num_nodes=32,
                          max_batch_size=2, max_seq_len=256, cuda_graphs=False, inductor=False)  # fmt: skip
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    _, lengths, prompts = spec._prompts(ids, None)
    st = spec._new_state(len(lengths), lengths, prompts, [7], 64)
    spec._prefill(st, max(lengths))
    spec._round(st)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        spec._draft_round(st)
        spec._verify_round(st)
        spec._commit(st)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
