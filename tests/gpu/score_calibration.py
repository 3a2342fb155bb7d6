"""Would calibrated draft scores pick better verify trees? (CPU or GPU helper, not a test module.)

    python tests/gpu/score_calibration.py collect OUT.pt [--prompts 56] [--max-new-tokens 256] [--tree 8,6,64]
    python tests/gpu/score_calibration.py analyse OUT.pt [--json PATH]

``collect`` runs the shipped SmolLM2 head's tree speculation (float32 on the CPU: lossless, so the emitted
sequence is the target's greedy one) over the held-out prompts. For every round it records the K + (S-1)K^2
candidates the tree held before selection: cumulative scores, tokens, parent ids, depths, and the root's
position.

``analyse`` replays the selection offline. A candidate is on the greedy path when its tokens, root to
itself, equal the greedy continuation after the root. A round with a selected set accepts 1 + the deepest
selected on-path candidate. The default rule (top N-1 by cumulative log-prob) must reproduce the recorded
accept lengths; that check guards the replay. Each candidate rule is then scored by that replay. The main
rule is per-depth calibration: P(child on path | parent on path, draft log-prob bin, depth), fitted on half
the prompts and scored on the other half (2-fold). Ranking by the product of calibrated conditionals is
ranking by the probability of being on the greedy path, whose sum over the kept set is the expected accepted
length. The lanes expanded each step stay the recorded ones, so the replay scores re-selection only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch


def collect(args) -> None:
    from treecompile.bench.e2e import heldout_in_order
    from treecompile.drafter import EagleDrafter
    from treecompile.models import load_smollm2
    from treecompile.speculator import TreeSpeculator
    from treecompile.train import chat_ids

    K, S, N = (int(x) for x in args.tree.split(","))
    texts = heldout_in_order()[: args.prompts]
    model, tok = load_smollm2(dtype=torch.float32, device=torch.device("cpu"))
    import os

    import treecompile

    shipped = os.path.join(os.path.dirname(treecompile.__file__), "heads", "smollm2")
    drafter = EagleDrafter.from_pretrained(args.head or shipped, model)
    spec = TreeSpeculator(model, drafter, topk=K, steps=S, num_nodes=N, max_batch_size=1, max_seq_len=1024,
                          inductor=False)  # fmt: skip
    tree = spec.tree
    rounds: list[dict] = []
    draft = spec._draft_fn

    def recording_draft(st):
        vc = int(st["vc"][0])
        draft(st)
        scores, tokens, parents = tree.candidates()
        rounds.append(dict(vc=vc, scores=scores[0].clone(), tokens=tokens[0].clone(), parents=parents[0].clone()))

    spec._draft_fn = recording_draft
    eos = model.generation_config.eos_token_id
    data = []
    for i, text in enumerate(texts):
        rounds.clear()
        out = spec.generate(torch.tensor([chat_ids(tok, text)]), max_new_tokens=args.max_new_tokens, eos_token_id=eos)
        alen = out.accept_lengths[:, 0]
        data.append(dict(sequence=out.sequences[0].clone(), accept=alen[alen > 0].clone(), rounds=list(rounds)))
        print(f"prompt {i}: {len(rounds)} rounds, tau {float(alen[alen > 0].float().mean()):.3f}", flush=True)
    depth = tree._constants(torch.device("cpu"))[2].reshape(-1).clone()
    draft_ids = torch.arange(drafter.d2t.numel()) + drafter.d2t.cpu()
    torch.save(dict(tree=[K, S, N], depth=depth, prompts=data, draft_ids=draft_ids,
                    target_vocab=int(model.config.vocab_size)), args.out)  # fmt: skip


def _on_path(r: dict, seq: torch.Tensor, depth: torch.Tensor) -> torch.Tensor | None:
    """[C] bool: candidate on the greedy continuation after the root; None when the sequence ends too early."""
    p = r["vc"]
    S = int(depth.max())
    if p + S >= seq.numel():
        return None
    cont = seq[p + 1 : p + 1 + S]
    C = r["tokens"].numel()
    ok = torch.zeros(C, dtype=torch.bool)
    for c in range(C):  # parents have lower ids: one pass in id order
        par = int(r["parents"][c])
        parent_ok = True if par < 0 else bool(ok[par])
        ok[c] = parent_ok and int(r["tokens"][c]) == int(cont[int(depth[c]) - 1])
    return ok


def _accept(score: torch.Tensor, ok: torch.Tensor, depth: torch.Tensor, M: int) -> int:
    """1 + the deepest on-path candidate among the top-M by ``score`` (ties to the lower id)."""
    order = torch.sort(-score, stable=True).indices[:M]
    sel = ok[order]
    return 1 + (int(depth[order][sel].max()) if bool(sel.any()) else 0)


def _step_logp(r: dict) -> torch.Tensor:
    """Each candidate's own (conditional) draft log-prob: its cumulative score less its parent's."""
    par = r["parents"]
    parent_score = torch.where(par >= 0, r["scores"][par.clamp(min=0)], torch.zeros_like(r["scores"]))
    return r["scores"] - parent_score


def _cumulate(step_scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[C] per-candidate scores summed root to candidate (parents have lower ids: one pass in id order)."""
    out = step_scores.clone()
    for c in range(out.numel()):
        par = int(parents[c])
        if par >= 0:
            out[c] = out[c] + out[par]
    return out


BINS = torch.tensor([-8.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.5, -0.3, -0.2, -0.1, -0.05, -0.02])


def _fit(samples, S: int, prior: float = 2.0) -> torch.Tensor:
    """[S, bins + 1] log P(on path | parent on path, log-prob bin, depth), from (depth, logp, ok) samples of
    children whose parent is on the path; a Beta prior centred on exp(logp bin centre) keeps empty bins sane,
    and each depth's table is made monotone in the bin (pool adjacent violators)."""
    nb = BINS.numel() + 1
    hits = torch.zeros(S, nb)
    total = torch.zeros(S, nb)
    for d, lp, ok in samples:
        b = torch.bucketize(lp, BINS)
        hits[d - 1].index_add_(0, b, ok.float())
        total[d - 1].index_add_(0, b, torch.ones_like(lp))
    edges = torch.cat([BINS[:1] - 4, BINS, torch.zeros(1)])
    centre = torch.exp((edges[:-1] + edges[1:]) / 2)
    p = (hits + prior * centre) / (total + prior)
    for d in range(S):  # isotonic (non-decreasing in the bin) by pooling adjacent violators
        vals, weights = p[d].tolist(), (total[d] + prior).tolist()
        blocks = [[v, w, 1] for v, w in zip(vals, weights)]
        i = 0
        while i < len(blocks) - 1:
            if blocks[i][0] > blocks[i + 1][0]:
                v = (blocks[i][0] * blocks[i][1] + blocks[i + 1][0] * blocks[i + 1][1]) / (blocks[i][1] + blocks[i + 1][1])
                blocks[i] = [v, blocks[i][1] + blocks[i + 1][1], blocks[i][2] + blocks[i + 1][2]]
                del blocks[i + 1]
                i = max(i - 1, 0)
            else:
                i += 1
        p[d] = torch.tensor([b[0] for b in blocks for _ in range(b[2])])
    return p.clamp(1e-6, 1.0).log()


def analyse(args) -> None:
    blob = torch.load(args.path)
    K, S, N = blob["tree"]
    depth = blob["depth"]
    M = N - 1
    prompts = []
    mismatch = 0
    checked = 0
    for pr in blob["prompts"]:
        rows = []
        for j, r in enumerate(pr["rounds"]):
            ok = _on_path(r, pr["sequence"], depth)
            if ok is None:
                continue
            if j < len(pr["accept"]):
                checked += 1
                mismatch += _accept(r["scores"], ok, depth, M) != int(pr["accept"][j])
            rows.append(dict(r, ok=ok, lp=_step_logp(r)))
        prompts.append(rows)
    report = dict(tree=[K, S, N], rounds=sum(len(p) for p in prompts), replay_checked=checked,
                  replay_mismatch=mismatch)  # fmt: skip

    def tau(rule, subset) -> float:
        acc = [_accept(rule(r), r["ok"], depth, M) for i in subset for r in prompts[i]]
        return sum(acc) / max(len(acc), 1)

    idx = list(range(len(prompts)))
    folds = [idx[0::2], idx[1::2]]
    default = lambda r: r["scores"]  # noqa: E731
    report["tau_default"] = tau(default, idx)
    # Per-depth temperature on the step log-probs (monotone along paths for positive scales).
    for name, scales in (("deeper_sharper", [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]),
                         ("deeper_flatter", [1.0, 0.9, 0.8, 0.7, 0.6, 0.5])):  # fmt: skip
        sc = torch.tensor(scales[:S])

        def scaled(r, sc=sc):
            return _cumulate(sc[depth - 1] * r["lp"], r["parents"])

        report[f"tau_{name}"] = tau(scaled, idx)
    # Calibrated conditionals, 2-fold.
    cv = []
    for fit_on, score_on in ((folds[0], folds[1]), (folds[1], folds[0])):
        samples = []
        for i in fit_on:
            for r in prompts[i]:
                par = r["parents"]
                parent_ok = torch.where(par >= 0, r["ok"][par.clamp(min=0)], torch.ones_like(r["ok"]))
                for d in range(1, S + 1):
                    m = parent_ok & (depth == d)
                    samples.append((d, r["lp"][m], r["ok"][m]))
        table = _fit(samples, S)

        def calibrated(r, table=table):
            return _cumulate(table[depth - 1, torch.bucketize(r["lp"], BINS)], r["parents"])

        cv.append(dict(default=tau(default, score_on), calibrated=tau(calibrated, score_on),
                       table=table.exp().tolist()))  # fmt: skip
    report["cv"] = cv
    # Headroom: the best any re-selection of these candidates could do (the deepest on-path candidate), the
    # default rule at other tree sizes, and how often the path stops at a token outside the draft vocabulary.
    rounds = [r for rows in prompts for r in rows]
    report["tau_oracle_all_candidates"] = sum(1 + (int(depth[r["ok"]].max()) if bool(r["ok"].any()) else 0)
                                              for r in rounds) / len(rounds)  # fmt: skip
    report["tau_by_nodes"] = {n: sum(_accept(r["scores"], r["ok"], depth, n - 1) for r in rounds) / len(rounds)
                              for n in (16, 32, 48, 64, 96, 128)}  # fmt: skip
    in_vocab = torch.zeros(blob["target_vocab"], dtype=torch.bool)
    in_vocab[blob["draft_ids"]] = True
    stops = oov = 0
    for pr, rows in zip(blob["prompts"], prompts):
        for r in rows:
            d = _accept(r["scores"], r["ok"], depth, M) - 1
            if d < S:
                stops += 1
                oov += not bool(in_vocab[pr["sequence"][r["vc"] + 1 + d]])
    report["stops_short_of_depth"] = stops
    report["stops_at_token_outside_draft_vocab"] = oov
    greedy = torch.cat([pr["sequence"][pr["rounds"][0]["vc"] + 1 :] for pr in blob["prompts"] if pr["rounds"]])
    report["greedy_tokens_in_draft_vocab"] = float(in_vocab[greedy].float().mean())
    report["tau_calibrated_cv"] = sum(c["calibrated"] for c in cv) / 2
    report["tau_default_cv"] = sum(c["default"] for c in cv) / 2
    print(json.dumps({k: v for k, v in report.items() if k != "cv"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("out")
    c.add_argument("--prompts", type=int, default=56)
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--tree", default="8,6,64")
    c.add_argument("--head", default=None)
    a = sub.add_parser("analyse")
    a.add_argument("path")
    a.add_argument("--json", default=None)
    args = p.parse_args()
    collect(args) if args.cmd == "collect" else analyse(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
