"""Randomised lossless check, for longer runs than the suite's (CPU, float64; not collected by pytest).

Each case draws a tiny model of a supported family, an attention one or a hybrid (GDN, Mamba2), and a drafter.
The drafter is either a random EAGLE-3 head, which mostly accepts the root only, or the suite's oracle head,
which accepts deep paths. The case also draws:
- a tree (topk 1-5, steps 1-5, num_nodes up to the tree's size);
- a page size, batch capacity and cache capacity, with projections fused or not;
- for hybrids, the linear-attention verify form.

It then sends one to three requests through the same speculator. Each request has a random ragged batch,
max_new_tokens and EOS (none, an id, or a list taken from HF's own continuation). Every output must equal HF
`generate(do_sample=False)`, and without EOS the accept lengths must add up to max_new_tokens - 1. Refusals
(a tree that does not fit its window, a request past the cache) are counted, not failed.

    python tests/fuzz/lossless_fuzz.py --seconds 600 --workers 2 --log fuzz.jsonl

One JSON line a case goes to the log. The exit status is 1 if any case failed or raised. A failing case is
replayed with `--seed N --cases 1`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "models"))  # the suite's tiny models and oracle drafter


def run_case(seed: int) -> dict:
    """One speculator and its requests, drawn from ``seed``; ``status`` is ok, refused, FAIL or ERROR."""
    import torch

    import test_lossless as attention
    import test_lossless_hybrid as hybrid
    from treecompile.drafter import EagleDrafter
    from treecompile.speculator import TreeSpeculator

    r = random.Random(seed)
    is_hybrid = r.random() < 0.3
    family = r.choice(hybrid.FAMILIES if is_hybrid else attention.FAMILIES)
    if is_hybrid:
        model = hybrid.tiny_model(family, seed=r.randrange(100))
    else:
        model = attention.tiny_model(family, seed=r.randrange(100), layers=r.randint(1, 3))
    topk, steps = r.choice([1, 1, 2, 3, 4, 5]), r.randint(1, 5)
    tree_size = 1 + topk * steps if topk == 1 else 1 + topk + (steps - 1) * topk * topk
    # Mostly trees whose lane window fits (a window wider than num_nodes is refused; a few cases check that).
    hi = max(2, min(64, tree_size))
    lo = min(hi, (steps - 1) * topk + 1) if r.random() < 0.85 else 2
    kw = dict(topk=topk, steps=steps, num_nodes=r.randint(max(2, lo), hi),
              max_batch_size=r.randint(1, 4), page_size=r.choice([4, 8, 16, 64]), max_seq_len=r.randint(40, 100))  # fmt: skip
    if is_hybrid:
        form = r.choice(["staged", "replay", "chunked"])
        kw.update(replay_ssm=form != "staged", gdn_chunked=form == "chunked", mamba2_chunked=form == "chunked")
    if r.random() < 0.3:
        kw["fuse_projections"] = True
    oracle, noise = r.random() < 0.7, r.choice([0.0, 0.3, 0.6, 1.2])
    case = dict(seed=seed, family=family, oracle=oracle, noise=noise, **kw)
    if oracle:
        drafter = attention.OracleDrafter.build(model, noise=noise, seed=r.randrange(100))
    else:
        drafter = EagleDrafter.for_target(model, seed=r.randrange(100))
    try:
        spec = TreeSpeculator(model, drafter, **kw)
    except ValueError as exc:
        return dict(case, status="refused", why=str(exc)[:300])
    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(r.randint(1, 3)):
        B = r.randint(1, kw["max_batch_size"])
        ids, mask = attention.ragged_batch(g, B, shortest=r.randint(1, 4), longest=r.randint(4, 14))
        new = r.randint(1, 24)
        if ids.shape[1] + new > kw["max_seq_len"]:
            new = max(1, kw["max_seq_len"] - ids.shape[1] - r.randint(0, 3))
        eos = None
        if r.random() < 0.4:  # ids HF's own continuation emits, so EOS lands mid-stream
            free = attention.hf_greedy(model, ids, mask, new)[:, ids.shape[1] :]
            picks = [int(free[r.randrange(B), r.randrange(free.shape[1])]) for _ in range(r.randint(1, 2))]
            eos = picks[0] if len(picks) == 1 and r.random() < 0.5 else picks
        req = dict(batch=B, width=ids.shape[1], max_new_tokens=new, eos=eos)
        try:
            out = spec.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
        except ValueError as exc:  # e.g. prompt + new tokens + a verify window past the cache
            requests.append(dict(req, status="refused", why=str(exc)[:300]))
            continue
        ref = attention.hf_greedy(model, ids, mask, new, eos=eos, pad=0)
        ok = out.sequences.shape == ref.shape and torch.equal(out.sequences, ref)
        if ok and eos is None:
            ok = out.accept_lengths.sum(0).tolist() == [new - 1] * B
        accepted = out.accept_lengths[out.accept_lengths > 0]
        req.update(status="ok" if ok else "FAIL", tau=round(float(accepted.float().mean()), 3) if accepted.numel() else 0.0)
        if not ok:
            req.update(ids=ids.tolist(), mask=mask.tolist(), ours=out.sequences.tolist(), hf=ref.tolist(),
                       accept_lengths=out.accept_lengths.tolist())  # fmt: skip
            requests.append(req)
            break
        requests.append(req)
    failed = any(q["status"] == "FAIL" for q in requests)
    return dict(case, status="FAIL" if failed else "ok", requests=requests)


def _worker(args) -> list[dict]:
    first, stride, cases, deadline = args
    import torch

    torch.set_num_threads(1)
    out, seed = [], first
    while len(out) < cases and time.time() < deadline:
        try:
            res = run_case(seed)
        except Exception:  # noqa: BLE001 - a crash is a finding: keep it with its seed
            res = dict(seed=seed, status="ERROR", error=traceback.format_exc()[-2000:])
        out.append(res)
        print(json.dumps({k: res.get(k) for k in ("seed", "family", "status")}), flush=True)
        seed += stride
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="stop starting new cases after this long")
    parser.add_argument("--cases", type=int, default=1_000_000, help="at most this many cases a worker")
    parser.add_argument("--seed", type=int, default=0, help="first case's seed (worker w starts at seed + w)")
    parser.add_argument("--workers", type=int, default=1, help="processes, one thread each")
    parser.add_argument("--log", default="lossless_fuzz.jsonl", help="one JSON line a case")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.cases < 1 or args.workers < 1:
        parser.error("--seconds must be > 0, --cases and --workers >= 1")
    deadline = time.time() + args.seconds
    jobs = [(args.seed + w, args.workers, args.cases, deadline) for w in range(args.workers)]
    if args.workers == 1:
        results = _worker(jobs[0])
    else:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            results = [res for part in pool.map(_worker, jobs) for res in part]
    with open(args.log, "w") as f:
        for res in sorted(results, key=lambda x: x["seed"]):
            f.write(json.dumps(res) + "\n")
    counts: dict[str, int] = {}
    for res in results:
        counts[res["status"]] = counts.get(res["status"], 0) + 1
    requests = [q for res in results for q in res.get("requests", [])]
    print(f"{len(results)} cases {counts}; {sum(q['status'] == 'ok' for q in requests)} requests equal HF greedy, "
          f"{sum(q.get('eos') is not None for q in requests)} with EOS; log: {args.log}")  # fmt: skip
    bad = sorted(res["seed"] for res in results if res["status"] in ("FAIL", "ERROR"))
    if bad:
        print(f"failing seeds: {bad} (replay one: --seed N --cases 1)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
