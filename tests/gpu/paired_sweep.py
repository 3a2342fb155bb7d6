"""The tile sweep that ``glu_bench.py`` and ``rope_bench.py`` share: every (width, K step, warps, stages) of a
64-row paired-slice skinny op (an x tile and two weight tiles a K step) that fits sm_90's shared memory, each
config checked before it is timed. (``tile_sweep.py`` is another tool: the attention cascade's stage-1 tiles.)

``error(cfg)`` launches the op once with ``cfg`` into NaN-poisoned outputs and returns its largest error (NaN, an
unwritten element, fails); ``run(cfg)`` is one timed launch (weights rotating over copies). Returns the
``[{"us", "block_n", "block_k", "warps", "stages"}, ...]`` rows, fastest first, and prints the best eight.
"""

import triton

SMEM_LIMIT = 232448  # bytes of shared memory a program may hold on sm_90


def sweep_tiles(widths, error, run, tolerance: float, floor_us: float | None = None) -> list[dict]:
    tried = []
    for width in widths:
        for block_k in (64, 128, 256):
            for warps in (4, 8):
                for stages in (3, 4, 5, 6):
                    cfg = (64, width, block_k, warps, stages)
                    if stages * (64 + 2 * width) * block_k * 2 > SMEM_LIMIT:  # x tile + two weight tiles a stage
                        continue  # sm_90 refuses it at launch: no compile for it
                    try:
                        e = error(cfg)
                        if not e < tolerance:
                            print(f"{cfg} wrong: max err {e}")
                            continue
                        us = triton.testing.do_bench_cudagraph(lambda c=cfg: run(c), rep=100) * 1e3
                    except Exception as exc:  # a resource the formula above missed, say: not a candidate
                        print(f"{cfg} failed: {type(exc).__name__}: {str(exc)[:100]}")
                        continue
                    tried.append((us, cfg))
    tried.sort()
    for us, cfg in tried[:8]:
        print(f"  {us:8.2f} us  {cfg}" + (f"  ({us / floor_us:.3f}x the floor)" if floor_us else ""))
    return [dict(us=us, block_n=c[1], block_k=c[2], warps=c[3], stages=c[4]) for us, c in tried]
