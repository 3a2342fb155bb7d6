"""treespec::skinny_linear against cuBLAS (F.linear) on cold weights, per shape a round runs (H200, bf16).

A forward streams every weight once, so each timing here runs one CUDA graph that calls the GEMM over
enough distinct weight copies to exceed the 50 MB L2 twice (the weights come from HBM, as in a round), and
reports the time per call. Shapes: SmolLM2-135M's target (fused qkv and gate/up, o, down, LM head) at 1
and 64 rows, its shipped head at 1 and 8 rows (8k vocabulary), the 8B Llama's at 1, 4 and 64 rows. Per
shape: cuBLAS, the default tiles (`choose_skinny_config`), and the best of a tile sweep; every config
checked against F.linear first.

    python3 tests/gpu/skinny_sweep.py out.json [quick|full|smoke]   # 6 / 24 (default) / 144 tile configs a shape
    python3 tests/gpu/skinny_sweep.py out.json gemv|gemv-smoke

``gemv``: only the shapes of <= 8 rows; per shape cuBLAS, the MMA kernel with the shipped table's tiles (or
the default), the gemv (multiply-add) kernel over its tile grid, and the three best gemv tiles again as
programmatic dependent launches (each call's programs start while the previous call drains). Rows carry
``best.kind`` ("dot" / "gemv" / "gemv_pdl") for ``register_tiles``.

    python3 tests/gpu/skinny_sweep.py out.json splitk|splitk-smoke [ROWS]      # ROWS: "1,4,64" (default)

``splitk``: the 8B layer and head shapes at ROWS rows (not the target's LM head), biggest first; per shape cuBLAS, the
shipped choice (the table's tiles, or the default), then split-K (2-8 splits a slice) over the shipped tiles,
a wider and a narrower slice, and for <= 8 rows the gemv kernel as a dependent launch. Rows carry
``best.split_k``.

    python3 tests/gpu/skinny_sweep.py out.json rows|rows-smoke [ROWS]   # ROWS: "96,128,256" (default)

    python3 tests/gpu/skinny_sweep.py out.json mid|mid-smoke [ROWS]   # ROWS: "4,16,32" (default)

``mid``: the row counts one batch-1 round runs between the swept 1, 8 and 64: draft lanes of K = 4 (and a
batch-4 decode), the verify of a (4, 4, 16) tree (16 rows) and of a (4, 6, 32) one (32). SmolLM2's target
shapes and the shipped head's (q/k/v over its 2 x 576 input, fc, the 12288-id LM head); per shape cuBLAS, the
shipped choice, MMA tiles over 1-4 splits of K, and for <= 16 rows the gemv kernel as a dependent launch.

    python3 tests/gpu/skinny_sweep.py out.json pipe|pipe-smoke [ROWS] [LABEL]   # ROWS: "1,4" (default); LABEL:
                                                                               # only labels holding it ("8b")

``pipe``: the gemv kernel with its compiler-pipelined loop (``pipeline=True``: async copies, NUM_STAGES - 1 tiles
in flight, where the register double buffer has one and compiles to no async copy) as a dependent launch, over
slices, steps, warps and 3-6 stages, against cuBLAS and the shipped choice: the 8B layer and head shapes, then
SmolLM2's target and shipped head, at ROWS rows, biggest weights first. Rows carry ``best.pipeline``.

    python3 tests/gpu/skinny_sweep.py out.json tma|tma-smoke [ROWS] [LABEL]   # ROWS: "16,64" (default); LABEL:
                                                                             # labels holding it ("8b down|8b o")

``tma``: the MMA tiles with the weight as TMA boxes (``tma=True``), against the same tiles through pointers,
cuBLAS and the shipped choice: the 8B layer shapes, the 8B LM head and the head's, at ROWS rows (a 16-node and
a 64-node verify), biggest weights first, over slices of 32-256 features, 64-256-wide K steps, 3-4 stages (those
that fit shared memory). Rows carry ``best.tma``.

    python3 tests/gpu/skinny_sweep.py out.json wide|wide-smoke [ROWS] [LABEL]   # ROWS: "64" (default); LABEL:
                                                                               # labels holding it ("8b o|8b down")

``wide``: wide output slices (64-256 features) with K split over 2-8 programs a slice, against the shipped
choice and cuBLAS: the 8B layer shapes at ROWS rows. Why: a program of the MMA tiles rereads all its rows of x
(64 x K) from L2 for every slice, so the 64-row o (32-wide slices) and down read 2x their weight's bytes again
in x, and run 1.16-1.33x their weight-read floor where the 1-row gemv runs ~1.05-1.2x; a slice 4x as wide
split 4 ways keeps the program count and reads a quarter of that x. Rows carry ``best.split_k``; a split-K
entry also serves ``skinny_linear_norm_out`` (the verify's o and down). The shipped choice is timed first. On a
slower H100 (fifty-fifth session) it won both shapes: the idea did not hold there.

``rows``: a batch of trees' verify (65-256 rows, the fourth band): SmolLM2's target shapes and LM head at ROWS
rows; per shape cuBLAS, the default row blocks of 64, and a sweep over the row block too (32 / 64 / 128). Rows
carry ``best.block_m``, which ``register_tiles`` keeps for that band.
"""

import dataclasses
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

from paired_sweep import SMEM_LIMIT  # bytes of shared memory a program may hold on sm_90
from treecompile.ops.skinny_linear import (
    GEMV_MAX_ROWS, _launch_skinny_linear, choose_skinny_config, gemv_config, measured_tiles,
)

SMOL = [("smol qkv", 960, 576), ("smol o", 576, 576), ("smol gate_up", 3072, 576), ("smol down", 576, 1536)]
SMOL_HEAD = [("head fc", 576, 1728), ("head lm", 8192, 576)]
# The shipped head (treecompile/heads/smollm2): q/k/v fused over [embedding, hidden] (2 x 576), 12288 ids.
SMOL_HEAD_SHIPPED = [("head qkv", 960, 1152), ("head fc", 576, 1728), ("head lm", 12288, 576)]
LLAMA8B = [("8b qkv", 6144, 4096), ("8b o", 4096, 4096), ("8b gate_up", 28672, 4096), ("8b down", 4096, 14336)]
CASES = [(m, *s) for m in (1, 64) for s in SMOL] + [(m, *s) for m in (1, 8) for s in SMOL + SMOL_HEAD]
CASES += [(1, "smol lm_head", 49152, 576), (64, "smol lm_head", 49152, 576)]
LLAMA8B_HEAD = [("8b head fc", 4096, 12288), ("8b head lm", 32000, 4096)]
CASES += [(m, *s) for m in (1, 4, 64) for s in LLAMA8B]
CASES += [(m, *s) for m in (1, 4) for s in LLAMA8B_HEAD] + [(m, "8b lm_head", 128256, 4096) for m in (1, 64)]
L2_BYTES = 50 * 2**20


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
DEVICE = "cuda"
DTYPE = torch.bfloat16


def graph_us(fn, copies: int, reps: int = 10) -> float:
    """Per-call us of ``fn(i)`` for i over the copies, captured as one graph, median of 5 timings."""
    if DEVICE == "cpu":  # smoke: the control flow and the JSON, no timing worth the name
        t = time.perf_counter()
        for i in range(copies):
            fn(i)
        return (time.perf_counter() - t) * 1e6 / copies
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * copies))
    return sorted(times)[2]


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "skinny_sweep.json"
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    quick, full = mode == "quick", mode in ("full", "smoke")
    gemv = mode in ("gemv", "gemv-smoke")
    splitk = mode in ("splitk", "splitk-smoke")
    batch_rows = mode in ("rows", "rows-smoke")
    mid = mode in ("mid", "mid-smoke")
    pipe = mode in ("pipe", "pipe-smoke")
    tma = mode in ("tma", "tma-smoke")
    wide = mode in ("wide", "wide-smoke")
    cases = CASES
    if wide:  # argv[3]: the row counts (default 64); argv[4]: a label filter; the biggest weights first
        rows = [int(m) for m in (sys.argv[3] if len(sys.argv) > 3 else "64").split(",")]
        shapes = LLAMA8B
        if len(sys.argv) > 4:  # "|" separates alternatives: "8b o|8b down"
            shapes = [sh for sh in shapes if any(part in sh[0] for part in sys.argv[4].split("|"))]
        cases = [(m, *sh) for m in rows for sh in sorted(shapes, key=lambda sh: -sh[1] * sh[2])]
    if tma:  # argv[3]: the row counts (default 16,64); argv[4]: a label filter; the biggest weights first
        rows = [int(m) for m in (sys.argv[3] if len(sys.argv) > 3 else "16,64").split(",")]
        shapes = LLAMA8B + LLAMA8B_HEAD + [("8b lm_head", 128256, 4096)]
        if len(sys.argv) > 4:  # "|" separates alternatives: "8b down|8b qkv"
            shapes = [sh for sh in shapes if any(part in sh[0] for part in sys.argv[4].split("|"))]
        cases = [(m, *sh) for m in rows for sh in sorted(shapes, key=lambda sh: -sh[1] * sh[2])]
    if pipe:  # argv[3]: the row counts (default 1,4); the biggest weights first within a row count
        rows = [int(m) for m in (sys.argv[3] if len(sys.argv) > 3 else "1,4").split(",")]
        shapes = LLAMA8B + LLAMA8B_HEAD + SMOL + SMOL_HEAD_SHIPPED
        if len(sys.argv) > 4:  # a label filter, e.g. "8b" for a short device call
            shapes = [sh for sh in shapes if sys.argv[4] in sh[0]]
        cases = [(m, *sh) for m in rows for sh in sorted(shapes, key=lambda sh: -sh[1] * sh[2])]
    if mid:  # argv[3]: the row counts (default 4,16,32); the biggest weights first within a row count
        rows = [int(m) for m in (sys.argv[3] if len(sys.argv) > 3 else "4,16,32").split(",")]
        cases = [(m, *sh) for m in rows for sh in sorted(SMOL + SMOL_HEAD_SHIPPED, key=lambda sh: -sh[1] * sh[2])]
    if batch_rows:  # argv[3]: the row counts (default 96,128,256: 4 x 24, 4 x 32 / 16 x 8, 16 x 16 nodes)
        rows = [int(m) for m in (sys.argv[3] if len(sys.argv) > 3 else "96,128,256").split(",")]
        cases = [(m, *sh) for m in rows for sh in SMOL + [("smol lm_head", 49152, 576)]]
    if splitk:  # argv[3]: the row counts to sweep (default 1,4,64)
        rows = [int(m) for m in (sys.argv[3] if len(sys.argv) > 3 else "1,4,64").split(",")]
        cases = sorted((c for c in CASES if c[0] in rows and c[1].startswith("8b") and c[1] != "8b lm_head"),
                       key=lambda c: -c[2] * c[3])  # fmt: skip
    if gemv:  # the biggest weights first: a sweep cut short by the device's time limit keeps the 8B shapes
        cases = sorted((c for c in CASES if c[0] <= GEMV_MAX_ROWS), key=lambda c: -c[2] * c[3])
    if mode in ("smoke", "gemv-smoke", "splitk-smoke", "rows-smoke", "mid-smoke", "pipe-smoke", "tma-smoke",
                "wide-smoke"):  # the CPU interpreter (TRITON_INTERPRET=1): two tiny shapes, every config path
        global DEVICE, DTYPE, L2_BYTES
        # float16: the interpreter's tl.dot misreads bfloat16 operands (Triton 3.x; the GPU is unaffected)
        DEVICE, DTYPE, L2_BYTES, cases = "cpu", torch.float16, 4096, [(1, "smoke a", 40, 72), (20, "smoke b", 24, 64)]
        if gemv:
            cases = [(1, "smoke a", 40, 72), (3, "smoke c", 24, 64)]
        if batch_rows:
            cases = [(70, "smoke r", 24, 64)]
        if mid:
            cases = [(4, "smoke m", 40, 72), (16, "smoke n", 24, 64)]
        if pipe:
            cases = [(1, "smoke p", 40, 72), (3, "smoke q", 24, 64)]
        if tma:
            cases = [(16, "smoke t", 40, 72), (64, "smoke u", 24, 64)]
        if wide:
            cases = [(64, "smoke w", 40, 96), (20, "smoke x", 24, 64)]
    torch.manual_seed(0)
    results = []
    t0 = time.time()
    for M, label, N, K in cases:
        wbytes = N * K * 2
        copies = max(2, min(64, -(-4 * L2_BYTES // wbytes)))
        ws = [torch.randn(N, K, device=DEVICE, dtype=DTYPE) / K**0.5 for _ in range(copies)]
        x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
        outs = [torch.empty(M, N, device=DEVICE, dtype=DTYPE) for _ in range(copies)]
        want = F.linear(x.float(), ws[0].float())
        row = dict(M=M, label=label, N=N, K=K, copies=copies)
        row["cublas_us"] = graph_us(lambda i: torch.mm(x, ws[i].t(), out=outs[i]), copies)
        default = (measured_tiles(M, N, K) if gemv or splitk or mid or pipe or tma or wide else None) or choose_skinny_config(M, N, K)
        sweep = [default]
        grid = itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 4))  # 24 configs
        if full:
            grid = itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5))
        elif quick:
            grid = itertools.product((16, 32, 64), (128,), (4,), (3, 4))
        if gemv:
            # the [BLOCK_M, BLOCK_N, BLOCK_K] float32 accumulator: at most 16k elements (64 a thread at 8 warps)
            grid = [(bn, bk, w, st) for bn, bk, w, st in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (2, 3))
                    if max(1, 1 << (M - 1).bit_length()) * bn * bk <= 16384]  # fmt: skip
            if mode == "gemv-smoke":
                grid = [(4, 16, 4, 2), (8, 32, 4, 3)]
        if splitk:
            # around the shipped tiles: its slice, one twice as wide and one half as wide; the gemv kernel too
            # (as a dependent launch, its shipped form) for few rows. Each over 1-8 splits of K.
            base = choose_skinny_config(M, N, K) if default.gemv else default
            tiles = {(False, base.block_n, base.block_k, base.num_warps, base.num_stages)}
            tiles |= {(False, bn, base.block_k, base.num_warps, base.num_stages)
                      for bn in (base.block_n * 2, max(16, base.block_n // 2))}  # fmt: skip
            if M <= GEMV_MAX_ROWS:
                g = default if default.gemv else gemv_config(M, N, K)
                tiles.add((True, g.block_n, g.block_k, g.num_warps, g.num_stages))
            grid = []
            for (is_gemv, bn, bk, warps, stages), sk in itertools.product(sorted(tiles), (1, 2, 3, 4, 6, 8)):
                kw = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=sk)
                if is_gemv:
                    sweep.append(gemv_config(M, N, K, pdl=True, **kw))
                elif triton_cdiv(K, bk) >= sk:
                    sweep.append(choose_skinny_config(M, N, K, **kw))
            # L2 hints of the first weight tiles before the dependency wait, on the shipped choice
            for tiles_ahead in (2, 4, 8):
                sweep.append(dataclasses.replace(default, l2_prefetch=tiles_ahead))
        if mid:  # MMA tiles over 1-4 splits of K; the gemv kernel (dependent launch) where it takes the rows
            smoke_mid = mode == "mid-smoke"
            # ~24-36 tiles a shape (compiles dominate a sweep): 256-wide K steps only over K >= 1024, and the
            # splits at 3 stages only
            for bn, bk, stages, sk in itertools.product((16,) if smoke_mid else (16, 32, 64), (64,) if smoke_mid else (64, 128, 256),
                                                        (3,) if smoke_mid else (3, 4), (1, 2) if smoke_mid else (1, 2, 4)):  # fmt: skip
                if not smoke_mid and ((bk == 256 and K < 1024) or (sk > 1 and stages != 3)):
                    continue
                if bk <= max(16, 1 << (K - 1).bit_length()) and triton_cdiv(K, bk) >= sk:
                    sweep.append(choose_skinny_config(M, N, K, block_n=bn, block_k=bk, num_warps=4, num_stages=stages,
                                                      split_k=sk))  # fmt: skip
            if M <= GEMV_MAX_ROWS:
                # the [BLOCK_M, BLOCK_N, BLOCK_K] float32 accumulator: at most 16k elements
                gemv_grid = [(4, 16, 4, 2)] if smoke_mid else itertools.product((4, 8, 16), (128, 256, 512, 1024), (4, 8), (2, 3))
                for bn, bk, warps, stages in gemv_grid:
                    if max(1, 1 << (M - 1).bit_length()) * bn * bk <= 16384 and bk <= max(16, 1 << (K - 1).bit_length()):
                        sweep.append(gemv_config(M, N, K, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                                 pdl=True))  # fmt: skip
            grid = []
        if pipe:  # the pipelined gemv as a dependent launch; the accumulator at most 16k float32 elements
            smoke_pipe = mode == "pipe-smoke"
            pipe_grid = [(4, 16, 4, 3), (8, 32, 4, 4)] if smoke_pipe else itertools.product(
                (4, 8, 16), (256, 512, 1024), (4, 8), (3, 4, 6))  # fmt: skip
            for bn, bk, warps, stages in pipe_grid:
                if max(1, 1 << (M - 1).bit_length()) * bn * bk <= 16384 and bk <= max(16, 1 << (K - 1).bit_length()):
                    sweep.append(gemv_config(M, N, K, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                             pdl=True, pipeline=True))  # fmt: skip
            grid = []
        if tma:  # each tile through TMA boxes and through pointers (the box spans at most 256 a dim)
            # 256-wide K steps too (the H200's 64-row o won by 10% on them, forty-second session), where the
            # stages fit sm_90's shared memory
            tma_grid = [(16, 32, 3), (32, 64, 4)] if mode == "tma-smoke" else itertools.product(
                (32, 64, 128, 256), (64, 128, 256), (3, 4))  # fmt: skip
            for (bn, bk, stages), boxes in itertools.product(tma_grid, (True, False)):
                if bk <= max(16, 1 << (K - 1).bit_length()):
                    cfg = choose_skinny_config(M, N, K, block_n=bn, block_k=bk, num_warps=4, num_stages=stages,
                                               tma=boxes)  # fmt: skip
                    if stages * (cfg.block_m + bn) * bk * 2 <= SMEM_LIMIT:  # an x tile and a weight tile a stage
                        sweep.append(cfg)
            grid = []
        if wide:  # slices 64-256 wide over 2-8 splits of K, the stages that fit shared memory (~20 a shape)
            wide_grid = [(16, 16, 3, 2), (32, 32, 3, 2)] if mode == "wide-smoke" else [
                (bn, bk, stages, sk) for bn, bk, stages, sk in itertools.product((64, 128), (128, 256), (3, 4), (2, 4, 8))
            ] + [(256, 64, 3, sk) for sk in (4, 8)]  # fmt: skip
            for bn, bk, stages, sk in wide_grid:
                cfg = choose_skinny_config(M, N, K, block_n=bn, block_k=bk, num_warps=4, num_stages=stages, split_k=sk)
                if stages * (cfg.block_m + bn) * bk * 2 <= SMEM_LIMIT and triton_cdiv(K, bk) >= sk:
                    sweep.append(cfg)
            grid = []
        if batch_rows:  # the row block too; the other loop below then adds nothing
            block_ms = (32, 64) if mode == "rows-smoke" else (32, 64, 128)
            block_ns = (16,) if mode == "rows-smoke" else (16, 32, 64)
            for bm, bn, bk, stages in itertools.product(block_ms, block_ns, (64, 128), (3, 4)):
                if bk <= max(16, 1 << (K - 1).bit_length()):
                    sweep.append(choose_skinny_config(M, N, K, block_m=bm, block_n=bn, block_k=bk, num_warps=4,
                                                      num_stages=stages))  # fmt: skip
            grid = []
        for bn, bk, warps, stages in grid:
            if bk > max(16, 1 << (K - 1).bit_length()):
                continue
            kw = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            sweep.append(gemv_config(M, N, K, **kw) if gemv else choose_skinny_config(M, N, K, **kw))
        configs = []

        def kind(cfg):
            return "gemv_pdl" if cfg.pdl else "gemv" if cfg.gemv else "dot"

        def run(cfg):
            entry = dict(block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, warps=cfg.num_warps,
                         stages=cfg.num_stages, kind=kind(cfg), split_k=cfg.split_k,
                         l2_prefetch=cfg.l2_prefetch, pipeline=cfg.pipeline, tma=cfg.tma)  # fmt: skip
            try:
                _launch_skinny_linear(x, ws[0], None, outs[0], config=cfg)
                err = (outs[0].float() - want).abs().max().item()
                entry["max_err"] = err
                if not err < 0.05:
                    entry["error"] = "wrong result"
                else:
                    # constant weights, as a model's: a dependent launch may prefetch them
                    entry["us"] = graph_us(lambda i, cfg=cfg: _launch_skinny_linear(x, ws[i], None, outs[i], cfg, True), copies)
            except Exception as exc:  # noqa: BLE001  (resources a tile does not fit: recorded, the sweep goes on)
                entry["error"] = repr(exc)[:200]
            configs.append(entry)

        for cfg in dict.fromkeys(sweep):
            run(cfg)
        if gemv:  # the three best gemv tiles again, as dependent launches
            best_gemv = sorted((c for c in configs if "us" in c and c["kind"] == "gemv"), key=lambda c: c["us"])[:3]
            for c in best_gemv:
                run(gemv_config(M, N, K, block_n=c["block_n"], block_k=c["block_k"], num_warps=c["warps"],
                                num_stages=c["stages"], pdl=True))  # fmt: skip
        timed = [c for c in configs if "us" in c]
        row["default"] = configs[0]
        row["best"] = min(timed, key=lambda c: c["us"]) if timed else None
        row["top"] = sorted(timed, key=lambda c: c["us"])[:5]
        row["configs"] = len(configs)
        gbps = lambda us: round(wbytes / (us * 1e3), 1)  # noqa: E731  (GB/s of weight read)
        best = row["best"]["us"] if row["best"] else float("nan")
        print(f"{label:14s} M={M:3d} N={N:6d} K={K:6d} cuBLAS {row['cublas_us']:7.2f} us ({gbps(row['cublas_us'])} GB/s)"
              f"  default {configs[0].get('us', float('nan')):7.2f}  best {best:7.2f} ({gbps(best)} GB/s)"
              f"  {row['best']}  [{time.time() - t0:.0f} s]", flush=True)  # fmt: skip
        results.append(row)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        del ws, outs
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
