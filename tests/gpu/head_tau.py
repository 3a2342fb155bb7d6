"""Held-out acceptance of candidate SmolLM2 draft heads (device-machine helper, not a test module).

    python tests/gpu/head_tau.py HEAD_DIR [HEAD_DIR ...] [--prompts 12] [--max-new-tokens 128] [--json PATH]
        [--tree K,S,N ...] [--device cpu]

For each head and tree: TreeSpeculator over SmolLM2 (bf16 on CUDA with graphs of eager kernels, no Inductor:
only tau is wanted here; float32 on the CPU) on the first ``--prompts`` held-out prompts taken round-robin over
the categories, tree (4, 6, 32) unless ``--tree`` is given (repeatable: one sweep of tree shapes loads the
target once); prints tau (tokens per round, bonus included) per head and tree, the best head's directory last.
tau depends on the head, the target and the tree, not on the machine (up to bf16 / float32 rounding), so the
CPU can rank tree shapes ahead of a GPU session.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("heads", nargs="+")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", action="append", default=None, help="K,S,N (repeatable; default 4,6,32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="target and head dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    args = p.parse_args()

    from treecompile.bench.e2e import heldout_in_order
    from treecompile.draft_tree import DraftTree
    from treecompile.drafter import EagleDrafter
    from treecompile.models import load_smollm2
    from treecompile.speculator import TreeSpeculator
    from treecompile.train import chat_ids

    trees = [tuple(int(x) for x in t.split(",")) for t in (args.tree or ["4,6,32"])]
    for K, S, N in trees:  # every shape checked before the target loads (a bad last one once lost the others' JSON)
        DraftTree(K, S, N)
    held_out = heldout_in_order()  # the e2e benchmark's order: its first 12 prompts are these first 12
    if args.prompts > len(held_out):
        p.error(f"--prompts: at most {len(held_out)} (the held-out set), got {args.prompts}")
    texts = held_out[: args.prompts]
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    model, tok = load_smollm2(dtype=dtype, device=dev)
    ids = [torch.tensor([chat_ids(tok, t)], device=dev) for t in texts]
    eos = model.generation_config.eos_token_id
    results = {}
    for head, (K, S, N) in [(h, t) for h in args.heads for t in trees]:
        t0 = time.perf_counter()
        drafter = EagleDrafter.from_pretrained(head, model)
        spec = TreeSpeculator(model, drafter, topk=K, steps=S, num_nodes=N, max_batch_size=1, max_seq_len=1024,
                              inductor=False)
        per_prompt = []  # [accepted tokens, rounds] of each prompt, in order (subsets compare heads prompt by prompt)
        for x in ids:
            out = spec.generate(x, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            alen = out.accept_lengths[:, 0]
            alen = alen[alen > 0]
            per_prompt.append([int(alen.sum()), int(alen.numel())])
        accepted = sum(a for a, _ in per_prompt)
        rounds = sum(r for _, r in per_prompt)
        key = head if len(trees) == 1 else f"{head}@{K},{S},{N}"
        results[key] = {"tau": accepted / max(rounds, 1), "rounds": rounds, "seconds": time.perf_counter() - t0,
                        "tree": [K, S, N], "per_prompt": per_prompt}
        print(f"head {head} tree ({K}, {S}, {N}): tau {results[key]['tau']:.3f} over {rounds} rounds "
              f"({results[key]['seconds']:.0f} s)", flush=True)
        del spec, drafter
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    best = max(results, key=lambda h: results[h]["tau"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "best": best, "trees": trees, "prompts": args.prompts,
                       "max_new_tokens": args.max_new_tokens, "device": str(dev), "dtype": str(dtype)}, f, indent=1)
    print(best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
