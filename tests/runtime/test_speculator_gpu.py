"""CUDA: captured rounds replay exactly, and speculative decoding agrees with HF greedy and with
treecompile's own non-speculative decode (a one-node tree). Skipped without a GPU; the lead runs these."""

import copy

import pytest
import torch
from conftest import assert_partings_are_near_ties

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


@pytest.mark.parametrize("round_graphs", ["1", "2"])
def test_verify_round_capture_replays_identically(monkeypatch, round_graphs):
    """Capture the round (one graph, or draft and verify + commit apart) after the eager warm-up round:
    replaying it from the same committed state reproduces the eager round (draft, verify, commit) bit for
    bit, every time (a round is a function of the committed state)."""
    monkeypatch.setenv("TREECOMPILE_ROUND_GRAPHS", round_graphs)
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
    graphs = spec._graphs[st["B"]]
    assert len(graphs) == int(round_graphs)
    for _ in range(2):
        for k, v in tensors.items():
            v.copy_(before[k])
        for graph in graphs:
            graph.replay()
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
    assert ahead.split_lookahead and ahead.round_graphs == 2  # the default: only the next draft goes ahead
    whole = TreeSpeculator(model, drafter, lookahead=True, **kwargs)
    whole.split_lookahead = False  # whole rounds ahead
    synced = TreeSpeculator(model, drafter, lookahead=False, **kwargs)
    ids, mask = ragged()
    new = synced.generate(ids, mask, max_new_tokens=40, eos_token_id=[]).sequences[:, ids.shape[1]:]
    stops = [int(new[0, min(max_new_tokens, 40) // 2]), int(new[2, min(max_new_tokens, 40) - 1])]
    for eos in ([], stops):
        for _ in range(2):  # the second request replays graphs captured by the first
            ref = synced.generate(ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos)
            for spec in (ahead, whole):
                got = spec.generate(ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos)
                assert torch.equal(got.sequences, ref.sequences), spec.split_lookahead
                assert torch.equal(got.accept_lengths, ref.accept_lengths), spec.split_lookahead
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
        spec._draft_fn(st)  # the draft the rounds run: the compiled whole round on CUDA by default
        spec._verify_round(st)
        spec._commit(st)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _after_prefill(spec, ids, mask) -> dict:
    _, lengths, prompts = spec._prompts(ids, mask)
    st = spec._new_state(len(lengths), lengths, prompts, [], 32)
    spec._prefill(st, max(lengths))
    torch.cuda.synchronize()
    names = ("history", "vc", "dvc", "root", "pend_feat", "pend_tok", "pend_n", "out", "n_gen", "running")
    return {name: st[name].clone() for name in names}


def test_captured_prefill_equals_eager_prefill():
    """Prefill chunks replay one graph captured per batch size: prompts of 1..3 chunks (chunk 4, ragged,
    up to 11 rows), three requests on the same graph, each leave the state an eager prefill leaves, and
    generate gives the eager tokens (the target's and the draft cache's K/V written by the replays is what
    the rounds then read). The capture runs chunk 0 twice before recording and undoes what it committed."""
    model = tiny_llama()
    drafter = EagleDrafter.for_target(model, seed=1)
    kwargs = dict(topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256, prefill_chunk=4)
    graphs = TreeSpeculator(model, drafter, cuda_graphs=True, **kwargs)
    eager = TreeSpeculator(model, drafter, cuda_graphs=False, **kwargs)
    for seed, width in ((0, 11), (1, 6), (2, 3)):
        if width > 8:
            ids, mask = ragged(width=width, seed=seed)  # 11, 7 and 4 rows: 3, 2 and 1 chunks
        else:  # ragged() pads 4 and 7 rows; here 1 and 2
            ids = torch.randint(1, 128, (3, width), generator=torch.Generator().manual_seed(seed)).cuda()
            mask = torch.ones_like(ids)
            mask[0, :1] = 0
            mask[2, :2] = 0
            ids = ids * mask
        got, ref = _after_prefill(graphs, ids, mask), _after_prefill(eager, ids, mask)
        for name in ref:
            assert torch.equal(got[name], ref[name]), (seed, name)
        out_g = graphs.generate(ids, mask, max_new_tokens=24, eos_token_id=[])
        out_e = eager.generate(ids, mask, max_new_tokens=24, eos_token_id=[])
        assert torch.equal(out_g.sequences, out_e.sequences), seed
        assert torch.equal(out_g.accept_lengths, out_e.accept_lengths), seed
    assert list(graphs._prefill_graphs) == [3]


def test_captured_prefill_of_a_hybrid_resets_linear_state():
    """Qwen3-Next (GDN + attention), float32: the capture's two warm-up chunks commit linear state and it
    is undone, so a multi-chunk prefill replayed from the graph gives the eager tokens for every request."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_lossless_hybrid import gpu_model

    model = gpu_model("qwen3_next", torch.float32)
    drafter = EagleDrafter.for_target(model, seed=1)
    kwargs = dict(topk=4, steps=5, num_nodes=16, max_batch_size=3, max_seq_len=256, prefill_chunk=4,
                  inductor=False)  # fmt: skip
    graphs = TreeSpeculator(model, drafter, cuda_graphs=True, **kwargs)
    eager = TreeSpeculator(model, drafter, cuda_graphs=False, **kwargs)
    for seed in (0, 1):
        ids, mask = ragged(seed=seed)
        got = graphs.generate(ids, mask, max_new_tokens=20, eos_token_id=[])
        ref = eager.generate(ids, mask, max_new_tokens=20, eos_token_id=[])
        assert torch.equal(got.sequences, ref.sequences), seed
        assert torch.equal(got.accept_lengths, ref.accept_lengths), seed


def test_prefill_replays_make_no_host_sync():
    """Once captured, a request's prefill (chunk start written, graph replayed, per chunk) never syncs."""
    model = tiny_llama(torch.bfloat16)
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=4, steps=5, num_nodes=32,
                          max_batch_size=3, max_seq_len=256, prefill_chunk=4)  # fmt: skip
    ids, mask = ragged()
    spec.generate(ids, mask, max_new_tokens=4)  # captures
    _, lengths, prompts = spec._prompts(ids, mask)
    st = spec._new_state(len(lengths), lengths, prompts, [7], 64)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        spec._prefill(st, max(lengths))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kind", ["dot", "gemv_pdl"])
def test_skinny_linears_on_cuda_run_the_op_and_agree(monkeypatch, kind):
    """skinny_linears=True (bf16, Inductor, CUDA graphs): the target's and the head's few-row GEMMs run
    treespec::skinny_linear, and the output agrees with the same speculator on cuBLAS. bf16 GEMMs of two
    kernels round differently, so the two may part only at near-ties (``assert_partings_are_near_ties``).
    ``gemv_pdl``: every gemv-sized GEMM is the gemv kernel as a dependent launch (captured into the round
    graphs). A batch of 3 trees of 32 nodes verifies 96 rows: row blocks since the twenty-sixth session (MAX_ROWS
    256)."""
    from treecompile.ops import skinny_linear as skinny_module
    from treecompile.ops.skinny_linear import linear_rows

    model = tiny_llama(torch.bfloat16)
    model16 = copy.deepcopy(model)
    ids, mask = ragged()
    outs = []
    # The tiny model's shapes were never swept (they would stay on cuBLAS): every shape counts as a win here.
    def tiles(M, N, K):
        if M > skinny_module.MAX_ROWS:  # as measured_tiles: past the op's rows, cuBLAS
            return None
        if kind == "gemv_pdl" and M <= skinny_module.GEMV_MAX_ROWS:
            return skinny_module.gemv_config(M, N, K, pdl=True)
        return skinny_module.choose_skinny_config(M, N, K)

    monkeypatch.setattr(skinny_module, "measured_tiles", tiles)
    for skinny in (False, True):
        spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1).to("cuda", torch.bfloat16), topk=4,
                              steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256, skinny_linears=skinny)  # fmt: skip
        assert spec.binding.skinny_linears is skinny
        assert (getattr(spec.drafter.midlayer.self_attn.linear, "func", None) is linear_rows) is skinny
        calls = []
        launch = skinny_module._launch_skinny_linear
        if skinny:  # count the kernel's launches while the rounds run eagerly and are captured

            def counting(x, *args, **kwargs):
                calls.append(x.shape[0])
                return launch(x, *args, **kwargs)

            skinny_module._launch_skinny_linear = counting
        try:
            outs.append(spec.generate(ids, mask, max_new_tokens=40).sequences)
        finally:
            skinny_module._launch_skinny_linear = launch
        if skinny:
            assert calls and max(calls) <= skinny_module.MAX_ROWS, calls
            assert 3 * 32 in calls  # the batch's verify: the row-block path ran too
    assert None in assert_partings_are_near_ties(model16, ids, mask, *outs)  # a row without near-ties agrees


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dependent_launches_change_no_token(monkeypatch, dtype):
    """TREECOMPILE_PDL=1 (every treecompile kernel a programmatic dependent launch) with Inductor's own
    ``triton.enable_pdl``: the same kernels and the same math, launched so that each may start while the one
    before drains. A kernel that read its inputs before its wait would read stale rows; the output must
    equal the ordinary launches' token for token (bf16: with skinny_linears, so the gemv / MMA kernels run
    as dependent launches too)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "triton.enable_pdl"):
        pytest.skip("this torch's Inductor has no triton.enable_pdl")
    model = tiny_llama(dtype)
    ids, mask = ragged()
    outs = []
    for pdl in (False, True):
        monkeypatch.setenv("TREECOMPILE_PDL", "1" if pdl else "0")
        monkeypatch.setattr(inductor_config.triton, "enable_pdl", pdl)
        torch._dynamo.reset()  # compile afresh under this config
        drafter = EagleDrafter.for_target(model, seed=1).to("cuda", dtype)
        spec = TreeSpeculator(model, drafter, topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256,
                              skinny_linears=dtype == torch.bfloat16)  # fmt: skip
        out = spec.generate(ids, mask, max_new_tokens=40)
        outs.append((out.sequences, out.accept_lengths))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


def test_combo_kernels_change_no_token(monkeypatch):
    """Inductor's combo kernels (on by default for treecompile's compiles on CUDA) launch independent small
    kernels of a graph as one: the same math, so in float32 the tokens and accept lengths must equal those of
    the separate kernels (TREECOMPILE_COMBO_KERNELS=0), the compiled draft round included."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "combo_kernels"):
        pytest.skip("this torch's Inductor has no combo_kernels")
    model = tiny_llama(torch.float32)
    ids, mask = ragged()
    outs = []
    for combo in (False, True):
        monkeypatch.setenv("TREECOMPILE_COMBO_KERNELS", "1" if combo else "0")
        torch._dynamo.reset()  # compile afresh under this config
        drafter = EagleDrafter.for_target(model, seed=1).to("cuda", torch.float32)
        spec = TreeSpeculator(model, drafter, topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256)
        out = spec.generate(ids, mask, max_new_tokens=40)
        outs.append((out.sequences, out.accept_lengths))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_merges_and_the_draft_fold_change_no_token(monkeypatch, dtype):
    """The launch savers, all on against all off: the draft top-k's merge inside its slice kernel
    (``TREECOMPILE_TOPK_FUSED_MERGE=1``), the draft cache write inside the lane attention (``fold_cache_write``:
    lane step s's rows are window columns [(s - 1) K, s K)) and the commit compiled whole
    (``TREECOMPILE_COMPILED_COMMIT``, on by default). Captured rounds replay them with the arrival counters
    zeroed by each launch. The fused merge sums the same terms in another order, so fp32 must give the same
    tokens and bf16 may part only at near-ties."""
    model = tiny_llama(dtype)
    model16 = copy.deepcopy(model) if dtype == torch.bfloat16 else None  # the near-tie oracle's reference
    ids, mask = ragged()
    outs = []
    for on in (False, True):
        monkeypatch.setenv("TREECOMPILE_TOPK_FUSED_MERGE", "1" if on else "0")
        monkeypatch.setenv("TREECOMPILE_COMPILED_COMMIT", "1" if on else "0")
        torch._dynamo.reset()
        drafter = EagleDrafter.for_target(model, seed=1).to("cuda", dtype)
        drafter.fold_cache_write = on
        spec = TreeSpeculator(model, drafter, topk=4, steps=5, num_nodes=32, max_batch_size=3, max_seq_len=256)
        outs.append(spec.generate(ids, mask, max_new_tokens=40))
    if dtype == torch.float32:
        assert torch.equal(outs[0].sequences, outs[1].sequences)
    else:
        assert None in assert_partings_are_near_ties(model16, ids, mask, outs[0].sequences, outs[1].sequences)


@pytest.mark.parametrize("topk", [4, 1], ids=["tree", "chain"])
def test_compiled_draft_round_drafts_the_per_hook_tree(monkeypatch, topk):
    """``TREECOMPILE_COMPILED_DRAFT`` ("1", the CUDA default, against "0"): the whole draft round as one Inductor graph. With CUDA
    graphs the generate stays equal to the per-hook speculator's tokens; from the state the requests left
    behind, the whole round drafts the per-hook round's tree (tokens, parents, masks) in float32."""
    model = tiny_llama()
    ids, mask = ragged()
    specs, outs = [], []
    for on in ("0", "1"):
        monkeypatch.setenv("TREECOMPILE_COMPILED_DRAFT", on)
        torch._dynamo.reset()
        spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=topk, steps=5, num_nodes=24,
                              max_batch_size=3, max_seq_len=256)  # fmt: skip
        assert (spec._draft_fn == spec._draft_round) == (on == "0")
        outs.append(spec.generate(ids, mask, max_new_tokens=40))
        specs.append(spec)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].accept_lengths, outs[1].accept_lengths)
    spec = specs[1]
    st = dict(spec._buffers[3], B=3)
    trees = []
    for draft in (spec._draft_round, spec._draft_fn):
        st["tree_tokens"].fill_(-1)
        draft(st)
        torch.cuda.synchronize()
        trees.append([t.clone() for t in (st["tree_tokens"], st["spec"].parents, st["spec"].ancestor_mask)])
    for got, want in zip(trees[1], trees[0]):
        assert torch.equal(got, want)


def test_cuda_rounds_never_recompile_across_requests_and_batch_sizes():
    """Every CUDA default (the compiled draft round, Inductor hooks, the compiled commit, CUDA graphs, skinny
    linears): a second request and new batch sizes compile new code objects, never recompile an old one (a
    recompile inside a round is a second compile, and once past Dynamo's limit of 8 the fullgraph commit raised).
    A repeated batch-1 request (nothing smaller to shrink onto) gives its first tokens again."""
    model = tiny_llama(torch.bfloat16)
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=4, steps=5, num_nodes=32,
                          max_batch_size=3, max_seq_len=256)  # fmt: skip
    ids, mask = ragged()
    outs = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in (1, 3, 1, 2):
            outs.append(spec.generate(ids[:b], mask[:b], max_new_tokens=24).sequences)
    assert torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("tree", [(4, 5, 32), (2, 2, 4)], ids=["head-only", "target-too"])
def test_fused_mlp_on_cuda_runs_the_op_and_agrees(monkeypatch, tree):
    """TREECOMPILE_FUSED_MLP=1 (bf16, Inductor, CUDA graphs, skinny linears on): the head's MLP (lanes of
    3 x 4 rows, step 0 of 3) and, for a (2, 2, 4) tree, the target's MLP in the verify (3 x 4 rows) run
    treespec::fused_mlp with the post-attention RMSNorm folded in; the output agrees with the same speculator
    without it: bf16 kernels round differently, so the two may part only at near-ties."""
    from treecompile.ops import fused_mlp as mlp_module

    model = tiny_llama(torch.bfloat16)
    model16 = copy.deepcopy(model)
    ids, mask = ragged()
    topk, steps, nodes = tree
    outs = []
    for fused in ("0", "1"):
        monkeypatch.setenv(mlp_module.FUSED_MLP_ENV, fused)
        calls = []
        launch = mlp_module._launch_fused_mlp

        def counting(x, *args, **kwargs):
            calls.append((x.shape[0], kwargs.get("norm_weight") is not None))
            return launch(x, *args, **kwargs)

        monkeypatch.setattr(mlp_module, "_launch_fused_mlp", counting)
        spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1).to("cuda", torch.bfloat16), topk=topk,
                              steps=steps, num_nodes=nodes, max_batch_size=3, max_seq_len=256, skinny_linears=True)  # fmt: skip
        outs.append(spec.generate(ids, mask, max_new_tokens=40).sequences)
        monkeypatch.setattr(mlp_module, "_launch_fused_mlp", launch)
        if fused == "0":
            assert not calls
        else:
            assert calls and all(norm for _, norm in calls), calls
            assert 3 * topk in {m for m, _ in calls}  # the head's lanes
            if nodes * 3 <= mlp_module.MAX_ROWS:
                assert 3 * nodes in {m for m, _ in calls}  # the target's verify
    assert None in assert_partings_are_near_ties(model16, ids, mask, *outs)  # a row without near-ties agrees
