"""Tree attention benchmark (GPU): the cascade against flex_attention, dense-mask SDPA, a 1-token decode
and the roofline floors, side by side in one run.

    python -m treecompile.bench attention [--prefixes 1024,4096,16384,65536] [--nodes 16,64] [--layers 16]
                                          [--json PATH] [--sweep]

Shapes (issue 3): B=1, Hq=32, Hkv=8, D=128, bf16, a random tree of N nodes after a prefix of P keys, K/V in
a paged cache (page size 64) for the cascade and contiguous for the others.

Timing, the main table ("per layer"): like the attention layers of one verify forward, L calls over L
distinct K/V caches (and queries) are captured back to back in ONE CUDA graph, and the replay time over L is
reported (median of the replays). A forward pays the graph launch once, not once per layer, and no layer
finds its cache in L2: L is raised until the L caches hold >= 4x the L2 size (L = 64 at a 1k prefix), and
L2 is also cleaned (a 256 MiB read) before each replay. The second table ("single call") is the older
method: one call captured alone and timed per replay, which adds the graph launch and first-wave latency
(~10 us on this host) to every point. Events bracket the replay only; the host is too slow to time single
launches.

The floors are measured in the same run: K+V bytes over the device-to-device copy bandwidth (bytes read +
written), and ``4 * P * D * Hq * N`` FLOPs over the rate of an 8192^3 bf16 matmul. Beside them, "read" times
the least any attention kernel can do per layer: one streaming read of the same K+V bytes (:func:`read_kv`,
one load per program and nothing else), with the same per-layer method. At short prefixes the bandwidth floor
is a few microseconds, and what a kernel pays to start, ramp up and drain inside the graph is not in it; the
read column measures that cost on this machine, so ``cascade / read`` says how much of the gap any kernel
could close. ``--sweep`` times
stage-1 tile and split configurations of the cascade with the same per-layer method (tuning aid).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

B, HQ, HKV, D = 1, 32, 8, 128
PAGE = 64
L2_MULTIPLE = 4  # the L caches of one replay hold at least this many L2s of K/V

_FLUSH: list[torch.Tensor] = []


def _flush_l2() -> None:
    """Evict the inputs from L2 by reading 256 MiB: the lines left behind are clean, so the timed kernel pays
    no write-back of someone else's dirty lines (do_bench's zero-fill flush leaves ~60 MB of them)."""
    if not _FLUSH:
        _FLUSH.extend([torch.ones(64 << 20, device="cuda"), torch.empty((), device="cuda")])
    torch.sum(_FLUSH[0], dim=0, out=_FLUSH[1])


def _time_graph(fns, reps: int = 40) -> tuple[float, bool]:
    """Median milliseconds of one replay of a CUDA graph that calls every ``fn`` in ``fns`` once, in order,
    L2 cleaned before each replay and device events around the replay only. Falls back to eager launches
    (flag False) where capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphed = True
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - report and time eagerly instead
        logger.warning("graph capture failed (%s); timing eagerly", exc)
        torch.cuda.synchronize()
        graphed = False

        def run():
            for fn in fns:
                fn()

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(-3, reps):
        _flush_l2()
        if i >= 0:
            starts[i].record()
        run()
        if i >= 0:
            ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2], graphed


@triton.jit
def _read_kernel(k_ptr, v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Program i reads elements ``[i * BLOCK, (i + 1) * BLOCK)`` of K and of V (both loads issued before
    either is used) and writes one float32 sum, so the read cannot be optimised away."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    k = tl.load(k_ptr + offs, mask=keep, other=0.0, eviction_policy="evict_first")
    v = tl.load(v_ptr + offs, mask=keep, other=0.0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0))


READ_BLOCK = 8192  # elements a program reads from each of K and V (2 x 16 KB in bf16 in flight at once)


def read_kv(k: torch.Tensor, v: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """One streaming read of the first ``n`` elements of ``k`` and of ``v`` (contiguous, same dtype): the
    least work any attention over those keys does. Returns ``[cdiv(n, READ_BLOCK)]`` float32 partial sums of
    ``k + v`` (into ``out`` when given, so a CUDA graph can hold it)."""
    if not (k.is_contiguous() and v.is_contiguous()) or k.dtype != v.dtype:
        raise ValueError(f"read_kv: k and v must be contiguous and of one dtype, got {k.dtype} and {v.dtype}")
    if not 0 < n <= min(k.numel(), v.numel()):
        raise ValueError(f"read_kv: n must be in 1..{min(k.numel(), v.numel())}, got {n}")
    grid = triton.cdiv(n, READ_BLOCK)
    if out is None:
        out = torch.empty(grid, dtype=torch.float32, device=k.device)
    elif out.numel() < grid or out.dtype != torch.float32:
        raise ValueError(f"read_kv: out must be float32 with >= {grid} elements, got {out.dtype} {out.numel()}")
    _read_kernel[(grid,)](k, v, out, n, BLOCK=READ_BLOCK, num_warps=8)
    return out


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
    return {
        "copy_bytes_per_s": 2 * n / (t_copy * 1e-3),
        "bf16_flops_per_s": 2 * 8192**3 / (t_mm * 1e-3),
        "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size,
    }


def kv_bytes(P: int, N: int) -> int:
    return 2 * (P + N) * HKV * D * 2


def layers_for(P: int, N: int, min_layers: int, l2_bytes: int) -> int:
    """Layers per replay: at least ``min_layers``, and enough (a multiple of 8) that the L caches hold
    ``L2_MULTIPLE`` L2s, so no layer's K/V can still sit in L2 from an earlier layer or replay."""
    need = math.ceil(L2_MULTIPLE * l2_bytes / kv_bytes(P, N))
    return max(min_layers, -(-need // 8) * 8)


def random_tree_masks(n: int, gen: torch.Generator) -> torch.Tensor:
    masks = []
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        masks.append((1 << i) | (masks[parent] if parent >= 0 else 0))
    return torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in masks], dtype=torch.int64)


class Point:
    """One (P, N) point of a verify forward: the request's page table, prefix length and tree mask, shared by
    every layer (as in a real forward), and per layer its own paged K/V cache, contiguous copies of the same
    keys (for SDPA / flex) and its own queries."""

    def __init__(self, P: int, N: int, num_layers: int, gen: torch.Generator) -> None:
        self.P, self.N, self.num_layers = P, N, num_layers
        dev = "cuda"
        self.max_pages = -(-(P + N) // PAGE)
        self.num_slots = (1 + self.max_pages) * PAGE  # page 0 is the dummy page
        perm = torch.randperm(self.max_pages, generator=gen) + 1  # scattered pages, like a real pool
        self.page_table = perm.to(torch.int32).view(1, -1).to(dev)
        self.prefix_len = torch.tensor([P], device=dev)
        self.mask = random_tree_masks(N, gen).view(1, N).to(dev)
        self.scale = D**-0.5
        t = torch.arange(P + N, device=dev)
        self.slots = self.page_table[0, t // PAGE].long() * PAGE + t % PAGE
        self.layers = [self._layer() for _ in range(num_layers)]

    def _layer(self) -> dict:
        dev = "cuda"
        k_cache = torch.randn(self.num_slots, HKV, D, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn(self.num_slots, HKV, D, device=dev, dtype=torch.bfloat16)
        q = torch.randn(B, self.N, HQ, D, device=dev, dtype=torch.bfloat16)
        return {
            "k_cache": k_cache,
            "v_cache": v_cache,
            "q": q,
            # Contiguous [B, H, L, D] copies of the same keys for SDPA / flex.
            "k": k_cache[self.slots].permute(1, 0, 2).unsqueeze(0).contiguous(),
            "v": v_cache[self.slots].permute(1, 0, 2).unsqueeze(0).contiguous(),
            "qh": q.transpose(1, 2).contiguous(),  # [B, Hq, N, D]
        }

    # Each variant: a list of one callable per layer.

    def cascade(self, config=None):
        if config is None:
            return [
                lambda x=x: torch.ops.treespec.tree_attention_paged(
                    x["q"], x["k_cache"], x["v_cache"], self.page_table, self.prefix_len, self.mask, PAGE,
                    self.N, self.scale,
                )  # fmt: skip
                for x in self.layers
            ]
        from treecompile.ops._tree_attention_kernels import launch_cascade

        return [
            lambda x=x: launch_cascade(
                x["q"], x["k_cache"], x["v_cache"], self.page_table, self.prefix_len, self.mask, PAGE, self.N,
                self.scale, config=config,
            )  # fmt: skip
            for x in self.layers
        ]

    def dense_mask(self) -> torch.Tensor:
        P, N = self.P, self.N
        j = torch.arange(N, device="cuda")
        bits = ((self.mask[0][:, None] >> j[None, :]) & 1).bool()  # [N, N]
        return torch.cat([torch.ones(N, P, dtype=torch.bool, device="cuda"), bits], dim=1)

    def sdpa_dense(self):
        F = torch.nn.functional
        mask = self.dense_mask()
        return [
            lambda x=x: F.scaled_dot_product_attention(
                x["qh"], x["k"], x["v"], attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            for x in self.layers
        ]

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

        def call(x, options):
            return compiled(x["qh"], x["k"], x["v"], block_mask=block_mask, scale=self.scale, enable_gqa=True,
                            kernel_options=options)  # fmt: skip

        options = None
        try:
            out = call(self.layers[0], options)  # compile (or fail) before timing
        except Exception as exc:  # noqa: BLE001 - Inductor's NoValidChoicesError
            # Under 128 query rows flex takes its decoding kernel, which puts a KV head's G query heads x N
            # rows in one block (256 at N = 64 with GQA 4) and finds no config that fits (torch 2.11 on the
            # H200; notes/attention.md, twelfth session); its main kernel tiles the query rows per head instead.
            logger.warning("flex P=%d N=%d: default kernel failed (%s); retrying with FORCE_USE_FLEX_ATTENTION",
                           P, N, type(exc).__name__)  # fmt: skip
            options = {"FORCE_USE_FLEX_ATTENTION": True}
            out = call(self.layers[0], options)
        self.flex_forced = options is not None
        self.flex_err = _check(self, out.transpose(1, 2), f"flex P={P} N={N}")
        return [lambda x=x: call(x, options) for x in self.layers]

    def decode_ours(self):
        """A plain 1-token decode over the same prefix through the same kernels (R = 1, window of 1)."""
        one = torch.ones(1, 1, dtype=torch.int64, device="cuda")
        q1 = [x["q"][:, :1].contiguous() for x in self.layers]
        return [
            lambda x=x, q=q: torch.ops.treespec.tree_attention_paged(
                q, x["k_cache"], x["v_cache"], self.page_table, self.prefix_len, one, PAGE, 1, self.scale
            )
            for x, q in zip(self.layers, q1)
        ]

    def read(self):
        """One streaming read of each layer's P + N keys and values (:func:`read_kv`): no attention at all."""
        n = (self.P + self.N) * HKV * D
        outs = [torch.empty(triton.cdiv(n, READ_BLOCK), dtype=torch.float32, device="cuda") for _ in self.layers]
        return [lambda x=x, o=o: read_kv(x["k_cache"], x["v_cache"], n, o) for x, o in zip(self.layers, outs)]

    def decode_sdpa(self):
        F = torch.nn.functional
        n = self.P + 1
        q1 = [x["qh"][:, :, :1].contiguous() for x in self.layers]
        return [
            lambda x=x, q=q: F.scaled_dot_product_attention(
                q, x["k"][:, :, :n], x["v"][:, :, :n], scale=self.scale, enable_gqa=True
            )
            for x, q in zip(self.layers, q1)
        ]


def _check(point: Point, out: torch.Tensor, label: str) -> float:
    """Relative error of layer 0's ``out`` against SDPA in float32 with the dense mask."""
    F = torch.nn.functional
    G = HQ // HKV
    x = point.layers[0]
    k = x["k"].float().repeat_interleave(G, dim=1)
    v = x["v"].float().repeat_interleave(G, dim=1)
    ref = F.scaled_dot_product_attention(x["qh"].float(), k, v, attn_mask=point.dense_mask(), scale=point.scale)
    ref = ref.transpose(1, 2)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not math.isfinite(err) or err > 2e-2:
        logger.error("%s: relative error %.3g", label, err)
    return err


VARIANTS = ("cascade", "flex", "sdpa_dense", "decode_ours", "decode_sdpa", "read")


def run_bench(prefixes, nodes, ceilings, min_layers: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    failed: dict[tuple[str, int], str] = {}  # (variant, N) -> note: a compile failure is not retried per prefix
    for N in nodes:
        for P in prefixes:
            L = layers_for(P, N, min_layers, ceilings["l2_bytes"])
            point = Point(P, N, L, gen)
            row = {"N": N, "P": P, "layers": L}
            row["bw_floor_ms"] = kv_bytes(P, N) / ceilings["copy_bytes_per_s"] * 1e3
            row["flop_floor_ms"] = 4 * P * D * HQ * N / ceilings["bf16_flops_per_s"] * 1e3
            row["floor_ms"] = max(row["bw_floor_ms"], row["flop_floor_ms"])
            row["err"] = _check(point, point.cascade()[0](), f"cascade P={P} N={N}")
            for name in VARIANTS:
                if (name, N) in failed:
                    row[name + "_ms"] = row[name + "_single_ms"] = None
                    row[name + "_note"] = "not retried: " + failed[name, N]
                    continue
                try:
                    t0 = time.time()
                    fns = getattr(point, name)()
                    layered, graphed = _time_graph(fns)
                    row[name + "_ms"] = layered / L
                    row[name + "_single_ms"], _ = _time_graph(fns[:1])
                    if not graphed:
                        row[name + "_note"] = "eager"
                    if name == "flex":
                        row["flex_err"] = point.flex_err
                        if point.flex_forced:
                            row["flex_note"] = "main kernel (FORCE_USE_FLEX_ATTENTION): the decoding kernel failed"
                    logger.info("%s P=%d N=%d: %.4f ms/layer (%.1f s incl. compile)", name, P, N,
                                row[name + "_ms"], time.time() - t0)  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - e.g. flex NoValidChoicesError at N=64
                    row[name + "_ms"] = row[name + "_single_ms"] = None
                    row[name + "_note"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
                    if name == "flex":
                        failed[name, N] = f"failed at P={P}"
                    logger.warning("%s failed at P=%d N=%d: %s", name, P, N, row[name + "_note"])
            rows.append(row)
            print(_fmt_row(row), flush=True)
            del point
            torch.cuda.empty_cache()
    return rows


def _us(ms):
    return "fail" if ms is None else f"{ms * 1e3:.1f}"


def _x(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


HEADER = (
    "| P | N | L | cascade us | flex us | SDPA dense us | decode ours (R=1) us | decode SDPA us "
    "| floor us (bw / flop) | read us | cascade / floor | cascade / read | flex / cascade | SDPA / cascade "
    "| cascade / decode ours | rel err |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)
HEADER_SINGLE = (
    "| P | N | cascade us | flex us | SDPA dense us | decode ours (R=1) us | decode SDPA us | cascade / floor "
    "| cascade / decode ours |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _fmt_row(r) -> str:
    """Per-layer numbers (L back-to-back layers in one graph)."""
    c = r["cascade_ms"]
    return (
        f"| {r['P']} | {r['N']} | {r['layers']} | {_us(c)} | {_us(r['flex_ms'])} | {_us(r['sdpa_dense_ms'])} "
        f"| {_us(r['decode_ours_ms'])} | {_us(r['decode_sdpa_ms'])} "
        f"| {_us(r['floor_ms'])} ({_us(r['bw_floor_ms'])} / {_us(r['flop_floor_ms'])}) | {_us(r.get('read_ms'))} "
        f"| {_x(c, r['floor_ms'])} | {_x(c, r.get('read_ms'))} | {_x(r['flex_ms'], c)} | {_x(r['sdpa_dense_ms'], c)} "
        f"| {_x(c, r['decode_ours_ms'])} | {r['err']:.1e} |"
    )


def _fmt_row_single(r) -> str:
    """Single-call numbers (one call alone in a graph: graph launch and first wave included)."""
    c = r["cascade_single_ms"]
    return (
        f"| {r['P']} | {r['N']} | {_us(c)} | {_us(r['flex_single_ms'])} | {_us(r['sdpa_dense_single_ms'])} "
        f"| {_us(r['decode_ours_single_ms'])} | {_us(r['decode_sdpa_single_ms'])} | {_x(c, r['floor_ms'])} "
        f"| {_x(c, r['decode_ours_single_ms'])} |"
    )


def kernel_resources() -> list[str]:
    """Registers, spills, shared memory and the resulting programs per SM of every compiled stage-1 kernel
    (checks :func:`resident_ctas_per_sm`'s estimate). Best effort: Triton's cache layout is internal."""
    from treecompile.ops._tree_attention_kernels import cascade_partial_kernel

    lines = []
    try:
        props = torch.cuda.get_device_properties(0)
        smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
        regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
        for entry in cascade_partial_kernel.device_caches.values():
            for k in entry[0].values():
                md = k.metadata
                warps, smem, regs = md.num_warps, md.shared, k.n_regs
                by_regs = regs_sm // max(1, regs * 32 * warps)
                by_smem = smem_sm // max(1, smem + 1024)  # 1 KB per block reserved by the driver
                consts = {}
                try:
                    names = cascade_partial_kernel.arg_names
                    consts = {names[i[0]]: v for i, v in k.src.constants.items() if names[i[0]].isupper()}
                except Exception:  # noqa: BLE001
                    pass
                tiles = {n: consts[n] for n in ("BLOCK_M", "BLOCK_N", "D") if n in consts}
                lines.append(
                    f"{tiles} warps={warps} stages={md.num_stages} regs={regs} spills={k.n_spills} "
                    f"smem={smem} -> programs/SM by regs {by_regs}, by smem {by_smem}, by warps {64 // warps}"
                )
    except Exception as exc:  # noqa: BLE001
        lines.append(f"(kernel resources unavailable: {type(exc).__name__}: {exc})")
    return lines


def run_sweep(prefixes, nodes, min_layers: int, l2_bytes: int, min_chunks=(None,)) -> list[dict]:
    """Per-layer time of stage-1 configurations (tiles, stages, split counts, minimum keys per split) at
    each point, each checked against the default config's output. Split counts: the default rule, one and
    two full waves of 1- or 2-resident programs, and the older ``cdiv(2 * SMs, programs per split)`` rule;
    for few rows (< 128 a KV head: decode, draft lanes, N <= 16 verify) also three and four programs an SM,
    with the smaller tiles that let that many stay resident (64 x 32 keys, two or three stages), and 64 rows
    on two warpgroups: at 16k N = 16 the default (two programs an SM of 64 x 64) ran 1.77x its floor while a
    bare read of the same bytes ran 1.05x (thirty-seventh session), so per-program latency, not bandwidth,
    is what is left there. ``min_chunks``: the MIN_CHUNK values to try (None: the config's default)."""
    from treecompile.ops._tree_attention_kernels import choose_config

    gen = torch.Generator().manual_seed(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for N in nodes:
        rows = N * (HQ // HKV)
        # (128, 64, 8, s): two warpgroups of 64 rows share each K/V tile (half the L2 reads of 64-row blocks),
        # 240 registers a thread, one program an SM (ptxas for sm_90a on the CPU machine); not swept before.
        tiles = ((128, 64, 4, 4), (128, 64, 4, 3), (128, 32, 4, 4), (128, 128, 8, 3), (64, 64, 4, 3),
                 (128, 64, 8, 2), (128, 64, 8, 3))
        if rows < 128:
            tiles = ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (64, 32, 4, 2), (64, 64, 8, 3))
        for P in prefixes:
            L = layers_for(P, N, min_layers, l2_bytes)
            point = Point(P, N, L, gen)
            base = point.cascade()[0]()
            default_ms = _time_graph(point.cascade())[0] / L
            cap = point.max_pages * PAGE
            timed = []
            for block_m, block_n, warps, stages in tiles:
                nrb = -(-rows // block_m)
                per_split = B * HKV * nrb
                waves = (1, 2, 3, 4) if rows < 128 else (1, 2)  # resident programs an SM the split count fills
                splits = sorted({max(1, w * sms // per_split) for w in waves} | {-(-2 * sms // per_split)})
                for ns, min_chunk in ((ns, mc) for ns in splits for mc in min_chunks):
                    extra = {} if min_chunk is None else {"min_chunk": max(min_chunk, block_n)}
                    cfg = choose_config(B, N, HQ, HKV, D, cap, torch.device("cuda"), ns, block_m=block_m,
                                        block_n=block_n, num_warps=warps, num_stages=stages, **extra)  # fmt: skip
                    try:
                        out = point.cascade(cfg)[0]()
                        ok = torch.allclose(out.float(), base.float(), rtol=2e-2, atol=2e-2)
                        ms = _time_graph(point.cascade(cfg), reps=25)[0] / L
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                        logger.info("config %s failed: %s", cfg, type(exc).__name__)
                        continue
                    timed.append((ms, ok, cfg))
                    print(f"  P={P} N={N} {ms * 1e3:8.1f} us/layer ok={ok} {cfg}", flush=True)
            timed.sort(key=lambda x: x[0])
            print(f"\nP={P} N={N} L={L}: default {default_ms * 1e3:.1f} us/layer; best:", flush=True)
            for ms, ok, cfg in timed[:5]:
                print(f"  {ms * 1e3:8.1f} us  ok={ok}  {cfg}", flush=True)
            results.append(
                {"P": P, "N": N, "layers": L, "default_ms": default_ms,
                 "all": [(ms, ok, cfg.__dict__) for ms, ok, cfg in timed]}
            )  # fmt: skip
            del point
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treecompile.bench attention", description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", default="1024,4096,16384,65536")
    parser.add_argument("--nodes", default="16,64")
    parser.add_argument("--layers", type=int, default=16, help="minimum layers (distinct caches) per graph")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    parser.add_argument("--sweep", action="store_true", help="time stage-1 tile/split configurations instead")
    parser.add_argument("--min-chunks", default="default",
                        help="sweep only: minimum keys per prefix split to try, e.g. default,128,256")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("attention benchmark needs a CUDA device")
        return 2
    import treecompile  # noqa: F401  registers torch.ops.treespec

    prefixes = [int(x) for x in args.prefixes.split(",")]
    nodes = [int(x) for x in args.nodes.split(",")]
    if args.sweep:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        min_chunks = tuple(None if x == "default" else int(x) for x in args.min_chunks.split(","))
        res = run_sweep(prefixes, nodes, args.layers, l2, min_chunks)
        print("\n".join(["", "stage-1 kernels compiled:"] + kernel_resources()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return 0
    ceilings = measure_ceilings()
    print(
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; copy bandwidth "
        f"{ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write); bf16 matmul "
        f"{ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; L2 {ceilings['l2_bytes'] / 1e6:.0f} MB\n",
        flush=True,
    )
    print(HEADER, flush=True)
    rows = run_bench(prefixes, nodes, ceilings, args.layers)
    print("\nper layer (L layers, each its own K/V cache, back to back in one CUDA graph; replay time / L):")
    print(HEADER)
    for r in rows:
        print(_fmt_row(r))
    print("\nsingle call (one call alone in a CUDA graph; graph launch and first wave included):")
    print(HEADER_SINGLE)
    for r in rows:
        print(_fmt_row_single(r))
    notes = [f"{r['P']}/{r['N']} {k}: {v}" for r in rows for k, v in r.items() if k.endswith("_note")]
    if notes:
        print("\nnotes: " + "; ".join(notes))
    print("\n".join(["", "stage-1 kernels compiled:"] + kernel_resources()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "rows": rows}, f, indent=1)
    return 0
