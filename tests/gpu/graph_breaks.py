"""Graph breaks and graphs of a compiled speculator's rounds on the GPU, with ``linear_rows``'s routing traced by
Dynamo (the code before the forty-first session) and as a constant (``skinny_linear._has_tiles``, now).

    python3 tests/gpu/graph_breaks.py OUT.json

A tiny bf16 Llama and its random EAGLE-3 head, the CUDA defaults (compiled draft round, skinny linears, CUDA
graphs), one request of 24 new tokens per variant, Dynamo reset in between. Prints and writes Dynamo's counters:
graph breaks by reason, unique graphs, frames compiled; and whether both variants emitted the same tokens.
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


def run(variant: str) -> dict:
    constant = skinny_linear._has_tiles
    if variant == "traced":  # a plain function: Dynamo traces the table scan and gpu_class, as before
        skinny_linear._has_tiles = lambda M, N, K: skinny_linear.measured_tiles(M, N, K) is not None
    torch._dynamo.reset()
    counters.clear()
    try:
        model = tiny_llama(torch.bfloat16)
        spec = TreeSpeculator(model, EagleDrafter.for_target(model, seed=1).to("cuda", torch.bfloat16), topk=4,
                              steps=5, num_nodes=32, max_batch_size=1, max_seq_len=256)  # fmt: skip
        ids, mask = ragged()
        seq = spec.generate(ids[:1], mask[:1], max_new_tokens=24).sequences
    finally:
        skinny_linear._has_tiles = constant
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
    res = [run(v) for v in ("traced", "constant")]
    print("same tokens:", res[0]["tokens"] == res[1]["tokens"], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
