"""treespec::fused_mlp against the unfused MLP chain on cold weights, per few-row MLP shape a round runs (H200, bf16).

    python3 tests/gpu/mlp_sweep.py out.json [quick|full|smoke] [LABEL]  # 12 / 52 (default) / 432 tile configs a
                                                                         # shape; LABEL: only shapes whose label
                                                                         # holds it ("8b")

A forward streams every weight once, so each timing runs one CUDA graph that calls the MLP over enough
distinct weight copies to exceed the 50 MB L2 four times (the weights come from HBM, as in a round), and
reports the time per call. Per shape, side by side in one process:
- ``cublas_us``: the unfused chain as Inductor compiles it (cuBLAS gate/up GEMM over the fused [2I, H] weight,
  its silu-mul kernel, cuBLAS down), under treecompile's Inductor patches (dependent launches, combo kernels);
- ``unfused_us``: the same chain with ``linear_rows`` (the skinny table's Triton tiles where they won): what a
  round runs today, and the baseline a fused entry must beat by 2% (``ops/fused_mlp.py``, ``WIN_MARGIN``);
- ``floor_us``: the three weights' bytes over the copy bandwidth measured in the same run;
- the fused op at its default tiles and over a tile grid, each config first checked against a float64 MLP
  (relative error of the output's norm under 1e-2, no NaN); configs that do not compile are listed as such;
- with the layer's residual add and RMSNorm in front (a round's graph has them there): ``unfused_norm_us``, the
  chain after Inductor's add + norm kernel, against the fused op's RMSNorm prologue (``norm``: the default and
  the three best plain configs, same checks).

Shapes: the 8B Llama's MLP (H 4096, I 14336; also the 8B EAGLE-3 head's) at 1 row (decode, draft step 0), 4
(draft lanes of K = 4, a batch-4 decode) and 16 (a 16-node verify); SmolLM2-135M's (576, 1536) at 1, 4, 8 and 16
rows. The table serves a row count from the smallest swept one at or above it.
Rows carry ``M, H, I, unfused_us, best`` for ``ops/fused_mlp.register_mlp_tiles`` (``tests/gpu/variant.py
--mlp-table out.json`` installs them for a round's A/B). ``smoke``: the CPU interpreter, two tiny shapes.
"""

import dataclasses
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import skinny_sweep  # noqa: E402  (tests/gpu: the shared timing method)

from treecompile.ops._common import inductor_patches
from treecompile.ops.fused_mlp import MlpConfig, _launch_fused_mlp, choose_mlp_config
from treecompile.ops.skinny_linear import linear_rows

# Biggest first within what a round needs most; the 16-row 8B case last (a (4, 4, 16) tree's verify: its workspace,
# I / chunk x 16 x H float32, outgrows L2, so it may well lose; an entry there lets the table serve 5-16 rows).
CASES = [(1, "8b mlp", 4096, 14336), (4, "8b mlp", 4096, 14336),
         (1, "smol mlp", 576, 1536), (4, "smol mlp", 576, 1536), (8, "smol mlp", 576, 1536),
         (16, "8b mlp", 4096, 14336), (16, "smol mlp", 576, 1536)]  # fmt: skip
L2_BYTES = 50 * 2**20
DEVICE, DTYPE = "cuda", torch.bfloat16


def graph_us(fn, copies: int, reps: int = 10) -> float:
    """Per-call us of ``fn(i)`` for i over the copies, captured as one graph (skinny_sweep's method, so the two
    sweeps' numbers compare); on the CPU (smoke) a plain loop."""
    skinny_sweep.DEVICE = DEVICE
    return skinny_sweep.graph_us(fn, copies, reps)


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device copy (the floors' rate, as ``bench rounds`` measures it)."""
    if DEVICE == "cpu":
        return float("nan")
    src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = graph_us(lambda i: dst.copy_(src), 1)
    return 2 * src.numel() / (us * 1e-6)


def chain(x, gate_up, down, linear):
    g, u = torch.split(linear(x, gate_up), gate_up.shape[0] // 2, dim=-1)
    return linear(F.silu(g) * u, down)


def rms_norm(s, weight, eps=1e-5):  # HF LlamaRMSNorm
    s32 = s.to(torch.float32)
    return weight * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)


def norm_chain(residual, attn, weight, gate_up, down, linear):
    return chain(rms_norm(residual + attn, weight), gate_up, down, linear)


def float64_mlp(x, gate_up, down, norm=None):
    x = x.double()
    if norm is not None:  # (norm weight, residual): HF's RMSNorm of x + residual, in float64
        s = x + norm[1].double()
        x = norm[0].double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    g, u = gate_up.double().chunk(2)
    return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), down.double())


def grid(mode: str, H: int, I: int) -> list[MlpConfig]:
    """Tile configs of one shape (the default first); tiles no wider than the dims they cover."""
    if mode == "smoke":
        return [MlpConfig(16, 16, 16, 16, 4, 2, 8, 4), MlpConfig(16, 32, 32, 16, 4, 3, 16, 0, tma=True)]
    # Bytes a step decide how well a pipelined MMA stream runs at 1 row (gemv_sweep.json, eleventh session: the
    # skinny MMA kernel streams the 8B LM head at 4.4 TB/s with 64 KB tiles, qkv at 1.2 with 4 KB ones), so the
    # grid leans to wide tiles; shared-memory overflows are reported as failed configs.
    chunks, block_ks, block_hs, warps, stages, tmas = (32, 64, 128), (128, 256), (128, 256), (4, 8), (3,), (False, True)
    if mode == "quick":
        chunks, block_ks, block_hs, warps = (32, 64), (128, 256), (128,), (4,)
    if mode == "full":
        chunks, block_ks, block_hs, warps, stages = (16, 32, 64, 128), (64, 128, 256), (64, 128, 256), (4, 8), (2, 3, 4)
    base = choose_mlp_config(1, H, I)
    out = [base]
    for c, bk, bh, w, st, tma in itertools.product(chunks, block_ks, block_hs, warps, stages, tmas):
        if c <= max(16, 1 << (I - 1).bit_length()) and max(bk, bh) <= max(16, 1 << (H - 1).bit_length()):
            out.append(MlpConfig(16, c, bk, bh, w, st, tma=tma))
    if mode != "full":  # the pipeline depth and the reduce's width, around the default tiles
        out += [dataclasses.replace(base, num_stages=st) for st in (2, 4)]
        out += [dataclasses.replace(base, reduce_block=rb) for rb in (16, 64)]
    return list(dict.fromkeys(out))


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return float((out.double() - want).norm() / want.norm().clamp_min(1e-30))


def main() -> None:
    global DEVICE, DTYPE, L2_BYTES
    path = sys.argv[1] if len(sys.argv) > 1 else "mlp_sweep.json"
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    cases = CASES
    if len(sys.argv) > 3:  # a label filter, e.g. "8b" for a short device call
        cases = [c for c in cases if sys.argv[3] in c[1]]
    if mode == "smoke":  # the CPU interpreter (TRITON_INTERPRET=1); float16: its tl.dot misreads bfloat16
        DEVICE, DTYPE, L2_BYTES, cases = "cpu", torch.float16, 4096, [(1, "smoke a", 40, 72), (3, "smoke b", 24, 64)]
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    patches = inductor_patches(torch.device(DEVICE))
    compiled = torch.compile(chain, dynamic=False, options=patches) if DEVICE == "cuda" else chain
    compiled_norm = torch.compile(norm_chain, dynamic=False, options=patches) if DEVICE == "cuda" else norm_chain
    results = []
    t0 = time.time()
    for M, label, H, I in cases:
        wbytes = 3 * H * I * 2
        copies = max(2, min(64, -(-4 * L2_BYTES // wbytes)))
        gate_ups = [torch.randn(2 * I, H, device=DEVICE, dtype=DTYPE) / H**0.5 for _ in range(copies)]
        downs = [torch.randn(H, I, device=DEVICE, dtype=DTYPE) / I**0.5 for _ in range(copies)]
        x = torch.randn(M, H, device=DEVICE, dtype=DTYPE)
        outs = [torch.empty(M, H, device=DEVICE, dtype=DTYPE) for _ in range(copies)]
        attn = torch.randn(M, H, device=DEVICE, dtype=DTYPE)
        norm_w = (1 + 0.2 * torch.randn(H, device=DEVICE)).to(DTYPE)
        want = float64_mlp(x, gate_ups[0], downs[0])
        want_norm = float64_mlp(x, gate_ups[0], downs[0], (norm_w, attn))
        row = dict(M=M, label=label, H=H, I=I, copies=copies, floor_us=wbytes / bandwidth * 1e6)
        row["cublas_us"] = graph_us(lambda i: compiled(x, gate_ups[i], downs[i], F.linear), copies)
        row["unfused_us"] = graph_us(lambda i: compiled(x, gate_ups[i], downs[i], linear_rows), copies)
        row["unfused_err"] = rel_err(chain(x, gate_ups[0], downs[0], linear_rows), want)
        row["unfused_norm_us"] = graph_us(lambda i: compiled_norm(x, attn, norm_w, gate_ups[i], downs[i], linear_rows), copies)
        halves = [gu.chunk(2) for gu in gate_ups]  # gate and up: views of each fused weight
        configs = []
        for cfg in grid(mode, H, I):
            entry = {f: getattr(cfg, f) for f in MlpConfig.__dataclass_fields__}
            try:
                out = torch.full((M, H), float("nan"), device=DEVICE, dtype=DTYPE)
                _launch_fused_mlp(x, *halves[0], downs[0], out, cfg)
                entry["err"] = rel_err(out, want)
                if entry["err"] > 1e-2:
                    entry["error"] = f"wrong: relative error {entry['err']:.3g}"
                else:
                    entry["us"] = graph_us(lambda i: _launch_fused_mlp(x, *halves[i], downs[i], outs[i], cfg), copies)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is reported
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            configs.append(entry)
        row["default"] = configs[0]
        timed = [c for c in configs if "us" in c]
        row["best"] = min(timed, key=lambda c: c["us"]) if timed else None
        row["configs"] = configs
        row["norm"] = []  # the RMSNorm prologue (x + attn, normalised): the default and the 3 best plain configs
        for entry in [configs[0]] + sorted(timed, key=lambda c: c["us"])[:3]:
            cfg = MlpConfig(**{f: entry[f] for f in MlpConfig.__dataclass_fields__})  # tma included
            norm_entry = {f: entry[f] for f in MlpConfig.__dataclass_fields__}
            try:
                out = torch.full((M, H), float("nan"), device=DEVICE, dtype=DTYPE)
                _launch_fused_mlp(x, *halves[0], downs[0], out, cfg, norm_w, attn, 1e-5)
                norm_entry["err"] = rel_err(out, want_norm)
                if norm_entry["err"] > 1e-2:
                    norm_entry["error"] = f"wrong: relative error {norm_entry['err']:.3g}"
                else:
                    norm_entry["us"] = graph_us(
                        lambda i: _launch_fused_mlp(x, *halves[i], downs[i], outs[i], cfg, norm_w, attn, 1e-5), copies)
            except Exception as exc:  # noqa: BLE001
                norm_entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["norm"].append(norm_entry)
        timed_norm = [c for c in row["norm"] if "us" in c]
        row["best_norm"] = min(timed_norm, key=lambda c: c["us"]) if timed_norm else None
        results.append(row)
        best = row["best"]
        print(
            f"{label:9s} M={M:2d} floor {row['floor_us']:7.2f} us | cuBLAS chain {row['cublas_us']:7.2f} | shipped chain "
            f"{row['unfused_us']:7.2f} | fused default {configs[0].get('us', float('nan')):7.2f} | best "
            f"{best['us'] if best else float('nan'):7.2f} "
            f"{ {k: best[k] for k in ('chunk', 'block_k', 'block_h', 'num_warps', 'num_stages', 'reduce_block', 'tma')} if best else ''} | "
            f"{sum('error' in c for c in configs)} of {len(configs)} configs failed | with the norm: unfused "
            f"{row['unfused_norm_us']:7.2f}, fused best "
            f"{row['best_norm']['us'] if row['best_norm'] else float('nan'):7.2f} | / floor: shipped chain "
            f"{row['unfused_us'] / row['floor_us']:.2f}, fused best "
            f"{(best['us'] if best else float('nan')) / row['floor_us']:.2f} | {time.time() - t0:.0f} s",
            flush=True,
        )  # fmt: skip
        with open(path, "w") as f:  # after every shape: a sweep cut short keeps what it measured
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
