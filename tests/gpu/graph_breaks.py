"""Graph breaks and graphs of a compiled speculator's rounds on the GPU: ``measured_tiles`` as before the
forty-first session (the nearest swept M by ``min(..., key=...)``, a Dynamo graph break) against now (a loop).

    python3 tests/gpu/graph_breaks.py OUT.json

A tiny bf16 Llama and its random EAGLE-3 head, the CUDA defaults (compiled draft round, skinny linears, CUDA
graphs), one request of 24 new tokens per variant, Dynamo reset in between. Every (N, K) gets a made-up 4-row
table entry (the tiny shapes were never swept), so the head's draft-lane GEMMs scan a table as the 8B head's do.
Prints and writes Dynamo's counters: graph breaks by reason, unique graphs; and whether both emitted the same
tokens.
"""

import json
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, "tests/runtime")
from test_speculator_gpu import ragged, tiny_llama  # noqa: E402

from treecompile.drafter import EagleDrafter  # noqa: E402
from treecompile.ops import skinny_linear  # noqa: E402
from treecompile.speculator import TreeSpeculator  # noqa: E402


def old_measured_tiles(M: int, N: int, K: int):
    """``measured_tiles`` before the forty-first session."""
    sl = skinny_linear
    if not 1 <= M <= sl.MAX_ROWS:
        return None
    swept = [(m, v) for m, v in sl._swept_rows(N, K).items() if sl._band(m) == sl._band(M)
             and (sl._kind(v) == "dot" or M <= 8 or (m > 8 and M <= sl.GEMV_MAX_ROWS))]  # fmt: skip
    if not swept:
        return None
    _, entry = min(swept, key=lambda item: (abs(item[0] - M), item[0]))
    return sl._entry_config(M, N, K, entry)


def run(variant: str) -> dict:
    new, swept_rows = skinny_linear.measured_tiles, skinny_linear._swept_rows
    skinny_linear._swept_rows = lambda N, K: {4: (32, 64, 4, 3, 1.0, 2.0)}  # a 4-row dot entry, a "win"
    if variant == "old":
        skinny_linear.measured_tiles = old_measured_tiles
    torch._dynamo.reset()
    counters.clear()
    try:
        model = tiny_llama(torch.bfloat16)
        spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1).to("cuda", torch.bfloat16), topk=4,
                              steps=5, num_nodes=32, max_batch_size=1, max_seq_len=256)  # fmt: skip
        ids, mask = ragged()
        seq = spec.generate(ids[:1], mask[:1], max_new_tokens=24).sequences
    finally:
        skinny_linear.measured_tiles, skinny_linear._swept_rows = new, swept_rows
    out = {
        "variant": variant,
        "graph_breaks": dict(counters["graph_break"]),
        "stats": dict(counters["stats"]),
        "tokens": seq[0].tolist(),
    }
    print(f"{variant}: {sum(out['graph_breaks'].values())} graph breaks, stats {out['stats']}", flush=True)
    for reason, n in sorted(out["graph_breaks"].items(), key=lambda kv: -kv[1])[:8]:
        print(f"   {n:4d}  {reason[:220]}", flush=True)
    return out


def main() -> None:
    print("gpu:", torch.cuda.get_device_name(), "class:", skinny_linear.gpu_class(), flush=True)
    res = [run(v) for v in ("old", "new")]
    print("same tokens:", res[0]["tokens"] == res[1]["tokens"], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
