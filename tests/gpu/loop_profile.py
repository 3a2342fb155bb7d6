"""Where a generate round's wall time goes at SmolLM2-135M shapes (GPU; random weights, so timing only).

For each config (plain decode = a one-node tree, a tree) it times, after the warm-up that captures the graphs:
the whole ``generate`` per round (wall; interleaved with ``lookahead`` off and on), the round's graph alone
(the draft and verify (+ commit) graphs apart, or with ``TREECOMPILE_ROUND_GRAPHS=1`` the one round graph;
CUDA events over back-to-back replays) and the host time to launch one replay. The
difference between a round's wall time and the GPU time of its parts is time the GPU waits for the host.

    python3 tests/gpu/loop_profile.py out.json [PROFILE_DIR|-] [fuse]
"""

import json
import os
import sys
import time
import traceback

import torch

from treecompile.bench.rounds import build_target
from treecompile.drafter import EagleDrafter
from treecompile.speculator import TreeSpeculator

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
)  # fmt: skip


def smollm2_target_and_head(draft_vocab: int | None = 8192):
    """A random-weight SmolLM2-135M-shaped target and EAGLE-3 head on CUDA in bf16 (timing only).
    ``draft_vocab``: the head's vocabulary (8192: the shipped head's; None: the target's 49152)."""
    model = build_target(dict(SMOLLM2), torch.device("cuda"), torch.bfloat16)
    drafter = EagleDrafter.for_target(model, seed=0, draft_vocab_size=draft_vocab).to("cuda", torch.bfloat16).eval()
    return model, drafter


def run_shapes(path: str, shapes, measure) -> list:
    """``measure(shape)`` under no_grad for each tree shape; each result printed as a JSON line and the list
    rewritten to ``path`` as it grows (a killed run keeps what it measured)."""
    results = []
    for shape in shapes:
        with torch.no_grad():
            r = measure(shape)
        print(json.dumps(r), flush=True)
        results.append(r)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results


def gpu_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def host_ms(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) * 1e3 / reps
    torch.cuda.synchronize()
    return host


def profile(model, drafter, shape, inductor: bool, new_tokens: int = 256, profile_dir: str | None = None,
            fuse: bool = False, batch: int = 1) -> dict:
    k, s, n = shape
    spec = TreeSpeculator(model, drafter, topk=k, steps=s, num_nodes=n, max_batch_size=batch, max_seq_len=1024,
                          prefill_chunk=64, inductor=inductor, fuse_projections=fuse)  # fmt: skip
    ids = torch.randint(1, 49152, (batch, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    spec.generate(ids, max_new_tokens=32, eos_token_id=[])  # warm-up: compile + capture
    walls = {False: [], True: []}
    for _ in range(3):  # interleaved A/B: rounds read the stop flags after each round, or one round behind
        for lookahead in (False, True):
            spec.lookahead = lookahead
            torch.cuda.synchronize()
            t = time.perf_counter()
            res = spec.generate(ids, max_new_tokens=new_tokens, eos_token_id=[])
            torch.cuda.synchronize()
            walls[lookahead].append(((time.perf_counter() - t) * 1e3, res.accept_lengths.shape[0]))
    spec.lookahead = True
    rounds = res.accept_lengths.shape[0]
    # Graph parts on a live state (a fresh request, a few rounds in).
    st = spec._new_state(batch, [40] * batch, [row.tolist() for row in ids], [], 10_000)
    spec._prefill(st, 40)
    for _ in range(3):
        spec._round(st)
    graphs = spec._graphs[batch]  # (draft, verify + commit) or, with TREECOMPILE_ROUND_GRAPHS=1, (round,)
    named = dict(zip(("draft", "verify") if len(graphs) == 2 else ("round",), graphs))
    best = {la: min(w for w, _ in v) for la, v in walls.items()}
    out = dict(shape=list(shape), batch=batch, inductor=inductor, fuse_projections=fuse, rounds=rounds,
               tokens=int(res.sequences.shape[1] - 40),
               ms_per_round_sync=best[False] / rounds, ms_per_round_lookahead=best[True] / rounds,
               walls_ms={str(k): [round(w, 2) for w, _ in v] for k, v in walls.items()},
               round_graphs=len(graphs), replay_host_ms=host_ms(graphs[-1].replay, 50),
               any_host_ms=host_ms(lambda: bool(st["running"].any()), 50))  # fmt: skip
    for name, graph in named.items():
        out[f"{name}_gpu_ms" if name != "verify" else "verify_commit_gpu_ms"] = gpu_ms(graph.replay, 50)
    if profile_dir:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        for name, graph in named.items():
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=70)
            tag = f"{name}_{k}_{s}_{n}_b{batch}_{'inductor' if inductor else 'eager'}{'_fused' if fuse else ''}"
            with open(f"{profile_dir}/{tag}.txt", "w") as f:
                f.write(f"{tag}: 5 replays\n{table}\n")
            kernels = [
                {"name": e.key, "calls_per_replay": e.count / 5,
                 "us_per_replay": getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) / 5}
                for e in prof.key_averages()
                if getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) > 0
            ]  # fmt: skip
            with open(f"{profile_dir}/{tag}.json", "w") as f:  # for tests/gpu/kernel_diff.py
                json.dump({"tag": tag, "kernels": kernels}, f, indent=1)
    gpu = out["round_gpu_ms"] if "round_gpu_ms" in out else out["draft_gpu_ms"] * (n > 1) + out["verify_commit_gpu_ms"]
    out["idle_ms_per_round_sync"] = out["ms_per_round_sync"] - gpu
    out["idle_ms_per_round_lookahead"] = out["ms_per_round_lookahead"] - gpu
    return out


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "loop_profile.json"
    profile_dir = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None  # Inductor kernel tables
    # "fuse": Inductor only, unfused then fused projections (fusing changes the model's weight layout for
    # good, so the unfused runs go first).
    variants = [(True, False), (True, True)] if "fuse" in sys.argv[3:] else [(False, False), (True, False)]
    if "fused-only" in sys.argv[3:]:
        variants = [(True, True)]
    # DRAFT_VOCAB=8192: the shipped SmolLM2 head's draft vocabulary (default: the target's 49152, as before).
    if os.environ.get("SKINNY_TILES"):  # a skinny_sweep.py JSON: its winners join the measured table first
        from treecompile.ops.skinny_linear import register_tiles

        with open(os.environ["SKINNY_TILES"]) as f:
            print(f"registered {register_tiles(json.load(f))} swept shapes", flush=True)
    model, drafter = smollm2_target_and_head(int(os.environ.get("DRAFT_VOCAB", "0")) or None)
    results = []
    for inductor, fuse in variants:
        shapes = os.environ.get("SHAPES", "1,1,1;4,6,32")  # e.g. SHAPES="8,6,64" for one tree
        batches = [int(b) for b in os.environ.get("BATCHES", "1").split(",")]  # e.g. BATCHES=1,4,16
        for batch in batches:
            for shape in (tuple(int(x) for x in sh.split(",")) for sh in shapes.split(";")):
                try:
                    with torch.no_grad():
                        r = profile(model, drafter, shape, inductor, profile_dir=profile_dir if inductor else None,
                                    fuse=fuse, batch=batch)  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - report and go on to the next config
                    traceback.print_exc()
                    r = dict(shape=list(shape), batch=batch, inductor=inductor, fuse_projections=fuse, error=repr(exc))
                print(json.dumps(r), flush=True)
                results.append(r)
                with open(path, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
