"""Reliability of a head's draft log-probs by depth, and a per-depth Platt fit (calib_stats.py's rows).

    python notes/cpu-2026-12-04-s35/calib_fit.py STATS.pt

Per depth: mean draft probability against the hit rate, binned; then logit(q) = a_d * logit(p) + b_d fitted by
maximum likelihood (float64 Newton steps), and the log-loss before and after.
"""
import sys

import torch

d = torch.load(sys.argv[1])
rows = d["rows"]
depth, logp, y = rows[:, 1].long(), rows[:, 2].clamp(max=-1e-7), rows[:, 4]
print(d["head"], d["tree"], rows.shape[0], "rows")
edges = torch.tensor([0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0001], dtype=torch.float64)


def logit(lp):
    return lp - torch.log(-torch.expm1(lp))


def nll(z, y):
    return torch.nn.functional.binary_cross_entropy_with_logits(z, y).item()


for dd in range(1, int(depth.max()) + 1):
    m = depth == dd
    lp, yy = logp[m], y[m]
    p = lp.exp()
    line = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        b = (p >= lo) & (p < hi)
        if b.sum() >= 20:
            line.append(f"{p[b].mean():.2f}->{yy[b].mean():.2f}({int(b.sum())})")
    x = logit(lp)
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64)
    for _ in range(30):  # Newton on the 2-parameter logistic likelihood
        z = ab[0] * x + ab[1]
        s = torch.sigmoid(z)
        g = torch.stack([((s - yy) * x).sum(), (s - yy).sum()])
        w = s * (1 - s)
        Hm = torch.stack([torch.stack([(w * x * x).sum(), (w * x).sum()]), torch.stack([(w * x).sum(), w.sum()])])
        ab = ab - torch.linalg.solve(Hm + 1e-9 * torch.eye(2, dtype=torch.float64), g)
    print(f"depth {dd}: n {int(m.sum())}, mean p {p.mean():.3f}, hit {yy.mean():.3f}, a {ab[0]:.3f} b {ab[1]:.3f}, "
          f"nll {nll(x, yy):.4f} -> {nll(ab[0] * x + ab[1], yy):.4f}")
    print("   ", " ".join(line))
