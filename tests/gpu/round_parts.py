"""Eighth GPU session: the per-round kernels a SmolLM2 tree round pays beyond plain decode (GPU; random weights).

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic python3 tests/gpu/round_parts.py OUT_DIR [parts]

parts (default all): ``topk`` (draft_topk slice sweep), ``argmax`` (torch.argmax vs a two-stage Triton argmax
prototype), ``cascade`` (MIN_CHUNK at SmolLM2 head shapes); on request ``ab5`` (branch next/merged2: the
cache-write fold and skinny linears, alone and together, in one process). Every part writes
``OUT_DIR/<part>.json`` as it goes. The one-process A/Bs that timed the eighth and ninth sessions' round changes against the code before
them (``ab``, ``ab2``, ``ab3``: verbatim copies of the old code patched back in) were removed once those
changes merged; they are in this file at commit a663372.
"""

import json
import os
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

# These probes time the draft and the verify graphs apart: two graphs a round (the default; kept if unset).
os.environ.setdefault("TREECOMPILE_ROUND_GRAPHS", "2")

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/round_parts"
PARTS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["topk", "argmax", "cascade"]
os.makedirs(OUT, exist_ok=True)


def dump(name, obj):
    with open(f"{OUT}/{name}.json", "w") as f:
        json.dump(obj, f, indent=1, default=str)


def graph_us(fn, reps=20, iters=30):
    """Median microseconds of one ``fn`` call, ``reps`` calls captured back to back in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    times.sort()
    return times[len(times) // 2]


# ---------------------------------------------------------------------------------------------------------------


def part_topk():
    from treecompile.ops.draft_topk import _launch_draft_topk

    res = []
    for rows, vocab, k in ((1, 8192, 8), (8, 8192, 8), (4, 8192, 4), (32, 8192, 8), (1, 32000, 4),
                           (4, 32000, 4), (8, 32000, 8)):  # fmt: skip
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        ref = [torch.empty(rows, k, device="cuda"), torch.empty(rows, k, device="cuda", dtype=torch.int64)]
        _launch_draft_topk(logits, k, *ref)
        base = graph_us(lambda: _launch_draft_topk(logits, k, *ref))
        row = dict(rows=rows, vocab=vocab, k=k, default_us=base, configs=[])
        for block in (128, 256, 512, 1024, 2048, 4096):
            for warps in (1, 2, 4, 8):
                if warps * 32 > block:
                    continue
                out = [torch.full((rows, k), float("nan"), device="cuda"),
                       torch.full((rows, k), -1, device="cuda", dtype=torch.int64)]  # fmt: skip
                try:
                    _launch_draft_topk(logits, k, *out, block=block, num_warps=warps)
                    ok = torch.equal(out[1], ref[1]) and torch.allclose(out[0], ref[0], atol=1e-5, rtol=0)
                    us = graph_us(lambda: _launch_draft_topk(logits, k, *out, block=block, num_warps=warps))
                except Exception as exc:  # noqa: BLE001
                    row["configs"].append(dict(block=block, warps=warps, error=repr(exc)))
                    continue
                row["configs"].append(dict(block=block, warps=warps, us=us, ok=ok))
        best = min((c for c in row["configs"] if c.get("ok")), key=lambda c: c["us"])
        print(f"topk rows={rows} V={vocab} k={k}: default {base:.2f} us; best {best}", flush=True)
        res.append(row)
        dump("topk", res)
    return res


# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _argmax_slice(x_ptr, val_ptr, idx_ptr, vocab, nb, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inb = offs < vocab
    x = tl.load(x_ptr + row * stride + offs, mask=inb, other=float("-inf")).to(tl.float32)
    isn = x != x
    idx = tl.where(inb, offs, 2147483647)
    best = tl.max(tl.where(isn, float("-inf"), x), axis=0)
    sel_v = tl.min(tl.where(x == best, idx, 2147483647), axis=0)
    sel_n = tl.min(tl.where(isn, idx, 2147483647), axis=0)
    has_nan = sel_n < 2147483647
    tl.store(val_ptr + row * nb + blk, tl.where(has_nan, float("nan"), best))
    tl.store(idx_ptr + row * nb + blk, tl.where(has_nan, sel_n, sel_v))


@triton.jit
def _argmax_merge(val_ptr, idx_ptr, out_ptr, nb, BLOCK_NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCK_NB)
    inb = b < nb
    v = tl.load(val_ptr + row * nb + b, mask=inb, other=float("-inf"))
    i = tl.load(idx_ptr + row * nb + b, mask=inb, other=2147483647)
    isn = v != v
    best = tl.max(tl.where(isn, float("-inf"), v), axis=0)
    sel_v = tl.min(tl.where((v == best) & inb, i, 2147483647), axis=0)
    sel_n = tl.min(tl.where(isn, i, 2147483647), axis=0)
    tl.store(out_ptr + row, tl.where(sel_n < 2147483647, sel_n, sel_v).to(tl.int64))


@triton.jit
def _argmax_row(x_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    bidx = tl.full([BLOCK], 2147483647, tl.int32)
    nidx = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < vocab
        x = tl.load(x_ptr + row * stride + offs, mask=inb, other=float("-inf")).to(tl.float32)
        isn = x != x
        nidx = tl.minimum(nidx, tl.where(isn, offs, 2147483647))
        better = (x > best) & ~isn
        bidx = tl.where(better, offs, bidx)
        best = tl.where(better, x, best)
    m = tl.max(best, axis=0)
    sel_v = tl.min(tl.where(best == m, bidx, 2147483647), axis=0)
    sel_n = tl.min(nidx, axis=0)
    sel = tl.where(sel_n < 2147483647, sel_n, sel_v)
    tl.store(out_ptr + row, tl.where(sel == 2147483647, 0, sel).to(tl.int64))


def part_argmax():
    res = []
    for rows in (1, 64, 256):
        x = torch.randn(rows, 49152, device="cuda", dtype=torch.bfloat16)
        x[0, 1000] = x[0].max()  # a tie: first index wins
        ref = x.argmax(-1)
        base = graph_us(lambda: x.argmax(-1))
        row = dict(rows=rows, torch_us=base, configs=[])
        for block in (1024, 2048, 4096, 8192):
            nb = triton.cdiv(49152, block)
            val = torch.empty(rows, nb, device="cuda")
            idx = torch.empty(rows, nb, device="cuda", dtype=torch.int32)
            out = torch.full((rows,), -1, device="cuda", dtype=torch.int64)
            for warps in (4, 8):

                def run(block=block, nb=nb, val=val, idx=idx, out=out, warps=warps):
                    _argmax_slice[(rows, nb)](x, val, idx, 49152, nb, x.stride(0), BLOCK=block, num_warps=warps)
                    _argmax_merge[(rows,)](val, idx, out, nb, BLOCK_NB=triton.next_power_of_2(nb), num_warps=1)

                run()
                row["configs"].append(dict(kind="two-stage", block=block, warps=warps, ok=bool(torch.equal(out, ref)),
                                           us=graph_us(run)))  # fmt: skip
        for block in (1024, 2048, 4096):
            for warps in (4, 8):
                out = torch.full((rows,), -1, device="cuda", dtype=torch.int64)

                def run1(block=block, out=out, warps=warps):
                    _argmax_row[(rows,)](x, out, 49152, x.stride(0), BLOCK=block, num_warps=warps)

                run1()
                row["configs"].append(dict(kind="one-pass", block=block, warps=warps, ok=bool(torch.equal(out, ref)),
                                           us=graph_us(run1)))  # fmt: skip
        best = min((c for c in row["configs"] if c["ok"]), key=lambda c: c["us"])
        print(f"argmax rows={rows}: torch {base:.2f} us; best {best}", flush=True)
        res.append(row)
        dump("argmax", res)
    return res


# ---------------------------------------------------------------------------------------------------------------


def part_cascade():
    import treecompile.bench.attention as A
    from treecompile.ops._tree_attention_kernels import choose_config

    A.HQ, A.HKV, A.D = 9, 3, 64  # SmolLM2-135M
    gen = torch.Generator().manual_seed(1)
    res = []
    for N in (1, 8, 64):
        for P in (64, 256, 512, 900):
            point = A.Point(P, N, 30, gen)
            base = point.cascade()[0]()
            row = dict(N=N, P=P, configs=[])
            for cap in (1024, 2048):
                for mc in (None, 64, 128, 256):
                    extra = {} if mc is None else {"min_chunk": mc}
                    cfg = choose_config(1, N, 9, 3, 64, cap, torch.device("cuda"), None, **extra)
                    fns = point.cascade(cfg)
                    out = fns[0]()
                    ok = bool(torch.allclose(out.float(), base.float(), atol=2e-2, rtol=2e-2))

                    def run(fns=fns):
                        for f in fns:
                            f()

                    us = graph_us(run, reps=1) / len(fns)
                    row["configs"].append(dict(cap=cap, min_chunk=mc, us=us, ok=ok, cfg=cfg.__dict__))
                    print(f"cascade N={N} P={P} cap={cap} min_chunk={mc}: {us:.2f} us/layer ok={ok} "
                          f"splits={cfg.num_splits} chunk={cfg.min_chunk}", flush=True)  # fmt: skip
            res.append(row)
            dump("cascade", res)
    return res


# ---------------------------------------------------------------------------------------------------------------


def part_ab5():
    """The two unmeasured changes of branch next/merged2, alone and together, in one process: the cache
    write folded into the attention (pass fuse_cache_write, toggled in PASSES) and skinny_linears. (8, 6, 64)
    and plain decode graph times, kernel tables of "both", tokens compared with "main" (the fold is exact;
    skinny GEMMs round differently in bf16)."""
    import treecompile.passes as PS
    from treecompile.speculator import TreeSpeculator

    sys.path.insert(0, os.path.dirname(__file__))
    from loop_profile import gpu_ms, smollm2_target_and_head

    all_passes = list(PS.PASSES)
    ids = torch.randint(1, 49152, (1, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    names = {(0, 0): "main", (1, 0): "fold", (0, 1): "skinny", (1, 1): "both"}
    runs = [((8, 6, 64), v) for v in ((0, 0), (1, 0), (0, 1), (1, 1), (0, 0), (1, 1))]
    runs += [((1, 1, 1), v) for v in ((0, 0), (1, 0), (0, 1), (1, 1))]
    res = []
    for shape, (fold, skinny) in runs:
        name = names[(fold, skinny)]
        PS.PASSES[:] = [p for p in all_passes if fold or p is not PS.fuse_cache_write]
        model, drafter = smollm2_target_and_head()  # fresh: skinny_linears swaps the head's linears in place
        spec = None
        try:
            with torch.no_grad():
                torch._dynamo.reset()
                spec = TreeSpeculator(model, drafter, topk=shape[0], steps=shape[1], num_nodes=shape[2],
                                      max_batch_size=1, max_seq_len=512, prefill_chunk=64, inductor=True,
                                      fuse_projections=True, skinny_linears=bool(skinny))  # fmt: skip
                out = spec.generate(ids, max_new_tokens=48, eos_token_id=[])
                st = spec._new_state(1, [200], [ids[0].tolist()], [], 10_000)
                spec._prefill(st, 200)
                for _ in range(3):
                    spec._round(st)
                draft, verify = spec._graphs[1]
                r = dict(variant=name, shape=shape, tokens=out.sequences[0, 200:].tolist(),
                         draft_ms=gpu_ms(draft.replay, 100) if shape[2] > 1 else 0.0, verify_ms=gpu_ms(verify.replay, 100))
                tag = f"{name}_{shape[2]}"
                if name == "both" and not os.path.exists(f"{OUT}/verify_{tag}.txt"):
                    from torch.profiler import ProfilerActivity, profile as torch_profile

                    for gname, graph in (("draft", draft), ("verify", verify)):
                        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                            for _ in range(5):
                                graph.replay()
                            torch.cuda.synchronize()
                        with open(f"{OUT}/{gname}_{tag}.txt", "w") as f:
                            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=70,
                                                              max_name_column_width=90))  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            r = dict(variant=name, shape=shape, error=repr(exc))
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
        res.append(r)
        dump("ab5", res)
        del spec, model, drafter
        torch.cuda.empty_cache()
    PS.PASSES[:] = all_passes
    for shape in ((8, 6, 64), (1, 1, 1)):
        main_tokens = next((r["tokens"] for r in res if tuple(r["shape"]) == shape and r.get("variant") == "main"
                            and "tokens" in r), None)  # fmt: skip
        for r in res:
            if tuple(r["shape"]) == shape and "tokens" in r and main_tokens is not None:
                r["tokens_equal_main"] = f"{sum(a == b for a, b in zip(r['tokens'], main_tokens))}/{len(main_tokens)}"
        summary = [(r["variant"], r.get("tokens_equal_main")) for r in res if tuple(r["shape"]) == shape]
        print(f"{shape}: tokens equal to main: {summary}", flush=True)
    dump("ab5", res)


def main():
    for part in PARTS:
        t0 = time.time()
        try:
            if part == "topk":
                part_topk()
            elif part == "argmax":
                part_argmax()
            elif part == "cascade":
                part_cascade()
            elif part == "ab5":
                part_ab5()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        print(f"== part {part} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
