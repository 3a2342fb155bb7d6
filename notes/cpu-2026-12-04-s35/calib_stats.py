"""Calibration data for a draft head: for every drafted candidate whose parent's path matches the target's greedy
continuation, its step, its own draft log-prob and whether it matches too (CPU float32 experiment helper).

    python notes/cpu-2026-12-04-s35/calib_stats.py HEAD --prompts 80 --max-new-tokens 192 --tree 4,6,32 --out F.pt

Prompts: training prompts (strided, so categories mix), never the held-out set the tau runs use.
Greedy speculation is lossless, so the emitted sequence is the target's greedy continuation; a round's root is
the token at the round's start, and candidate c at depth d is correct when its path equals the next d tokens.
"""
import argparse
import time

import torch

from treecompile.drafter import EagleDrafter
from treecompile.models import load_smollm2
from treecompile.prompts import training_prompts
from treecompile.speculator import TreeSpeculator
from treecompile.train import chat_ids

p = argparse.ArgumentParser()
p.add_argument("head")
p.add_argument("--prompts", type=int, default=80)
p.add_argument("--offset", type=int, default=0)
p.add_argument("--max-new-tokens", type=int, default=192)
p.add_argument("--tree", default="4,6,32")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--out", required=True)
p.add_argument("--heldout", action="store_true", help="the held-out prompts in the e2e order (diagnosis only)")
args = p.parse_args()
torch.set_num_threads(args.threads)
K, S, N = (int(x) for x in args.tree.split(","))
if args.heldout:
    from treecompile.bench.e2e import heldout_in_order

    allp = heldout_in_order()
else:
    allp = training_prompts()
stride = max(1, len(allp) // args.prompts)
texts = [allp[(args.offset + i * stride) % len(allp)] for i in range(args.prompts)]
model, tok = load_smollm2(dtype=torch.float32, device=torch.device("cpu"))
eos = model.generation_config.eos_token_id
drafter = EagleDrafter.from_pretrained(args.head, model)
spec = TreeSpeculator(model, drafter, topk=K, steps=S, num_nodes=N, max_batch_size=1, max_seq_len=1024, inductor=False)
rounds = []
orig_select = spec.tree.select


def select(root_tokens):
    sc, tk, par = spec.tree.candidates()
    rounds.append((root_tokens.clone(), sc[0].clone(), tk[0].clone(), par[0].clone()))
    return orig_select(root_tokens)


spec.tree.select = select
C = spec.tree.num_candidates
depth = torch.tensor([1 if i < K else (i - K) // (K * K) + 2 for i in range(C)])
rows = []  # (prompt, depth, own logp, cumulative score, parent correct, correct)
t0 = time.perf_counter()
for pi, text in enumerate(texts):
    rounds.clear()
    x = torch.tensor([chat_ids(tok, text)])
    out = spec.generate(x, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
    seq = out.sequences[0].tolist()
    P = x.shape[1]
    alen = out.accept_lengths[:, 0]
    alen = alen[alen > 0].tolist()
    assert len(alen) == len(rounds), (len(alen), len(rounds))
    pos = P  # the first round's root: the prefill's token, the first new token
    for (root, sc, tk, par), a in zip(rounds, alen):
        assert seq[pos] == int(root[0]), (pi, pos)
        nxt = seq[pos + 1 : pos + 1 + S]
        correct = torch.zeros(C, dtype=torch.bool)
        pcorrect = torch.zeros(C, dtype=torch.bool)
        own = torch.empty(C)
        for c in range(C):
            d = int(depth[c])
            pc = par[c].item()
            pcorrect[c] = True if pc < 0 else bool(correct[pc])
            own[c] = sc[c] - (0.0 if pc < 0 else sc[pc])
            correct[c] = bool(pcorrect[c]) and d <= len(nxt) and int(tk[c]) == nxt[d - 1]
        keep = pcorrect & (depth <= len(nxt))
        for c in keep.nonzero().flatten().tolist():
            rows.append((pi, int(depth[c]), float(own[c]), float(sc[c]), bool(correct[c])))
        pos += a
    if pi % 10 == 0:
        print(f"prompt {pi}: {len(rows)} rows, tau so far {sum(alen) / len(alen):.2f}, {time.perf_counter() - t0:.0f} s",
              flush=True)
t = torch.tensor([[r[0], r[1], r[2], r[3], float(r[4])] for r in rows], dtype=torch.float64)
torch.save({"rows": t, "tree": (K, S, N), "head": args.head, "prompts": args.prompts}, args.out)
print("saved", t.shape, f"{time.perf_counter() - t0:.0f} s")
