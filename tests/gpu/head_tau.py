"""Held-out acceptance of candidate SmolLM2 draft heads (device-machine helper, not a test module).

    python tests/gpu/head_tau.py HEAD_DIR [HEAD_DIR ...] [--prompts 12] [--max-new-tokens 128] [--json PATH]

For each head: TreeSpeculator over SmolLM2 (bf16, CUDA graphs of eager kernels, no Inductor: only tau is
wanted here) on the first ``--prompts`` held-out prompts taken round-robin over the categories, tree
(4, 6, 32); prints tau (tokens per round, bonus included) per head and the best head's directory last.
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
    p.add_argument("--tree", default="4,6,32")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from treecompile.drafter import EagleDrafter
    from treecompile.models import load_smollm2
    from treecompile.prompts import CATEGORIES, heldout_prompts
    from treecompile.speculator import TreeSpeculator
    from treecompile.train import chat_ids

    dev = torch.device(args.device)
    model, tok = load_smollm2(dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev)
    by_cat = [heldout_prompts(c) for c in CATEGORIES]
    texts = [by_cat[i % len(by_cat)][i // len(by_cat)] for i in range(args.prompts)]
    ids = [torch.tensor([chat_ids(tok, t)], device=dev) for t in texts]
    eos = model.generation_config.eos_token_id
    K, S, N = (int(x) for x in args.tree.split(","))
    results = {}
    for head in args.heads:
        t0 = time.perf_counter()
        drafter = EagleDrafter.from_pretrained(head, model)
        spec = TreeSpeculator(model, drafter, topk=K, steps=S, num_nodes=N, max_batch_size=1, max_seq_len=1024,
                              inductor=False)
        accepted = rounds = 0
        for x in ids:
            out = spec.generate(x, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            alen = out.accept_lengths[:, 0]
            alen = alen[alen > 0]
            accepted += int(alen.sum())
            rounds += int(alen.numel())
        results[head] = {"tau": accepted / max(rounds, 1), "rounds": rounds, "seconds": time.perf_counter() - t0}
        print(f"head {head}: tau {results[head]['tau']:.3f} over {rounds} rounds "
              f"({results[head]['seconds']:.0f} s)", flush=True)
        del spec, drafter
        torch.cuda.empty_cache()
    best = max(results, key=lambda h: results[h]["tau"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "best": best, "tree": [K, S, N], "prompts": args.prompts}, f, indent=1)
    print(best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
