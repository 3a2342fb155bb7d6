"""A CPU fuzz of TREECOMPILE_COMPILED_DRAFT=1 ahead of its GPU test (seventeenth session; not part of the suite:
each shape is an Inductor compile of a minute or more). For random tree shapes and batch sizes, a tiny float32
Llama: the speculator with the whole draft round compiled must (1) equal HF greedy on ragged requests with an
EOS inside, and (2) from the state those requests left, draft the per-hook round's tree exactly (tokens,
parents, ancestor masks, depths).

    cd /tmp && python /work/main/notes/cpu-2026-12-02-s17/compiled_draft_fuzz.py [CASES [SEED]]
"""

import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "runtime"))
os.environ["TREECOMPILE_COMPILED_DRAFT"] = "1"

import torch  # noqa: E402

from test_speculator import VOCAB, hf_greedy, tiny_llama  # noqa: E402
from treecompile.drafter import EagleDrafter  # noqa: E402
from treecompile.speculator import TreeSpeculator  # noqa: E402


def case(rng: random.Random, i: int) -> str:
    topk = rng.choice([1, 2, 3, 4])
    steps = rng.randint(2, 5)
    lanes = (steps - 1) * topk
    num_nodes = rng.randint(max(lanes, steps + 1 if topk == 1 else 2), max(lanes, steps + 1) + 6)
    num_nodes = min(num_nodes, 1 + topk + (steps - 1) * topk * topk)  # what the lanes can supply
    if topk == 1:
        num_nodes = steps + 1
    B = rng.randint(1, 3)
    model = tiny_llama(dtype=torch.float32, seed=10 + i)
    torch._dynamo.reset()
    spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=i), topk=topk, steps=steps,
                          num_nodes=num_nodes, max_batch_size=B, max_seq_len=96, page_size=8, inductor=True)  # fmt: skip
    assert spec._draft_fn is not spec._draft_round
    gen = torch.Generator().manual_seed(100 + i)
    width = rng.randint(3, 9)
    ids = torch.randint(3, VOCAB, (B, width), generator=gen)
    mask = torch.ones(B, width, dtype=torch.long)
    for b in range(B):
        mask[b, : rng.randint(0, width - 1)] = 0
    new = rng.randint(6, 16)
    free = hf_greedy(model, ids, mask, new)[:, width:]
    eos = [int(free[0, rng.randint(1, new - 1)])]
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
    want = hf_greedy(model, ids, mask, new, eos=eos)
    assert torch.equal(out.sequences, want), (out.sequences, want)
    st = dict(spec._buffers[B], B=B)
    trees = []
    for draft in (spec._draft_round, spec._draft_fn):
        st["tree_tokens"].fill_(-1)
        draft(st)
        tree = st["spec"]
        trees.append([t.clone() for t in (st["tree_tokens"], tree.parents, tree.ancestor_mask, tree.depth)])
    for name, got, want in zip(("tokens", "parents", "ancestor_mask", "depth"), trees[1], trees[0]):
        assert torch.equal(got, want), (name, got, want)
    return f"topk={topk} steps={steps} N={num_nodes} B={B} prompt={width} new={new} eos={eos}"


def main() -> int:
    cases = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 17
    rng = random.Random(seed)
    print(f"seed {seed}", flush=True)
    for i in range(cases):
        t0 = time.perf_counter()
        print(f"case {i}: {case(rng, i)}: equal ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
