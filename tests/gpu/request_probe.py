"""Where a generate call's fixed cost goes (GPU; SmolLM2-135M shapes, random weights, so timing only).

The e2e bench's held-out prompts are 36-98 tokens and stop after ~150 new tokens on average, so what a request
costs besides its rounds (state reset, prefill, the final copies) is 5-15% of its wall time. For plain decode
and a tree this times, after a warm-up that compiles and captures: ``generate`` with ``max_new_tokens=1`` (no
rounds: the fixed cost alone) per prompt length, then its phases (``_new_state``, ``_prefill``) as host time
(launch) and synchronized wall time, and writes a host-side profile of one prefill.

    python3 tests/gpu/request_probe.py out.json [PROFILE_DIR]
"""

import sys
import time

import torch

from treecompile.speculator import TreeSpeculator

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from loop_profile import run_shapes, smollm2_target_and_head  # noqa: E402

LENGTHS = [36, 43, 63, 42, 94, 37, 45, 64, 41, 98, 38, 43]  # the 12 held-out prompts' token counts


def ms(fn, reps=5):
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def split(spec, ids, reps=5) -> dict:
    """Synchronized wall time of each step of ``generate(max_new_tokens=1)`` (best of ``reps``): the
    steps are wrapped on the instance, each synchronizing before and after."""
    names = ["_prompts", "_eos_ids", "_pad_id", "_new_state", "_prefill", "_run_rounds", "_results"]
    best = {}

    def wrap(name, fn):
        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = fn(*args, **kwargs)
            torch.cuda.synchronize()
            times[name] = times.get(name, 0.0) + (time.perf_counter() - t) * 1e3
            return r

        return timed

    for name in names:
        setattr(spec, name, wrap(name, getattr(spec, name)))
    spec.binding.check_projections = wrap("check_projections", spec.binding.check_projections)
    for _ in range(reps):
        times = {}
        torch.cuda.synchronize()
        t = time.perf_counter()
        spec.generate(ids, max_new_tokens=1, eos_token_id=[])
        torch.cuda.synchronize()
        times["total"] = (time.perf_counter() - t) * 1e3
        for k, v in times.items():
            best[k] = min(best.get(k, float("inf")), v)
    for name in names:
        delattr(spec, name)
    del spec.binding.check_projections
    return best


def probe(model, drafter, shape, profile_dir):
    k, s, n = shape
    spec = TreeSpeculator(model, drafter, topk=k, steps=s, num_nodes=n, max_batch_size=1, max_seq_len=1024,
                          prefill_chunk=64, inductor=True)  # fmt: skip
    gen = torch.Generator("cuda").manual_seed(0)
    prompts = {L: torch.randint(1, 49152, (1, L), device="cuda", generator=gen) for L in sorted(set(LENGTHS))}
    spec.generate(prompts[98], max_new_tokens=32, eos_token_id=[])  # warm-up: compile + capture
    for L in prompts:
        spec.generate(prompts[L], max_new_tokens=2, eos_token_id=[])
    out = dict(shape=list(shape), fixed_ms={}, two_ms={}, phases={})
    for L, ids in prompts.items():
        out["fixed_ms"][L] = ms(lambda: spec.generate(ids, max_new_tokens=1, eos_token_id=[]))
        # one round and the lookahead round launched after it: against fixed_ms, what stopping costs
        out["two_ms"][L] = ms(lambda: spec.generate(ids, max_new_tokens=2, eos_token_id=[]))
    for L in (43, 98):
        ids = prompts[L]
        lengths, plist = [L], [ids[0].tolist()]
        torch.cuda.synchronize()
        t = time.perf_counter()
        st = spec._new_state(1, lengths, plist, [], 1000)
        host_state = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        wall_state = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        spec._prefill(st, L)
        host_prefill = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        wall_prefill = (time.perf_counter() - t) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st = spec._new_state(1, lengths, plist, [], 1000)
        torch.cuda.synchronize()
        start.record()
        spec._prefill(st, L)
        end.record()
        torch.cuda.synchronize()
        out["phases"][L] = dict(host_new_state=host_state, wall_new_state=wall_state, host_prefill=host_prefill,
                                wall_prefill=wall_prefill, events_prefill=start.elapsed_time(end))  # fmt: skip
        spec._state = None
    out["split_ms"] = split(spec, prompts[43])
    if profile_dir:
        from torch.profiler import ProfilerActivity, profile

        ids = prompts[98]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            spec.generate(ids, max_new_tokens=1, eos_token_id=[])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=60)
        with open(f"{profile_dir}/request_{k}_{s}_{n}.txt", "w") as f:
            f.write(table)
    return out


def main():
    path = sys.argv[1]
    profile_dir = sys.argv[2] if len(sys.argv) > 2 else None
    model, drafter = smollm2_target_and_head()
    run_shapes(path, ((1, 1, 1), (4, 4, 16)), lambda shape: probe(model, drafter, shape, profile_dir))


if __name__ == "__main__":
    main()
