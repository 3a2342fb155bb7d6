"""CUDA: captured rounds replay exactly, and speculative decoding agrees with HF greedy and with
treecompile's own non-speculative decode (a one-node tree). Skipped without a GPU; the lead runs these."""

import pytest
import torch

from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator

pytestmark = pytest.mark.gpu


def tiny_llama(dtype=torch.float32, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)  # fmt: skip
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def ragged(batch=3, width=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    return (ids * mask).cuda(), mask.cuda()


def test_verify_round_capture_replays_identically():
    """Capture the draft and verify (+ commit) rounds after the eager warm-up round: replaying both graphs
    from the same committed state reproduces the eager round (draft, verify, commit) bit for bit, every
    time (a round is a function of the committed state)."""
    model = tiny_llama()
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=4, steps=4, num_nodes=16,
                          max_batch_size=3, max_seq_len=128, cuda_graphs=True)  # fmt: skip
    ids, mask = ragged()
    _, lengths, prompts = spec._prompts(ids, mask)
    st = spec._new_state(len(lengths), lengths, prompts, [], 16)
    spec._prefill(st, max(lengths))
    tensors = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
    before = {k: v.clone() for k, v in tensors.items()}
    spec._draft_round(st)
    spec._verify_round(st)
    spec._commit(st)
    eager = {k: v.clone() for k, v in tensors.items()}
    assert not torch.equal(eager["vc"], before["vc"])  # the round committed something
    spec._capture(st)
    draft_graph, verify_graph = spec._graphs[st["B"]]
    for _ in range(2):
        for k, v in tensors.items():
            v.copy_(before[k])
        draft_graph.replay()
        verify_graph.replay()
        torch.cuda.synchronize()
        for name, value in eager.items():
            assert torch.equal(tensors[name], value), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graphs_equal_eager_rounds_and_report_agreement(dtype):
    model = tiny_llama(dtype)
    drafter = EagleDrafter.for_target(model, seed=1)
    ids, mask = ragged()
    kwargs = dict(topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256)
    graphs = TreeSpeculator(model, drafter, cuda_graphs=True, **kwargs).generate(ids, mask, max_new_tokens=48)
    eager = TreeSpeculator(model, drafter, cuda_graphs=False, **kwargs).generate(ids, mask, max_new_tokens=48)
    assert torch.equal(graphs.sequences, eager.sequences)
    assert torch.equal(graphs.accept_lengths, eager.accept_lengths)
    plain = TreeSpeculator(model, drafter, topk=1, steps=1, num_nodes=1, max_batch_size=3, max_seq_len=256)
    plain_out = plain.generate(ids, mask, max_new_tokens=48)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
    new = slice(ids.shape[1], None)
    vs_hf = (graphs.sequences[:, new] == hf[:, new]).float().mean().item()
    vs_plain = (graphs.sequences[:, new] == plain_out.sequences[:, new]).float().mean().item()
    print(f"{dtype}: token agreement with HF greedy {vs_hf:.3f}, with treecompile's plain decode {vs_plain:.3f}")
    if dtype == torch.float32:
        assert vs_hf >= 0.9 and vs_plain >= 0.9


def test_captured_commit_follows_each_request():
    """The commit is captured with the verify round: later requests on the same graphs, with another
    max_new_tokens, other EOS ids and other prompts, still equal eager rounds (their limits are read from
    bound buffers, not baked into the capture)."""
    model = tiny_llama()
    drafter = EagleDrafter.for_target(model, seed=1)
    kwargs = dict(topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256)
    graphs = TreeSpeculator(model, drafter, cuda_graphs=True, **kwargs)
    eager = TreeSpeculator(model, drafter, cuda_graphs=False, **kwargs)
    ids, mask = ragged()
    first = eager.generate(ids, mask, max_new_tokens=40, eos_token_id=[])
    new = first.sequences[:, ids.shape[1]:]
    # EOS ids the first request emits mid-way, so the later requests stop at different rounds.
    stops = [int(new[0, 9]), int(new[2, 17])]
    requests = [(ids, mask, 40, []), (ids, mask, 23, stops), ragged(seed=1) + (31, [int(new[1, 5])]), (ids, mask, 40, [])]
    for r_ids, r_mask, n, eos in requests:
        got = graphs.generate(r_ids, r_mask, max_new_tokens=n, eos_token_id=eos)
        ref = eager.generate(r_ids, r_mask, max_new_tokens=n, eos_token_id=eos)
        assert torch.equal(got.sequences, ref.sequences), (n, eos)
        assert torch.equal(got.accept_lengths, ref.accept_lengths), (n, eos)
    assert list(graphs._graphs) == [3]  # captured once, for B = 3; every request above replayed it


@pytest.mark.parametrize("max_new_tokens", [1, 3, 9, 40])
def test_lookahead_rounds_equal_synced_rounds(max_new_tokens):
    """Rounds launched one ahead of the stop-flag read emit exactly what rounds read after each emit: same
    sequences, same per-round accept lengths (the round launched after the last stop is dropped), for
    requests that stop in the capturing round, right after it, or many rounds later at different rounds."""
    model = tiny_llama()
    drafter = EagleDrafter.for_target(model, seed=1)
    kwargs = dict(topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256)
    ahead = TreeSpeculator(model, drafter, lookahead=True, **kwargs)
    synced = TreeSpeculator(model, drafter, lookahead=False, **kwargs)
    ids, mask = ragged()
    new = synced.generate(ids, mask, max_new_tokens=40, eos_token_id=[]).sequences[:, ids.shape[1]:]
    stops = [int(new[0, min(max_new_tokens, 40) // 2]), int(new[2, min(max_new_tokens, 40) - 1])]
    for eos in ([], stops):
        for _ in range(2):  # the second request replays graphs captured by the first
            got = ahead.generate(ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos)
            ref = synced.generate(ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos)
            assert torch.equal(got.sequences, ref.sequences)
            assert torch.equal(got.accept_lengths, ref.accept_lengths)
        if not eos:  # no stop id: every request emits exactly max_new_tokens
            assert got.accept_lengths.sum(0).tolist() == [max_new_tokens - 1] * 3  # the first comes from prefill


def test_fused_projections_on_cuda_agree_with_hf_greedy():
    """fuse_projections=True under Inductor and CUDA graphs: one linear per q/k/v and gate/up group, float32
    output agreeing with HF greedy as the unfused path does (GEMM shapes differ, so roundings may)."""
    model = tiny_llama()
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=4, steps=5, num_nodes=32,
                          max_batch_size=3, max_seq_len=256, fuse_projections=True)  # fmt: skip
    assert len(spec.binding.projection_groups) == 2 * model.config.num_hidden_layers
    ids, mask = ragged()
    got = spec.generate(ids, mask, max_new_tokens=48)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
    new = slice(ids.shape[1], None)
    assert (got.sequences[:, new] == hf[:, new]).float().mean().item() >= 0.9


def test_a_round_makes_no_host_sync():
    """After the warm-up round (compilation, pointer tables), draft + verify + commit never sync."""
    model = tiny_llama(torch.bfloat16)
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=4, steps=5, num_nodes=32,
                          max_batch_size=3, max_seq_len=256, cuda_graphs=False)  # fmt: skip
    ids, mask = ragged()
    _, lengths, prompts = spec._prompts(ids, mask)
    st = spec._new_state(len(lengths), lengths, prompts, [7], 64)
    spec._prefill(st, max(lengths))
    spec._round(st)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        spec._draft_round(st)
        spec._verify_round(st)
        spec._commit(st)
    finally:
        torch.cuda.set_sync_debug_mode("default")
