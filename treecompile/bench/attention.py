"""Tree attention benchmark (GPU): the cascade against flex_attention, dense-mask SDPA, a 1-token decode
and the roofline floors, side by side in one run.

    python -m treecompile.bench attention [--prefixes 1024,4096,16384,65536] [--nodes 16,64]
                                          [--json PATH] [--sweep]

Shapes (issue 3): B=1, Hq=32, Hkv=8, D=128, bf16, a random tree of N nodes after a prefix of P keys, K/V in
a paged cache (page size 64) for the cascade and contiguous for the others. Every variant is captured in a
CUDA graph; one replay is timed with device events (median of 60), after a 256 MiB read that leaves L2 clean
of the inputs; the host is too slow to time single launches. The floors are measured in the same run: K+V bytes
over the device-to-device copy bandwidth (bytes read + written), and ``4 * P * D * Hq * N`` FLOPs over the
rate of an 8192^3 bf16 matmul. ``--sweep`` times stage-1 tile configurations instead (tuning aid).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

import torch

logger = logging.getLogger(__name__)

B, HQ, HKV, D = 1, 32, 8, 128
PAGE = 64


_FLUSH: list[torch.Tensor] = []


def _flush_l2() -> None:
    """Evict the inputs from L2 by reading 256 MiB: the lines left behind are clean, so the timed kernel pays
    no write-back of someone else's dirty lines (do_bench's zero-fill flush leaves ~60 MB of them)."""
    if not _FLUSH:
        _FLUSH.extend([torch.ones(64 << 20, device="cuda"), torch.empty((), device="cuda")])
    torch.sum(_FLUSH[0], dim=0, out=_FLUSH[1])


def _time_graph(fn, reps: int = 60) -> tuple[float, bool]:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph, L2 flushed (clean) before each
    replay and timed with device events around the replay only. Falls back to eager launches (flag False)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    run, graphed = fn, True
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - report and time eagerly instead
        logger.warning("graph capture failed (%s); timing eagerly", exc)
        torch.cuda.synchronize()
        graphed = False
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(-5, reps):
        _flush_l2()
        if i >= 0:
            starts[i].record()
        run()
        if i >= 0:
            ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2], graphed


def measure_ceilings() -> dict:
    import triton.testing

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_mm = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    del a, b
    return {"copy_bytes_per_s": 2 * n / (t_copy * 1e-3), "bf16_flops_per_s": 2 * 8192**3 / (t_mm * 1e-3)}


def random_tree_masks(n: int, gen: torch.Generator) -> torch.Tensor:
    masks = []
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        masks.append((1 << i) | (masks[parent] if parent >= 0 else 0))
    return torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in masks], dtype=torch.int64)


class Problem:
    """One (P, N) point: a paged cache holding the prefix and the tree window, plus contiguous copies."""

    def __init__(self, P: int, N: int, max_keys: int, gen: torch.Generator) -> None:
        self.P, self.N = P, N
        dev = "cuda"
        self.max_pages = -(-max_keys // PAGE)
        num_slots = (1 + self.max_pages) * PAGE
        self.k_cache = torch.randn(num_slots, HKV, D, device=dev, dtype=torch.bfloat16)
        self.v_cache = torch.randn(num_slots, HKV, D, device=dev, dtype=torch.bfloat16)
        perm = torch.randperm(self.max_pages, generator=gen) + 1  # scattered pages, like a real pool
        self.page_table = perm.to(torch.int32).view(1, -1).to(dev)
        self.prefix_len = torch.tensor([P], device=dev)
        self.mask = random_tree_masks(N, gen).view(1, N).to(dev)
        self.q = torch.randn(B, N, HQ, D, device=dev, dtype=torch.bfloat16, generator=None)
        self.scale = D**-0.5
        L = P + N
        t = torch.arange(L, device=dev)
        slots = (self.page_table[0, t // PAGE].long() * PAGE + t % PAGE)
        # Contiguous [B, H, L, D] copies of the same keys for SDPA / flex.
        self.k = self.k_cache[slots].permute(1, 0, 2).unsqueeze(0).contiguous()
        self.v = self.v_cache[slots].permute(1, 0, 2).unsqueeze(0).contiguous()
        self.qh = self.q.transpose(1, 2).contiguous()  # [B, Hq, N, D]

    def cascade(self, config=None):
        if config is None:
            return lambda: torch.ops.treespec.tree_attention_paged(
                self.q, self.k_cache, self.v_cache, self.page_table, self.prefix_len, self.mask, PAGE, self.N,
                self.scale,
            )  # fmt: skip
        from treecompile.ops._tree_attention_kernels import launch_cascade

        return lambda: launch_cascade(
            self.q, self.k_cache, self.v_cache, self.page_table, self.prefix_len, self.mask, PAGE, self.N,
            self.scale, config=config,
        )  # fmt: skip

    def dense_mask(self) -> torch.Tensor:
        P, N = self.P, self.N
        j = torch.arange(N, device="cuda")
        bits = ((self.mask[0][:, None] >> j[None, :]) & 1).bool()  # [N, N]
        return torch.cat([torch.ones(N, P, dtype=torch.bool, device="cuda"), bits], dim=1)

    def sdpa_dense(self):
        F = torch.nn.functional
        mask = self.dense_mask()
        return lambda: F.scaled_dot_product_attention(
            self.qh, self.k, self.v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )

    def flex(self):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        P, N = self.P, self.N
        words = self.mask[0]

        def tree_mask_mod(b, h, q_idx, kv_idx):
            j = kv_idx - P
            bit = (words[q_idx] >> j.clamp(0, 63)) & 1
            return (kv_idx < P) | ((j >= 0) & (j < N) & (bit == 1))

        block_mask = create_block_mask(tree_mask_mod, B=None, H=None, Q_LEN=N, KV_LEN=P + N, device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda: compiled(self.qh, self.k, self.v, block_mask=block_mask, scale=self.scale, enable_gqa=True)

    def decode_ours(self):
        """A plain 1-token decode over the same prefix through the same kernels (R = 1, window of 1)."""
        q1 = self.q[:, :1].contiguous()
        one = torch.ones(1, 1, dtype=torch.int64, device="cuda")
        return lambda: torch.ops.treespec.tree_attention_paged(
            q1, self.k_cache, self.v_cache, self.page_table, self.prefix_len, one, PAGE, 1, self.scale
        )

    def decode_sdpa(self):
        F = torch.nn.functional
        q1 = self.qh[:, :, :1].contiguous()
        k, v = self.k[:, :, : self.P + 1], self.v[:, :, : self.P + 1]
        return lambda: F.scaled_dot_product_attention(q1, k, v, scale=self.scale, enable_gqa=True)


def _check(problem: Problem, out: torch.Tensor, label: str) -> float:
    """Relative error of ``out`` against SDPA in float32 with the dense mask."""
    F = torch.nn.functional
    G = HQ // HKV
    k = problem.k.float().repeat_interleave(G, dim=1)
    v = problem.v.float().repeat_interleave(G, dim=1)
    ref = F.scaled_dot_product_attention(problem.qh.float(), k, v, attn_mask=problem.dense_mask(), scale=problem.scale)
    ref = ref.transpose(1, 2)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not math.isfinite(err) or err > 2e-2:
        logger.error("%s: relative error %.3g", label, err)
    return err


def run_bench(prefixes, nodes, ceilings) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    for N in nodes:
        for P in prefixes:
            prob = Problem(P, N, P + N, gen)
            row = {"N": N, "P": P}
            kv_bytes = 2 * (P + N) * HKV * D * 2
            row["bw_floor_ms"] = kv_bytes / ceilings["copy_bytes_per_s"] * 1e3
            row["flop_floor_ms"] = 4 * P * D * HQ * N / ceilings["bf16_flops_per_s"] * 1e3
            row["floor_ms"] = max(row["bw_floor_ms"], row["flop_floor_ms"])
            out = prob.cascade()()
            row["err"] = _check(prob, out, f"cascade P={P} N={N}")
            row["cascade_ms"], _ = _time_graph(prob.cascade())
            row["decode_ours_ms"], _ = _time_graph(prob.decode_ours())
            row["decode_sdpa_ms"], _ = _time_graph(prob.decode_sdpa())
            for name, make in (("flex_ms", prob.flex), ("sdpa_dense_ms", prob.sdpa_dense)):
                try:
                    t0 = time.time()
                    row[name], graphed = _time_graph(make())
                    if not graphed:
                        row[name + "_note"] = "eager"
                    logger.info("%s P=%d N=%d: %.4f ms (%.1f s incl. compile)", name, P, N, row[name], time.time() - t0)
                except Exception as exc:  # noqa: BLE001 - e.g. flex NoValidChoicesError at N=64
                    row[name] = None
                    row[name + "_note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    logger.warning("%s failed at P=%d N=%d: %s", name, P, N, row[name + "_note"])
            rows.append(row)
            print(_fmt_row(row), flush=True)
            del prob
            torch.cuda.empty_cache()
    return rows


def _us(ms):
    return "fail" if ms is None else f"{ms * 1e3:.1f}"


def _x(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


HEADER = (
    "| P | N | cascade us | flex us | SDPA dense us | decode ours (R=1) us | decode SDPA us | floor us (bw / flop) "
    "| cascade / floor | flex / cascade | SDPA / cascade | cascade / decode ours | rel err |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _fmt_row(r) -> str:
    return (
        f"| {r['P']} | {r['N']} | {_us(r['cascade_ms'])} | {_us(r.get('flex_ms'))} | {_us(r.get('sdpa_dense_ms'))} "
        f"| {_us(r['decode_ours_ms'])} | {_us(r['decode_sdpa_ms'])} "
        f"| {_us(r['floor_ms'])} ({_us(r['bw_floor_ms'])} / {_us(r['flop_floor_ms'])}) "
        f"| {_x(r['cascade_ms'], r['floor_ms'])} | {_x(r.get('flex_ms'), r['cascade_ms'])} "
        f"| {_x(r.get('sdpa_dense_ms'), r['cascade_ms'])} | {_x(r['cascade_ms'], r['decode_ours_ms'])} "
        f"| {r['err']:.1e} |"
    )


def run_sweep(prefixes, nodes) -> list[dict]:
    """Time stage-1 configurations per point; prints the best few and checks each against the default."""
    import itertools

    from treecompile.ops._tree_attention_kernels import choose_config

    gen = torch.Generator().manual_seed(1)
    results = []
    for N in nodes:
        for P in prefixes:
            prob = Problem(P, N, P + N, gen)
            base = prob.cascade()()
            timed = []
            G = HQ // HKV
            chunks = (None, 1024) if P <= 4096 else (None,)
            for (block_m, warps), block_n, stages, split_mult, min_chunk in itertools.product(
                ((64, 4), (128, 8), (128, 4), (64, 8)), (64, 128), (2, 3, 4), (1, 2), chunks
            ):
                if block_m > max(16, N * G) or (N * G <= 64 and block_m == 128):
                    continue
                nrb = -(-N * G // block_m)
                splits = -(-132 * split_mult // (B * HKV * nrb))
                extra = {} if min_chunk is None else {"min_chunk": min_chunk}
                cfg = choose_config(B, N, HQ, HKV, D, prob.max_pages * PAGE, torch.device("cuda"), splits,
                                    block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                                    **extra)  # fmt: skip
                try:
                    out = prob.cascade(cfg)()
                    ok = torch.allclose(out.float(), base.float(), rtol=2e-2, atol=2e-2)
                    ms, _ = _time_graph(prob.cascade(cfg), reps=30)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                    logger.info("config %s failed: %s", cfg, type(exc).__name__)
                    continue
                timed.append((ms, ok, cfg))
            timed.sort(key=lambda x: x[0])
            default_ms, _ = _time_graph(prob.cascade(), reps=30)
            print(f"\nP={P} N={N}: default {default_ms * 1e3:.1f} us", flush=True)
            for ms, ok, cfg in timed[:6]:
                print(f"  {ms * 1e3:8.1f} us  ok={ok}  {cfg}", flush=True)
            results.append(
                {"P": P, "N": N, "default_ms": default_ms,
                 "best": [(ms, ok, cfg.__dict__) for ms, ok, cfg in timed[:6]]}
            )  # fmt: skip
            del prob
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treecompile.bench attention", description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", default="1024,4096,16384,65536")
    parser.add_argument("--nodes", default="16,64")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    parser.add_argument("--sweep", action="store_true", help="time stage-1 tile configurations instead")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("attention benchmark needs a CUDA device")
        return 2
    import treecompile  # noqa: F401  registers torch.ops.treespec

    prefixes = [int(x) for x in args.prefixes.split(",")]
    nodes = [int(x) for x in args.nodes.split(",")]
    if args.sweep:
        res = run_sweep(prefixes, nodes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return 0
    ceilings = measure_ceilings()
    print(
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; copy bandwidth "
        f"{ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write); bf16 matmul "
        f"{ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s\n",
        flush=True,
    )
    print(HEADER, flush=True)
    rows = run_bench(prefixes, nodes, ceilings)
    print("\n" + HEADER)
    for r in rows:
        print(_fmt_row(r))
    notes = [f"{r['P']}/{r['N']} {k}: {v}" for r in rows for k, v in r.items() if k.endswith("_note")]
    if notes:
        print("\nnotes: " + "; ".join(notes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "rows": rows}, f, indent=1)
    return 0
