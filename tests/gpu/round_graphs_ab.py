"""One captured graph a round against two (draft; verify + commit), same speculator, same process (GPU).

Per configuration the speculator captures its batch-1 round both ways (``round_graphs`` 1, then 2), keeps both,
and times passes over the held-out prompts with the two forms alternating (``--repeats`` pairs), so the rows
differ by the graph split alone. Outputs of the two forms must be equal token for token (same kernels, same
order: only the graph boundary moves).

    python3 tests/gpu/round_graphs_ab.py out.json [--prompts 56] [--trees "4,4,16;10,6,64"] [--repeats 2]
"""

import argparse
import json
import statistics
import sys
import time

import torch

from treecompile.bench.e2e import E2EBench, Setup, build_configs, parse_trees


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=56)
    ap.add_argument("--trees", default="4,4,16;10,6,64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--configs", default="tc_plain,tc_tree")
    args = ap.parse_args()
    configs = build_configs(args.configs.split(","), parse_trees(args.trees), 5)
    setup = Setup(batch_sizes=(1,), max_new_tokens=args.max_new_tokens, prompts=args.prompts, configs=configs,
                  inductor=True, fuse_projections=True, device=torch.device("cuda"))  # fmt: skip
    bench = E2EBench(setup)
    bench.load()
    batches = bench.batches(1)
    rows = []
    for config in configs:
        t0 = time.time()
        with torch.no_grad():
            gen = bench.generator(config)
            spec = bench._specs[config.name]
            forms = {}
            for graphs in (1, 2):  # capture the round both ways; keep both
                spec._graphs.pop(1, None)
                spec.round_graphs = graphs
                gen(*batches[0], 32)
                forms[graphs] = spec._graphs[1]
                assert len(forms[graphs]) == graphs
            warm = time.time() - t0
            passes = {1: [], 2: []}
            for _ in range(args.repeats):
                for graphs in (1, 2):
                    spec._graphs[1] = forms[graphs]
                    passes[graphs].append(bench._timed_pass(gen, batches, spec))
        for graphs, ps in passes.items():
            first = ps[0]
            walls = [p["wall"] for p in ps]
            tokens = sum(len(x) for x in first["outputs"])
            alen = torch.cat(first["alens"]) if first["alens"] else None
            rounds = sum(first["brounds"])
            row = dict(config=config.name, tree=list(config.shape), round_graphs=graphs, new_tokens=tokens,
                       walls_s=walls, tokens_per_s=tokens / statistics.median(walls), rounds=rounds,
                       ms_per_round=statistics.median(walls) * 1e3 / rounds,
                       tau=float(alen.float().mean()) if alen is not None else None,
                       outputs_equal_other_form=passes[1][0]["outputs"] == passes[2][0]["outputs"], warmup_s=warm)  # fmt: skip
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "walls_s"}), "walls", [round(w, 3) for w in walls],
                  flush=True)  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["outputs_equal_other_form"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
