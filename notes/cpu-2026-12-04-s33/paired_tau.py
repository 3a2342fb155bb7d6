"""Paired-by-prompt comparison of two heads' held-out tau (head_tau.py JSON files): tau of each, the
difference, and its bootstrap standard error and 95% interval when prompts are resampled.

    python notes/cpu-2026-12-04-s33/paired_tau.py A.json KEY_A B.json KEY_B
"""
import json
import sys

import torch

a = json.load(open(sys.argv[1]))["results"][sys.argv[2]]["per_prompt"]
b = json.load(open(sys.argv[3]))["results"][sys.argv[4]]["per_prompt"]
assert len(a) == len(b)
A, B = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)  # [P, 2]: tokens, rounds


def tau(x, idx):
    return x[idx, 0].sum() / x[idx, 1].sum()


full = torch.arange(len(a))
print(f"tau A {float(tau(A, full)):.3f}  tau B {float(tau(B, full)):.3f}  diff {float(tau(B, full) - tau(A, full)):+.3f}")
g = torch.Generator().manual_seed(0)
diffs = torch.stack([tau(B, i) - tau(A, i) for i in torch.randint(0, len(a), (10000, len(a)), generator=g)])
lo, hi = torch.quantile(diffs, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
print(f"bootstrap SE {float(diffs.std()):.3f}, 95% interval {lo:+.3f} .. {hi:+.3f}; B ahead on "
      f"{int((A[:, 0] / A[:, 1] < B[:, 0] / B[:, 1]).sum())} of {len(a)} prompts, behind on "
      f"{int((A[:, 0] / A[:, 1] > B[:, 0] / B[:, 1]).sum())}")
