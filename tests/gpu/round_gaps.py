"""Where a round's wall time goes inside a real request (GPU; SmolLM2-135M shapes, random weights, 8k draft vocab).

The eighth session found an e2e tree round ~0.1-0.15 ms longer than its two graphs timed back to back (plain
decode: ~0.04 ms). This wraps ``TreeSpeculator._round`` with CUDA events around each graph replay during one
``generate`` (lookahead on, as the e2e runs it) and reports, per round: the draft graph, the verify (+ commit)
graph, and the gap from the verify's end to the next round's draft start (the GPU idle or running the small
copies between rounds). It also times the same graphs back to back after the request, at the request's
final context.

    python3 tests/gpu/round_gaps.py out.json [prompt_len] [new_tokens]
"""

import os
import statistics
import sys

import torch

from treecompile.speculator import TreeSpeculator

# These probes time the draft and the verify graphs apart: two graphs a round (the default; kept if unset).
os.environ.setdefault("TREECOMPILE_ROUND_GRAPHS", "2")

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from loop_profile import gpu_ms, run_shapes, smollm2_target_and_head  # noqa: E402


def measure(model, drafter, shape, prompt_len: int, new_tokens: int) -> dict:
    k, s, n = shape
    spec = TreeSpeculator(model, drafter, topk=k, steps=s, num_nodes=n, max_batch_size=1, max_seq_len=1024,
                          prefill_chunk=64, inductor=True, fuse_projections=True)  # fmt: skip
    ids = torch.randint(1, 49152, (1, prompt_len), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    spec.generate(ids, max_new_tokens=32, eos_token_id=[])  # compile + capture
    marks: list[tuple[torch.cuda.Event, ...]] = []
    original = spec._round

    def timed_round(st):
        graphs = spec._graphs.get(st["B"])
        if graphs is None:
            return original(st)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        graphs[0].replay()
        ev[1].record()
        graphs[1].replay()
        ev[2].record()
        marks.append(tuple(ev))
        return None

    spec._round = timed_round
    torch.cuda.synchronize()
    res = spec.generate(ids, max_new_tokens=new_tokens, eos_token_id=[])
    torch.cuda.synchronize()
    spec._round = original
    draft = [a.elapsed_time(b) for a, b, _ in marks]
    verify = [b.elapsed_time(c) for _, b, c in marks]
    gaps = [marks[i][2].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)]
    wall = marks[0][0].elapsed_time(marks[-1][2])
    out = dict(shape=list(shape), prompt_len=prompt_len, rounds=len(marks), tokens=int(res.sequences.shape[1] - prompt_len),
               ms_per_round=wall / len(marks), draft_ms_median=statistics.median(draft),
               verify_ms_median=statistics.median(verify), gap_ms_median=statistics.median(gaps),
               draft_ms_first_last=[draft[0], draft[-1]], verify_ms_first_last=[verify[0], verify[-1]],
               gap_ms_mean=sum(gaps) / len(gaps), gap_ms_max=max(gaps))  # fmt: skip
    # The same graphs back to back, at the context the request ended with (its state is still bound).
    draft_graph, verify_graph = spec._graphs[1]
    out["draft_ms_back_to_back"] = gpu_ms(draft_graph.replay, 50) if n > 1 else 0.0
    out["verify_ms_back_to_back"] = gpu_ms(verify_graph.replay, 50)

    def alternate():
        draft_graph.replay()
        verify_graph.replay()

    out["round_ms_alternating"] = gpu_ms(alternate, 50)
    return out


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "round_gaps.json"
    prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    model, drafter = smollm2_target_and_head()
    run_shapes(path, ((8, 6, 64), (1, 1, 1)), lambda shape: measure(model, drafter, shape, prompt_len, new_tokens))


if __name__ == "__main__":
    main()
