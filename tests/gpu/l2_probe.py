"""Is the draft round slower inside a request because the verify evicts the head from L2, and does an L2
persisting window over the head's weights win that back? (GPU; SmolLM2-135M shapes, random weights.)

The ninth session saw the draft graph run ~47 us slower inside a request than back to back (0.405 against 0.358
ms) and blamed the verify, which streams all 270 MB of the target through the 50 MB L2. This times the draft
graph (CUDA events around each replay) in four settings on one live request state:

* ``back_to_back``: draft replays only (its weights stay in L2);
* ``after_verify``: verify (+ commit) then draft, as a request runs;
* ``after_flush``: a 256 MB write then draft (L2 cold, no verify);
* ``touch``: the head's tensors packed into one buffer, read once (a sum) right before the draft, after a
  verify or a flush: does one streamed read bring the draft back to its back-to-back time?

The twentieth session's first run also tried an L2 persisting access-policy window over the packed head on
every kernel node of a draft graph (cudaGraphKernelNodeSetAttribute, set-aside 19.7 MB of the 37.5 MB
allowed): the draft after a verify stayed at 0.358 ms (notes/gpu-2026-12-02-s20.md), so it is not kept.

    python3 tests/gpu/l2_probe.py out.json [shape]
"""

import ctypes
import glob
import json
import os
import statistics
import sys

import torch

from treecompile.speculator import TreeSpeculator

# These probes time the draft and the verify graphs apart: two graphs a round (the default; kept if unset).
os.environ.setdefault("TREECOMPILE_ROUND_GRAPHS", "2")

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from loop_profile import smollm2_target_and_head  # noqa: E402


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch itself loaded (the nvidia wheel's libcudart)."""
    names = []
    for base in sys.path:
        names += glob.glob(os.path.join(base, "nvidia", "**", "libcudart.so*"), recursive=True)
    for name in names + ["libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("libcudart not found")


ATTR_L2_SIZE, ATTR_MAX_PERSIST, ATTR_MAX_WINDOW = 38, 108, 109


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: cudaError {rc}")


def device_attr(rt, attr) -> int:
    v = ctypes.c_int()
    check(rt.cudaDeviceGetAttribute(ctypes.byref(v), attr, torch.cuda.current_device()), f"attr {attr}")
    return v.value


def pack_tensors(module: torch.nn.Module) -> torch.Tensor:
    """Move every CUDA tensor the module's submodules hold (parameters, buffers, plain tensor attributes such
    as fused weights) into one byte buffer, in place (``set_`` keeps each tensor's identity, so compiled code
    that reads them by reference sees the new storage). Views of one storage stay views."""
    tensors, seen = [], set()
    for sub in module.modules():
        for t in list(sub._parameters.values()) + list(sub._buffers.values()) + list(vars(sub).values()):
            if isinstance(t, torch.Tensor) and t.is_cuda and id(t) not in seen:
                seen.add(id(t))
                tensors.append(t)
    storages = {}
    for t in tensors:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    offsets, total = {}, 0
    for ptr, st in storages.items():
        offsets[ptr] = total
        total += (st.nbytes() + 255) // 256 * 256
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    for ptr, st in storages.items():
        src = torch.empty(0, dtype=torch.uint8, device="cuda").set_(st)  # the storage's bytes
        flat[offsets[ptr] : offsets[ptr] + st.nbytes()].copy_(src)
    with torch.no_grad():
        for t in tensors:
            st = t.untyped_storage()
            base = offsets[st.data_ptr()]
            t.set_(flat.untyped_storage(), (base // t.element_size()) + t.storage_offset(), t.shape, t.stride())
    return flat


def timed(pairs, reps: int) -> dict:
    """``pairs``: [(name, fn)] replayed in turn ``reps`` times; CUDA-event time of each (ms), median and mean.
    Names starting with ``_`` are run, not reported."""
    marks = []
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True)]
        ev[0].record()
        for _, fn in pairs:
            fn()
            ev.append(torch.cuda.Event(enable_timing=True))
            ev[-1].record()
        marks.append(ev)
    torch.cuda.synchronize()
    out = {}
    for i, (name, _) in enumerate(pairs):
        if not name.startswith("_"):
            ts = [m[i].elapsed_time(m[i + 1]) for m in marks[2:]]  # the first reps warm the pattern up
            out[name] = dict(median=statistics.median(ts), mean=statistics.fmean(ts))
    return out


def main() -> None:
    path = sys.argv[1]
    shape = tuple(int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8,6,64").split(","))
    rt = cudart()
    info = dict(l2_bytes=device_attr(rt, ATTR_L2_SIZE), max_persisting_bytes=device_attr(rt, ATTR_MAX_PERSIST),
                max_window_bytes=device_attr(rt, ATTR_MAX_WINDOW), shape=list(shape))  # fmt: skip
    print(json.dumps(info), flush=True)
    model, drafter = smollm2_target_and_head(8192)
    k, s, n = shape
    spec = TreeSpeculator(model, drafter, topk=k, steps=s, num_nodes=n, max_batch_size=1, max_seq_len=1024,
                          prefill_chunk=64, inductor=True, fuse_projections=True)  # fmt: skip
    flat = pack_tensors(drafter)  # before the first compile and capture: every graph reads the packed buffer
    info["head_bytes"] = flat.numel()
    ids = torch.randint(1, 49152, (1, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        ref = spec.generate(ids, max_new_tokens=64, eos_token_id=[])  # compile + capture
        draft, verify = spec._graphs[1]
        junk = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

        def fresh():
            st = spec._new_state(1, [40], [ids[0].tolist()], [], 10_000)
            spec._prefill(st, 40)
            for _ in range(3):
                spec._round(st)
            return st

        results = dict(info=info)
        fresh()
        results["back_to_back"] = timed([("draft", draft.replay)], 60)
        fresh()
        results["after_verify"] = timed([("verify", verify.replay), ("draft", draft.replay)], 60)
        fresh()
        results["after_flush"] = timed([("_flush", lambda: junk.fill_(1)), ("draft", draft.replay)], 60)
        print(json.dumps(results), flush=True)

        # Warm L2 with the head's weights right before the draft: one streamed read of the packed buffer (an
        # int64 sum, ~20 MB) instead of each small kernel meeting its weights cold.
        words = flat.view(torch.int64)
        sink = torch.empty((), dtype=torch.int64, device="cuda")
        touch = lambda: torch.sum(words, dim=0, out=sink)  # noqa: E731
        fresh()
        results["touch_alone"] = timed([("touch", touch)], 60)
        fresh()
        results["flush_touch"] = timed([("_flush", lambda: junk.fill_(1)), ("touch", touch), ("draft", draft.replay)], 60)
        fresh()
        results["verify_touch"] = timed([("verify", verify.replay), ("touch", touch), ("draft", draft.replay)], 60)
        fresh()
        results["flush_twice"] = timed([("_flush", lambda: junk.fill_(1)), ("draft1", draft.replay),
                                        ("draft2", draft.replay)], 60)  # fmt: skip
    print(json.dumps(results), flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
