"""Eighth GPU session: the per-round kernels a SmolLM2 tree round pays beyond plain decode (GPU; random weights).

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic python3 tests/gpu/round_parts.py OUT_DIR [parts]

parts (default all): ``topk`` (draft_topk slice sweep), ``argmax`` (torch.argmax vs a two-stage Triton argmax
prototype), ``cascade`` (MIN_CHUNK at SmolLM2 head shapes), ``ab`` (draft / verify graph times with each change
toggled by a monkeypatch, kernel tables, the Inductor sources of the verify's rope kernels); ``ab2`` / ``ab3``
(the eighth / ninth sessions' A/Bs); ``ab4`` (``skinny_linears`` off / on); ``ab5`` (branch next/merged2: the
cache-write fold and skinny linears, alone and together).
Every part writes ``OUT_DIR/<part>.json`` as it goes.
"""

import glob
import json
import os
import shutil
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/round_parts"
PARTS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["topk", "argmax", "cascade", "ab"]
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


def rank_order_two_pass(scores):
    nan = torch.isnan(scores)
    key = torch.where(nan, torch.full_like(scores, float("inf")), 0.0 - scores)
    order = torch.sort(key, dim=-1, stable=True).indices
    nan_last = torch.sort(nan.gather(-1, order).to(torch.uint8), dim=-1, stable=True).indices
    return order.gather(-1, nan_last)


def part_ab(topk_best=None):
    import treecompile.draft_tree as DT
    import treecompile.ops.draft_topk as TK
    from treecompile.drafter import EagleDrafter
    from treecompile.speculator import TreeSpeculator

    sys.path.insert(0, os.path.dirname(__file__))
    from loop_profile import gpu_ms, smollm2_target_and_head

    one_sort, new_rope, new_slice = DT.rank_order, EagleDrafter.rope, TK.slice_config
    hf_rope = lambda self, x, p: self.rotary_emb(x, p)  # noqa: E731
    variants = [
        ("base", rank_order_two_pass, hf_rope, new_slice),
        ("one_sort", one_sort, hf_rope, new_slice),
        ("one_sort+rope", one_sort, new_rope, new_slice),
    ]
    if topk_best:
        variants.append(("one_sort+rope+topk", one_sort, new_rope, lambda r, v, k: topk_best.get((r, v), new_slice(r, v, k))))
    model, drafter = smollm2_target_and_head()
    ids = torch.randint(1, 49152, (1, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    res = []
    for name, rank, rope, slice_cfg in variants:
        DT.rank_order, EagleDrafter.rope, TK.slice_config = rank, rope, slice_cfg
        t0 = time.time()
        spec = None
        try:
            with torch.no_grad():
                spec = TreeSpeculator(model, drafter, topk=8, steps=6, num_nodes=64, max_batch_size=1, max_seq_len=1024,
                                      prefill_chunk=64, inductor=True, fuse_projections=True)  # fmt: skip
                out = spec.generate(ids, max_new_tokens=32, eos_token_id=[])
                st = spec._new_state(1, [300], [ids[0].tolist()], [], 10_000)
                spec._prefill(st, 300)
                for _ in range(3):
                    spec._round(st)
                draft, verify = spec._graphs[1]
                r = dict(variant=name, build_s=time.time() - t0, tokens=out.sequences[0, 300:].tolist(),
                         draft_ms=[gpu_ms(draft.replay, 50) for _ in range(3)],
                         verify_ms=[gpu_ms(verify.replay, 50) for _ in range(3)])  # fmt: skip
                from torch.profiler import ProfilerActivity, profile as torch_profile

                for gname, graph in (("draft", draft), ("verify", verify)):
                    if gname == "verify" and name != "base":
                        continue
                    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            graph.replay()
                        torch.cuda.synchronize()
                    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=70, max_name_column_width=90)
                    with open(f"{OUT}/{gname}_{name}.txt", "w") as f:
                        f.write(table)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            r = dict(variant=name, error=repr(exc))
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
        res.append(r)
        dump("ab", res)
        del spec
        torch.cuda.empty_cache()
    same = len({tuple(r.get("tokens", [])) for r in res}) == 1
    print("tokens identical across variants:", same, flush=True)
    res.append(dict(tokens_identical=same))
    dump("ab", res)
    # The Inductor sources of the kernels named in the tables (rope / sort kernels).
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache:
        os.makedirs(f"{OUT}/kernels", exist_ok=True)
        keys = ("bmm_cat_cos", "sort")
        for path in glob.glob(f"{cache}/**/*.py", recursive=True):
            try:
                text = open(path).read()
            except OSError:
                continue
            if "@triton.jit" in text and any(k in text for k in keys) and len(text) < 60_000:
                shutil.copy(path, f"{OUT}/kernels/{os.path.basename(path)}")
    return res


def old_choose_config(new):
    """The cascade's split rule before this session: 256-key chunks for every compute-heavy row count, splits
    capped by the capacity's tiles."""
    import dataclasses

    def choose(B, R, Hq, Hkv, D, capacity, device, num_splits=None, itemsize=2, **override):
        cfg = new(B, R, Hq, Hkv, D, capacity, device, num_splits, itemsize, **override)
        if num_splits is not None or override:
            return cfg
        from treecompile.ops._tree_attention_kernels import _num_sms, resident_ctas_per_sm

        rows = R * (Hq // Hkv)
        nrb = -(-rows // cfg.block_m)
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        ns = max(1, resident_ctas_per_sm(cfg.block_m, cfg.num_warps) * sms // (B * Hkv * nrb))
        ns = max(1, min(ns, -(-capacity // cfg.block_n), 128))
        mc = cfg.block_n if rows <= 128 else max(256, 4 * cfg.block_m)
        return dataclasses.replace(cfg, num_splits=ns, min_chunk=mc)

    return choose


def part_ab2():
    """main's round (two-pass rank_order, HF rope, 2048-entry top-k slices, 256-key verify chunks, torch.argmax)
    against this session's, for the (8, 6, 64) tree and plain decode; kernel tables of the new rounds."""
    import treecompile.draft_tree as DT
    import treecompile.ops._tree_attention_kernels as KERN
    import treecompile.ops.draft_topk as TK
    import treecompile.speculator as SP
    from treecompile.drafter import EagleDrafter
    from treecompile.speculator import TreeSpeculator

    sys.path.insert(0, os.path.dirname(__file__))
    from loop_profile import gpu_ms, smollm2_target_and_head

    new = dict(rank=DT.rank_order, rope=EagleDrafter.rope, slice=TK.slice_config, choose=KERN.choose_config,
               greedy=SP._greedy_tokens)  # fmt: skip
    old = dict(rank=rank_order_two_pass, rope=lambda self, x, p: self.rotary_emb(x, p),
               slice=lambda r, v, k: (2048, 4), choose=old_choose_config(KERN.choose_config),
               greedy=lambda logits: logits.argmax(-1))  # fmt: skip

    def use(v):
        DT.rank_order, EagleDrafter.rope, TK.slice_config = v["rank"], v["rope"], v["slice"]
        KERN.choose_config, SP._greedy_tokens = v["choose"], v["greedy"]

    model, drafter = smollm2_target_and_head()
    res = []
    for prompt in (200,):
        ids = torch.randint(1, 49152, (1, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        for shape in ((8, 6, 64), (1, 1, 1)):
            for name, v in (("main", old), ("new", new), ("main", old), ("new", new)):
                use(v)
                spec = None
                try:
                    with torch.no_grad():
                        spec = TreeSpeculator(model, drafter, topk=shape[0], steps=shape[1], num_nodes=shape[2],
                                              max_batch_size=1, max_seq_len=512,
                                              prefill_chunk=64, inductor=True, fuse_projections=True)  # fmt: skip
                        out = spec.generate(ids, max_new_tokens=32, eos_token_id=[])
                        st = spec._new_state(1, [prompt], [ids[0].tolist()], [], 10_000)
                        spec._prefill(st, prompt)
                        for _ in range(3):
                            spec._round(st)
                        draft, verify = spec._graphs[1]
                        r = dict(variant=name, shape=shape, prompt=prompt, tokens=out.sequences[0, prompt:].tolist(),
                                 draft_ms=gpu_ms(draft.replay, 100) if shape[2] > 1 else 0.0,
                                 verify_ms=gpu_ms(verify.replay, 100))  # fmt: skip
                        if name == "new" and not os.path.exists(f"{OUT}/verify_new_{shape[2]}.txt"):
                            from torch.profiler import ProfilerActivity, profile as torch_profile

                            for gname, graph in (("draft", draft), ("verify", verify)):
                                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                                    for _ in range(5):
                                        graph.replay()
                                    torch.cuda.synchronize()
                                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=70,
                                                                  max_name_column_width=90)  # fmt: skip
                                with open(f"{OUT}/{gname}_new_{shape[2]}.txt", "w") as f:
                                    f.write(table)
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    r = dict(variant=name, shape=shape, prompt=prompt, error=repr(exc))
                print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
                res.append(r)
                dump("ab2", res)
                del spec
                torch.cuda.empty_cache()
    use(new)
    groups = {}
    for r in res:
        groups.setdefault((r["prompt"], tuple(r["shape"])), set()).add(tuple(r.get("tokens", [])))
    same = all(len(g) == 1 for g in groups.values())
    print("tokens identical main vs new, per (prompt, shape):", same, flush=True)
    res.append(dict(tokens_identical=same))
    dump("ab2", res)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache:  # the verify's rope kernels (2.96 / 1.75 us at 64 rows against ~1.1 us at 1 row)
        import tarfile

        with tarfile.open(f"{OUT}/rope_kernels.tar.gz", "w:gz") as tar:
            for path in glob.glob(f"{cache}/**/*.py", recursive=True):
                try:
                    text = open(path).read()
                except OSError:
                    continue
                if "def triton_" in text and "bmm_cat_cos" in text and len(text) < 60_000:
                    tar.add(path, arcname=os.path.basename(path))


# ---------------------------------------------------------------------------------------------------------------
# ab3 (branch next/merged): main's draft round and select (copied verbatim from main at 646a0ab), the
# outer_products pass toggled in PASSES. Names the copies need:
from treecompile.draft_tree import _bit, rank_order  # noqa: E402,F401
from treecompile.drafter import DraftContext  # noqa: E402,F401
from treecompile.draft_tree import LaneState  # noqa: E402,F401


def draft_round_main(self, st) -> None:
    """Step 0 and the lanes; leaves the selected tree in the TreeSpec and ``tree_tokens``. A one-node tree
    (``num_nodes=1``: plain decoding through the same runtime) is just the root, the last verify's bonus
    token: nothing to draft, so the head does not run."""
    if self.num_nodes == 1:
        st["tree_tokens"].copy_(st["root"][:, None])
        return
    B, K, S = st["B"], self.topk, self.steps
    cache, drafter = self.draft_cache, self.draft_hooks
    vc, dvc = st["vc"], st["dvc"]
    context = DraftContext(history=st["history"], vc=vc, lane_tokens=st["lane_tokens"], step=0)
    pos0 = dvc[:, None] + st["rows_p"]
    valid0 = st["rows_p"] < st["pend_n"][:, None]
    slots0 = torch.where(valid0, cache.slots(pos0), cache.dummy_slot)
    hidden, logits = drafter.draft_step0(
        cache, st["pend_feat"], st["pend_tok"], torch.where(valid0, pos0, 0), slots0, dvc,
        torch.where(valid0, st["chain_p"], 0), st["pend_n"] - 1, context,
    )  # fmt: skip
    logp, tokens = drafter.score_candidates(logits, K)  # [B, K]
    if self.tree is not None:
        lanes = self.tree.begin(logp, tokens)
    else:
        lanes = LaneState(tokens=tokens, scores=logp, mask=torch.ones_like(tokens), candidate=torch.zeros_like(tokens),
                          parent_lane=torch.zeros_like(tokens), step=1)  # fmt: skip
        chain = [tokens[:, 0]]
    hidden = hidden[:, None, :]  # [B, 1, H]: the one step-0 row every step-1 lane continues
    H = hidden.shape[-1]
    for s in range(1, S):
        lane_slots = (s - 1) * K + st["rows_k"]
        st["lane_tokens"][:, (s - 1) * K : s * K].copy_(lanes.tokens)
        context = DraftContext(history=st["history"], vc=vc, lane_tokens=st["lane_tokens"], step=s)
        parent = hidden.gather(1, lanes.parent_lane[:, :, None].expand(B, K, H))
        hidden, logits = drafter.draft_lanes(
            cache, parent, lanes.tokens, (vc - 1 + s)[:, None].expand(B, K).contiguous(),
            cache.slots(vc[:, None] + lane_slots), vc, lanes.mask, self.lane_window, context,
        )  # fmt: skip
        logp, tokens = drafter.score_candidates(logits, K)  # [B, K, K]
        if self.tree is not None:
            lanes = self.tree.expand(lanes, logp, tokens)
        else:
            chain.append(tokens[:, 0, 0])
            mask = lanes.mask | (1 << s)
            lanes = LaneState(tokens=tokens[:, :, 0], scores=logp[:, :, 0], mask=mask,
                              candidate=lanes.candidate, parent_lane=lanes.parent_lane, step=s + 1)  # fmt: skip
    spec = st["spec"]
    if self.tree is not None:
        tree = self.tree.select(st["root"])
        spec.set_tree(tree)
        st["tree_tokens"].copy_(tree.tokens)
    else:
        drafted = torch.stack(chain, dim=1)[:, : self.num_nodes - 1]
        st["tree_tokens"].copy_(torch.cat([st["root"][:, None], drafted], dim=1))


def select_core_main(scores: list, tokens: list, parents: list, root_tokens, cand_depth, N: int, S: int):
    """The best N-1 of the recorded candidates, numbered depth first, best child first (select())."""
    cand_scores, cand_tokens, cand_parent = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
    B = cand_scores.shape[0]
    M = N - 1  # kept candidates
    device = root_tokens.device

    kept = rank_order(cand_scores)[:, :M]  # [B, M] candidate ids; position p = global rank p
    pos = torch.arange(M, dtype=torch.int64, device=device).expand(B, M)
    pos_of_cand = torch.full_like(cand_tokens, M).scatter_(1, kept, pos)  # M: not kept
    kept_parent = cand_parent.gather(1, kept)
    # Closure under parents (module docstring) makes every non-root parent a kept position.
    parent_pos = torch.where(kept_parent < 0, -1, pos_of_cand.gather(1, kept_parent.clamp(min=0)))
    kept_depth = cand_depth.expand(B, -1).gather(1, kept)

    # path[b, p, l-1]: rank of p's ancestor at depth l (p itself at its own depth), -1 past p's depth.
    # Depth-first, best-child-first order is the lexicographic order of these rank paths: two nodes
    # first differ at siblings, which the global rank orders like their scores.
    levels = torch.arange(1, S + 1, dtype=torch.int64, device=device)
    path = torch.full((B, M, S), -1, dtype=torch.int64, device=device)
    cur, cur_depth = pos, kept_depth
    for _ in range(S):
        path = torch.where(levels == cur_depth.unsqueeze(2), cur.unsqueeze(2), path)
        cur = torch.where(cur >= 0, parent_pos.gather(1, cur.clamp(min=0)), -1)
        cur_depth = cur_depth - 1

    perm = pos  # S stable sorts, deepest level first: LSD-radix order gives the lexicographic one
    for level in range(S - 1, -1, -1):
        key = path[:, :, level].gather(1, perm)
        perm = perm.gather(1, torch.sort(key, dim=1, stable=True).indices)

    node_of_pos = torch.empty_like(pos).scatter_(1, perm, pos + 1)  # kept position -> node index
    node_path = node_of_pos.gather(1, path.clamp(min=0).reshape(B, M * S)).view(B, M, S)
    node_bits = torch.where(path >= 0, _bit(node_path), 0)
    kept_mask = node_bits[:, :, 0]
    for level in range(1, S):
        kept_mask = kept_mask | node_bits[:, :, level]
    kept_mask = kept_mask | 1  # the root is everyone's ancestor

    parent_of_node = parent_pos.gather(1, perm)  # kept position of each node's parent, -1: the root
    parent_node = node_of_pos.gather(1, parent_of_node.clamp(min=0))
    parent_of_node = torch.where(parent_of_node >= 0, parent_node, 0)
    col0 = torch.zeros(B, 1, dtype=torch.int64, device=device)
    return (
        torch.cat([root_tokens.reshape(B, 1), cand_tokens.gather(1, kept.gather(1, perm))], 1),
        torch.cat([col0 - 1, parent_of_node], 1),
        torch.cat([col0, kept_depth.gather(1, perm)], 1),
        torch.cat([col0 + 1, kept_mask.gather(1, perm)], 1),
        torch.cat([col0 - 1, kept.gather(1, perm)], 1),
    )  # fmt: skip


def part_ab3():
    """main against the two branches, alone and together: (8, 6, 64) draft / verify graphs, plain verify."""
    import treecompile.draft_tree as DT
    import treecompile.passes as PS
    from treecompile.passes import outer_products
    from treecompile.speculator import TreeSpeculator

    sys.path.insert(0, os.path.dirname(__file__))
    from loop_profile import gpu_ms, smollm2_target_and_head

    new_draft, new_select = TreeSpeculator._draft_round, DT._select_core

    def use(rope: bool, glue: bool):
        if rope and outer_products not in PS.PASSES:
            PS.PASSES.insert(PS.PASSES.index(PS.fuse_projections), outer_products)
        if not rope and outer_products in PS.PASSES:
            PS.PASSES.remove(outer_products)
        TreeSpeculator._draft_round = new_draft if glue else draft_round_main
        DT._select_core = new_select if glue else select_core_main

    model, drafter = smollm2_target_and_head()
    ids = torch.randint(1, 49152, (1, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    res = []
    runs = [((8, 6, 64), r, g) for r, g in ((0, 0), (1, 1), (1, 0), (0, 1), (0, 0), (1, 1))]
    runs += [((1, 1, 1), r, r) for r in (0, 1, 0, 1)]
    for shape, rope, glue in runs:
        use(bool(rope), bool(glue))
        name = {(0, 0): "main", (1, 1): "all", (1, 0): "rope", (0, 1): "glue"}[(rope, glue)]
        spec = None
        try:
            with torch.no_grad():
                torch._dynamo.reset()  # the pass list is read at compile time
                spec = TreeSpeculator(model, drafter, topk=shape[0], steps=shape[1], num_nodes=shape[2],
                                      max_batch_size=1, max_seq_len=512, prefill_chunk=64, inductor=True,
                                      fuse_projections=True)  # fmt: skip
                out = spec.generate(ids, max_new_tokens=32, eos_token_id=[])
                st = spec._new_state(1, [200], [ids[0].tolist()], [], 10_000)
                spec._prefill(st, 200)
                for _ in range(3):
                    spec._round(st)
                draft, verify = spec._graphs[1]
                r = dict(variant=name, shape=shape, tokens=out.sequences[0, 200:].tolist(),
                         draft_ms=gpu_ms(draft.replay, 100) if shape[2] > 1 else 0.0, verify_ms=gpu_ms(verify.replay, 100))
                if name == "all" and not os.path.exists(f"{OUT}/verify_all_{shape[2]}.txt"):
                    from torch.profiler import ProfilerActivity, profile as torch_profile

                    for gname, graph in (("draft", draft), ("verify", verify)):
                        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                            for _ in range(5):
                                graph.replay()
                            torch.cuda.synchronize()
                        with open(f"{OUT}/{gname}_all_{shape[2]}.txt", "w") as f:
                            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=70,
                                                              max_name_column_width=90))  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            r = dict(variant=name, shape=shape, error=repr(exc))
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
        res.append(r)
        dump("ab3", res)
        del spec
        torch.cuda.empty_cache()
    use(True, True)
    groups = {}
    for r in res:
        groups.setdefault(tuple(r["shape"]), set()).add(tuple(r.get("tokens", [])))
    res.append(dict(tokens_identical=all(len(g) == 1 for g in groups.values())))
    print("tokens identical across variants, per shape:", res[-1]["tokens_identical"], flush=True)
    dump("ab3", res)


def part_ab4():
    """skinny_linears off / on, alternating in one process: (8, 6, 64) draft and verify graphs, plain decode
    (1, 1, 1), kernel tables of the skinny variant, and how many generated tokens agree (bf16: two GEMM
    kernels round differently, so agreement, not identity)."""
    from treecompile.speculator import TreeSpeculator

    sys.path.insert(0, os.path.dirname(__file__))
    from loop_profile import gpu_ms, smollm2_target_and_head

    res = []
    ids = torch.randint(1, 49152, (1, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = [((8, 6, 64), s) for s in (0, 1, 0, 1)] + [((1, 1, 1), s) for s in (0, 1, 0, 1)]
    for shape, skinny in runs:
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
                r = dict(skinny=skinny, shape=shape, tokens=out.sequences[0, 200:].tolist(),
                         draft_ms=gpu_ms(draft.replay, 100) if shape[2] > 1 else 0.0, verify_ms=gpu_ms(verify.replay, 100))
                tag = f"{'skinny' if skinny else 'cublas'}_{shape[2]}"
                if not os.path.exists(f"{OUT}/verify_{tag}.txt"):
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
            r = dict(skinny=skinny, shape=shape, error=repr(exc))
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
        res.append(r)
        dump("ab4", res)
        del spec, model, drafter
        torch.cuda.empty_cache()
    for shape in ((8, 6, 64), (1, 1, 1)):
        toks = {r["skinny"]: r["tokens"] for r in res if tuple(r["shape"]) == shape and "tokens" in r}
        if len(toks) == 2:
            same = sum(a == b for a, b in zip(toks[0], toks[1]))
            res.append(dict(shape=shape, tokens_equal=f"{same}/{len(toks[0])}"))
            print(f"{shape}: tokens equal skinny vs cuBLAS {same}/{len(toks[0])}", flush=True)
    dump("ab4", res)


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
    topk_best = None
    for part in PARTS:
        t0 = time.time()
        try:
            if part == "topk":
                res = part_topk()
                topk_best = {}
                for row in res:
                    if row["k"] == 8 or row["vocab"] == 32000:
                        best = min((c for c in row["configs"] if c.get("ok")), key=lambda c: c["us"])
                        topk_best[(row["rows"], row["vocab"])] = (best["block"], best["warps"])
            elif part == "argmax":
                part_argmax()
            elif part == "cascade":
                part_cascade()
            elif part == "ab":
                part_ab(topk_best)
            elif part == "ab2":
                part_ab2()
            elif part == "ab3":
                part_ab3()
            elif part == "ab4":
                part_ab4()
            elif part == "ab5":
                part_ab5()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        print(f"== part {part} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
