# The compiled-draft-round check of the sixteenth session (run from /tmp: python compiled_draft_repro.py).
# Prints the chain (topk=1) tree tokens of five draft rounds from one state: per-hook, per-hook, whole-round,
# whole-round, per-hook. Before the CPU plan fix (869f00b) request 1, stopped by an EOS, drafted token 35 per
# hook and 0 whole-round under Inductor; since, all five agree.
import os, sys, torch
sys.path.insert(0, "/work/main/tests/runtime")
os.environ["TREECOMPILE_COMPILED_DRAFT"] = "1"
from test_speculator import tiny_llama, hf_greedy, VOCAB
from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator
model = tiny_llama(dtype=torch.float32, seed=2)
spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1), topk=1, steps=3, num_nodes=6, max_batch_size=2, max_seq_len=64, page_size=8, inductor=True)
gen = torch.Generator().manual_seed(7)
ids = torch.randint(3, VOCAB, (2, 6), generator=gen)
mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
free = hf_greedy(model, ids, mask, 12)[:, ids.shape[1]:]
eos = [int(free[1, 4])]
out = spec.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
st = dict(spec._buffers[2], B=2)
for k in ("vc","dvc","pend_n","pend_tok","root","running"):
    print(k, st[k].tolist() if st[k].numel() < 20 else st[k].shape)
print("pend_feat finite", torch.isfinite(st["pend_feat"]).all(1))
orig = spec.draft_hooks.score_candidates
def spy(logits, K):
    print("logits finite per b", torch.isfinite(logits.reshape(logits.shape[0], -1)).all(1).tolist(), logits.reshape(2,-1)[:, :3])
    return orig(logits, K)
spec.draft_hooks.score_candidates = spy
spec.draft_hooks.score_candidates = orig
for f in (spec._draft_round, spec._draft_round, spec._draft_fn, spec._draft_fn, spec._draft_round):
    st["tree_tokens"].fill_(-1); f(st); print(st["tree_tokens"].tolist(), st["dvc"].tolist(), st["vc"].tolist())
