"""Triton kernels of the tree-attention cascade (launched from ``tree_attention._launch_tree_attention_paged``).

Stage 1, ``cascade_partial_kernel``, grid ``(B * Hkv * NRB, NS + 1)``:
  program ``(b, kv head, row block)`` x ``split s`` holds BLOCK_M of the ``R * G`` (row, group head) query
  rows of one KV head, so every K/V tile it loads serves all rows and all group heads at once.
  * ``s < NS``: split-K decode over its chunk of the prefix ``[0, P)`` (flash-decoding); chunks are whole
    BLOCK_N tiles, at least MIN_CHUNK keys, so a short prefix uses few splits and the rest exit early
    after writing an empty state (``lse = -inf``, no output row).
  * ``s == NS``: the window, ``W <= 64`` keys after the prefix, one tile, visible per row through its
    64-bit ancestor mask (bit tests in int64). With ``NEW_ROWS`` (``tree_attention_paged_write``) window key
    j comes from the call's new row ``b * R + j - window_offset`` when that row's slot is the key's (keys
    ``[window_offset, window_offset + R)`` are the call's rows), and the row block 0
    program of each (request, KV head) writes the new rows to their slots (``kv_write``'s semantics: slots
    out of range skipped). No program reads a slot this call writes, so the order of programs is free.
  Each writes a partial output (normalised) and its base-2 log-sum-exp into the workspace.
Stage 2, ``cascade_merge_kernel``, grid ``(cdiv(B * R * Hq, merge_rows),)``: combines the NS + 1 partial states
  of each of its rows by log-sum-exp, guarding empty states (all ``-inf``: the row sees nothing -> zeros).
  A merge by stage 1's last-arriving program of a row block instead (an arrival counter, as split-K GEMMs do)
  was built and timed in the fifteenth / sixteenth sessions and removed: one program walking NS + 1 states
  after the others is a serial tail longer than the launch it saves (H200, 8B shapes, per layer: verify P=2k
  N=64 15.64 -> 26.66 us, decode 7.19 -> 14.65; BENCHMARKS.md, sixteenth session).

Full prefix tiles come through Hopper TMA descriptors where the device and the cache layout allow (the cache
viewed as ``[num_slots, Hkv * D]``, one box per tile: a tile never crosses a page; H200, 8B shapes, stage 1 at
64k N=64 188 -> 163 us a layer); elsewhere, and for the masked tail tile, through pointer gathers. Tuning
fields (``CascadeConfig``, or ``TREECOMPILE_CASCADE`` for a whole run): ``tma``, ``merge_rows`` (several rows a
merge program), ``merge_warps``, ``l2_prefetch`` (a split's first tiles hinted into L2 before the dependency wait;
measured slower on the H200 at every count, off); every variant computes the same sums.

Ideas from SGLang's triton_ops/decode_attention.py (split-K stage 1 / stage 2 with a fixed split count),
flashinfer's cascade merge_state (base-2 LSE, empty-state guards) and SGLang's target_verify (prefix pass,
masked expand pass, merge). The split count depends on static sizes only, never on prefix_len's value.

Non-finite data in slots a row does not see never reaches it: K/V loads are masked to the keys in range
(other=0), scores of invisible keys are replaced by -inf, and window V rows that no row of the tile sees
are cleared (a zero probability times NaN would still be NaN).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_l2_prefetch, pdl_enabled, prefetch_l2, tma_device_ok, triton_interpret

logger = logging.getLogger(__name__)

LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class CascadeConfig:
    """Tile sizes of stage 1; chosen from static sizes by :func:`choose_config`."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    min_chunk: int
    merge_warps: int = 4
    merge_rows: int = 1  # query rows (b, r, hq) one merge program combines
    tma: bool = True  # full prefix tiles through Hopper TMA descriptors (when the device and layout allow)
    pdl: bool = False  # both kernels as programmatic dependent launches (_common.pdl_enabled)
    l2_prefetch: int = 0  # first prefix tiles of a split hinted into L2 before anything waits (0: off)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


SHORT_SPLIT_KEYS = 384  # splits of at most this many keys (of capacity) keep the window programs in their wave
LONG_CACHE = 8192  # keys of capacity from which compute-heavy rows use the paired one-warpgroup tile


def resident_ctas_per_sm(block_m: int, num_warps: int) -> int:
    """Stage-1 programs one Hopper SM holds at once (16-bit K/V, D <= 128): a static estimate that matches the
    compiled kernels' registers and shared memory on the H200 (notes/attention.md). Two warpgroups over 128
    rows take ~240 registers a thread -> 1; one warpgroup (4 warps) over 128 or 64 rows -> 2."""
    return 1 if block_m >= 128 and num_warps >= 8 else 2


def choose_config(
    B, R, Hq, Hkv, D, capacity, device, num_splits=None, itemsize: int = 2, **override
) -> CascadeConfig:
    """Static tile/split choice (shapes and dtype size only). ``override`` replaces any field (tuning sweep)."""
    G = Hq // Hkv
    rows = R * G
    # Compute-heavy rows (verify N=64: 256 rows per KV head) over long caches (>= LONG_CACHE keys) take 128 x 64
    # tiles on ONE warpgroup, two programs per SM, 11-15% faster than two warpgroups on 128 x 128 at 64k (H200):
    # while one program runs its softmax (exp2 on the special-function unit) the other keeps the tensor cores
    # busy. Below LONG_CACHE, 64 x 64 tiles on one warpgroup beat both 128-row tiles (H200 sweep, N=64: 1k 19.0
    # vs 26.0 us for the 128 x 128 two-warpgroup tile used before, 2k 24.3 vs 27.0, 4k 29.9 vs 34.3;
    # notes/attention.md): twice the row blocks give a short prefix enough programs to fill the SMs two per SM.
    big = rows >= 128 and D <= 128
    pair = big and (capacity >= LONG_CACHE or itemsize > 2)  # 4-byte tiles: the smaller-tile config
    block_m = override.pop("block_m", 128 if pair else min(64, max(16, triton.next_power_of_2(rows))))
    block_n = override.pop("block_n", 64 if D <= 128 else 32)
    nrb = triton.cdiv(rows, block_m)
    if device.type == "cuda":
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 4  # interpreter: few programs keep CPU tests fast
    num_warps = override.pop("num_warps", 4)
    # 4-byte inputs double every tile: fewer stages keep the 128-row configs inside shared memory.
    num_stages = override.pop("num_stages", (4 if pair else 3) if D <= 128 and itemsize <= 2 else 2)
    auto_splits = num_splits is None
    if auto_splits:
        # Exactly one wave of prefix programs: a grid just past what the SMs hold at once runs a nearly empty
        # extra wave (N=64 at 64k: 17 splits x 16 programs = 272 > 264 two-per-SM slots took 250 us, 16 splits
        # 185 us). Window programs are one tile each; where splits are short they get room in the wave (below).
        num_splits = max(1, resident_ctas_per_sm(block_m, num_warps) * sms // (B * Hkv * nrb))
    # A split writes BLOCK_M x D fp32 partials. Compute-heavy rows (> 128 a KV head: verify N=64) give each
    # split >= 4 * BLOCK_M keys so that stays <= 1/4 of its K/V reads. Few rows (decode, draft lanes, N <= 32
    # verify with G <= 4) are latency-bound at short prefixes: one tile a split lets every live tile run at
    # once instead of one program walking 4 tiles in turn (H200 sweep, Hq=32 Hkv=8 D=128, per layer: P=256
    # N=1 10.2 -> 6.0-6.4 us, N=32 13.7 -> 9.7 us; P=2048 N=1 11.9 -> 9.6 us, N=32 17.4 -> 16.8 us;
    # notes/gpu-2026-11-30f/sweep_small_rows.json).
    # Compute-heavy rows with few 64-row blocks a split (a small model's KV heads: SmolLM2's verify N=64 has 9)
    # leave most SMs idle when a short prefix fills only 2 splits of 256 keys: 128-key chunks there (H200, Hq=9
    # Hkv=3 D=64, capacity 1024, per layer: P=256 9.07 -> 7.78 us, P=512 9.02 -> 7.72, P=900 9.68 -> 8.34;
    # notes/gpu-2026-12-01/call1/cascade.json). With a quarter of the SMs' worth a split (8B: 32) 256 stays
    # (third session's sweep: 8B N=64 P=1k, 8 splits, 256-key chunks 19.0 us, 128-key 21.2 us).
    if rows <= 128:
        min_chunk = block_n
    elif 8 * B * Hkv * triton.cdiv(rows, 64) < sms:  # 64-row blocks a split, whatever tile runs
        min_chunk = 2 * block_n
    else:
        min_chunk = max(256, 4 * block_m)
    min_chunk = override.pop("min_chunk", min_chunk)
    # A split holds >= min_chunk keys, so at most cdiv(capacity, min_chunk) splits are ever live: more would
    # only launch empty programs and give the merge empty states to read (SmolLM2 N=64 at P=256: 29 splits
    # 9.9 us a layer, 16 splits 9.1 us).
    num_splits = max(1, min(num_splits, triton.cdiv(capacity, min_chunk), 128))
    # The window programs (the grid's last column, one per row block and KV head) belong in that wave too when
    # a split is only a few 64-key tiles long (<= 384 keys; a window program is one 64-key tile, whatever
    # block_n): they then cost about as much as a prefix program, and the few that find no free slot run a
    # second wave of their own (H200, 8B shapes, per layer: P=2k N=64 8 splits x 32 + 32 = 288 programs > 264
    # slots 19.3 us, 7 splits 15.7 us; P=2k N=1 33 x 8 + 8 = 272: 7.50 -> 7.13 us with 32 splits;
    # notes/gpu-2026-12-01-s14/cascade_ab.json). Long splits keep the overflow: one-tile window programs
    # are then a small share of a 64-tile prefix program (64k N=64: 16 x 16 + 16 = 272 programs, 185 us, where
    # 17 splits, a whole extra wave of prefix programs, took 250 us).
    per_split = B * Hkv * nrb
    slots = resident_ctas_per_sm(block_m, num_warps) * sms
    if (
        auto_splits and (num_splits + 1) * per_split > slots and num_splits > 1
        and triton.cdiv(capacity, num_splits) <= SHORT_SPLIT_KEYS
    ):  # fmt: skip
        num_splits = max(1, slots // per_split - 1)
    # The merge: one row a program. A row's NS + 1 states of D fp32 fit one warp's registers when there are
    # <= 4096 values (<= 128 a thread): then one warp a program beats four, whose cross-warp reduction goes
    # through shared memory (H200, 8B shapes, per layer: P=2k N=64, 8 splits, 7.5 -> 3.4 us; 16k / 64k N=64,
    # 16 splits, 8.9 / 9.5 -> 4.2 / 4.4 us). With 33 splits (N <= 16) one warp loses (N=1: 8.6 -> 9.5 us a
    # layer with stage 1), so those keep four. Several rows a program gained nothing that one warp did not
    # (notes/gpu-2026-12-01-s13/cascade_ab.json).
    # Where a row's states are small (<= 1024 values, 32 a lane) and rows are many, eight rows on eight warps
    # (a warp a row, 8x fewer programs) beat one row a program: H200, 8B verify P=2k N=64 (7 splits, 2048
    # rows), per layer 15.56 -> 14.91 us (fifteenth session) and 15.64 -> 14.97 (sixteenth; merge kernel 3.39
    # -> 2.51 us). At 8 splits (2048 values a row) it lost, 20.18 -> 20.78 (thirteenth), so the bound is tight.
    row_values = triton.next_power_of_2(num_splits + 1) * D
    merge_warps = 1 if row_values <= 4096 else 4
    merge_rows = 1
    if row_values <= 1024 and B * R * Hq >= 1024:  # the merge grid's rows
        merge_rows = merge_warps = 8
    cfg = dict(
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_splits=num_splits,
        min_chunk=min_chunk,
        merge_warps=merge_warps,
        merge_rows=merge_rows,
        pdl=pdl_enabled(device),
    )
    cfg.update(_env_overrides())
    cfg.update(override)
    return CascadeConfig(**cfg)


CASCADE_ENV = "TREECOMPILE_CASCADE"


def _env_overrides() -> dict:
    """``TREECOMPILE_CASCADE="tma=1,merge_rows=4"``: replace config fields for every launch (A/B tuning runs on
    the GPU, e.g. a whole round under one variant). Read at launch, so a captured graph keeps the variant it
    was captured with. Unknown fields or values are refused by name."""
    spec = os.environ.get(CASCADE_ENV, "").strip()
    if not spec:
        return {}
    fields = {f.name for f in dataclasses.fields(CascadeConfig)}
    out = {}
    for item in spec.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in fields or key == "pdl":
            raise ValueError(f"{CASCADE_ENV}: expected comma-separated FIELD=INT with FIELD one of "
                             f"{sorted(k for k in fields if k != 'pdl')}, got {item!r}")  # fmt: skip
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{CASCADE_ENV}: {key} must be an integer, got {value!r}") from None
        out[key] = bool(number) if key == "tma" else number
    return out


def launch_cascade(
    q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale, num_splits=None,
    config: CascadeConfig | None = None, new_rows=None, window_offset: int = 0,
):  # fmt: skip
    """Stage 1 + stage 2 on q ``[B, R, Hq, D]``; returns ``[B, R, Hq, D]`` in q's dtype. ``new_rows = (k, v,
    slots)``, ``k, v [B * R, Hkv, D]``: written to the caches by the window programs, which read window keys
    ``[window_offset, window_offset + R)`` from them (module docstring)."""
    B, R, Hq, D = q.shape
    num_slots, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    max_pages = page_table.shape[1]
    capacity = max_pages * page_size
    cfg = config or choose_config(
        B, R, Hq, Hkv, D, capacity, q.device, num_splits, itemsize=q.element_size()
    )
    nrb = triton.cdiv(R * G, cfg.block_m)
    NS = cfg.num_splits
    q = q.contiguous()
    # Workspaces: [B, R, Hq, NS + 1, D] normalised partial outputs and [B, R, Hq, NS + 1] base-2 LSEs.
    o_part = torch.empty((B, R, Hq, NS + 1, D), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((B, R, Hq, NS + 1), device=q.device, dtype=torch.float32)
    out = torch.empty((B, R, Hq, D), device=q.device, dtype=q.dtype)
    if triton_interpret():  # CPU tests: unwritten partial rows (splits past the prefix) hold NaN, as stale memory may
        o_part.fill_(float("nan"))
        out.fill_(float("nan"))  # and so would an output row no merge wrote
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    pdl = cfg.pdl and q.device.type == "cuda" and not triton_interpret()
    launch = dict(launch_pdl=True) if pdl else {}
    if new_rows is not None:
        k_new, v_new, new_slots = new_rows
    else:  # unused (NEW_ROWS=False): any tensors of the right kind
        k_new, v_new, new_slots = k_cache, v_cache, prefix_len
    l2_prefetch = check_l2_prefetch("config", cfg.l2_prefetch)
    if page_size % cfg.block_n:  # the hints take a tile to lie in one page (one page-table read a tile)
        l2_prefetch = 0
    tma = cfg.tma and _tma_layout_ok(k_cache, v_cache, page_size, cfg.block_n)
    if tma:
        k_desc, v_desc = (_tile_descriptor(c, cfg.block_n) for c in (k_cache, v_cache))
    else:  # unused (TMA=False)
        k_desc, v_desc = k_cache, v_cache
    cascade_partial_kernel[(B * Hkv * nrb, NS + 1)](
        q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, o_part, lse_part, k_desc, v_desc,
        k_new, v_new, new_slots, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        new_slots.stride(0), num_slots, window_offset,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), page_table.stride(1), prefix_len.stride(0), ancestor_mask.stride(0),
        ancestor_mask.stride(1), max_pages, num_slots // page_size, R, float(scale) * LOG2E, NS,
        HKV=Hkv, G=G, PAGE=page_size, WINDOW=window, NRB=nrb, D=D,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_W=max(16, triton.next_power_of_2(max(window, 1))),
        MIN_CHUNK=cfg.min_chunk, PREC=prec, NEW_ROWS=new_rows is not None, TMA=tma, USE_PDL=pdl,
        L2_PREFETCH=l2_prefetch, L2_LINES=max(1, D * k_cache.element_size() // 128),
        L2_LINE_ELEMS=128 // k_cache.element_size(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )  # fmt: skip
    rows = B * R * Hq
    mr = cfg.merge_rows
    cascade_merge_kernel[(triton.cdiv(rows, mr),)](
        o_part, lse_part, out,
        rows, NS, D=D, BLOCK_S=triton.next_power_of_2(NS + 1), ROWS=mr, USE_PDL=pdl,
        num_warps=cfg.merge_warps, **launch,
    )  # fmt: skip
    return out


def _tma_layout_ok(k_cache, v_cache, page_size: int, block_n: int) -> bool:
    """Whether full prefix tiles can come through TMA descriptors: a tile must lie in one page, and each cache
    must be a 2-D ``[num_slots, Hkv * D]`` box source (heads adjacent, D contiguous, 16-byte aligned base and
    slot stride). On CUDA the device must be Hopper or newer; the interpreter emulates descriptors on CPU."""
    if page_size % block_n or not tma_device_ok(k_cache):
        return False
    for c in (k_cache, v_cache):
        D = c.shape[2]
        if c.stride(2) != 1 or c.stride(1) != D or (c.stride(0) * c.element_size()) % 16:
            return False
        if c.data_ptr() % 16:
            return False
    return True


def _tile_descriptor(cache: torch.Tensor, block_n: int):
    """A host TMA descriptor over ``cache [num_slots, Hkv, D]`` viewed as ``[num_slots, Hkv * D]``, boxes of
    ``[block_n, D]`` (one KV head of block_n slots). Built at launch; under CUDA graphs the descriptor is a
    kernel parameter captured with the graph, valid while the cache's storage stays where it is (caches are
    fixed buffers)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_slots, Hkv, D = cache.shape
    return TensorDescriptor(cache, [num_slots, Hkv * D], [cache.stride(0), 1], [block_n, D])


@triton.jit
def cascade_partial_kernel(
    q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, o_part, lse_part, k_desc, v_desc,
    k_new, v_new, new_slots, s_kn, s_knh, s_vn, s_vnh, s_ns, num_slots, new_off,
    s_qb, s_qr, s_qh,
    s_kc, s_kh, s_vc, s_vh,
    s_pt, s_pp, s_pl, s_ab, s_ar,
    max_pages, num_pages, R, qk_scale, NS,
    HKV: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr,
    NRB: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    MIN_CHUNK: tl.constexpr, PREC: tl.constexpr, NEW_ROWS: tl.constexpr, TMA: tl.constexpr,
    USE_PDL: tl.constexpr, L2_PREFETCH: tl.constexpr, L2_LINES: tl.constexpr, L2_LINE_ELEMS: tl.constexpr,
):  # fmt: skip
    if L2_PREFETCH > 0:
        # Before the dependency wait (under PDL the previous kernel may still run): hint this split's first
        # L2_PREFETCH prefix tiles of K and V into L2, so the loads after the wait hit L2 instead of HBM.
        # Prefix slots are written rounds earlier, never by the kernel just before; a stale prefix_len or
        # page only wastes hints (prefetch_l2).
        _prefetch_prefix_tiles(
            k_cache, v_cache, page_table, prefix_len, s_kc, s_kh, s_vc, s_vh, s_pt, s_pp, s_pl, max_pages,
            num_pages, NS, HKV, PAGE, NRB, D, BLOCK_N, MIN_CHUNK, L2_PREFETCH, L2_LINES, L2_LINE_ELEMS,
        )  # fmt: skip
    if USE_PDL:
        # A dependent launch: wait for the previous kernel (it wrote q, and maybe the cache or the
        # metadata) before touching memory, then let the merge launch; it waits for this grid in turn.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rb = pid % NRB
    b = (pid // NRB) // HKV
    kvh = (pid // NRB) % HKV

    m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < R * G
    r = m // G
    hq = kvh * G + m % G
    d = tl.arange(0, D)
    q_ptrs = q + b.to(tl.int64) * s_qb + r[:, None] * s_qr + hq[:, None] * s_qh + d[None, :]
    qt = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    P = tl.load(prefix_len + b * s_pl)  # page_table, prefix_len, slots: any strides (views of state tables)
    capacity = max_pages * PAGE
    pt_row = page_table + b.to(tl.int64) * s_pt
    k_head = k_cache + kvh.to(tl.int64) * s_kh
    v_head = v_cache + kvh.to(tl.int64) * s_vh

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)

    if split < NS:
        # Prefix split: whole BLOCK_N tiles, >= MIN_CHUNK keys per split, the last split takes the rest.
        start, end = _split_keys(P, capacity, split, NS, BLOCK_N, MIN_CHUNK)
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        # Full tiles need no key mask (the hot loop); at most one partial tile follows.
        for start_n in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = _prefix_tile(
                qt, m_i, l_i, acc, k_head, v_head, pt_row, s_pp, start_n, end, num_pages, s_kc, s_vc, qk_scale,
                k_desc, v_desc, kvh * D, PAGE, D, BLOCK_N, PREC, False, TMA,
            )  # fmt: skip
        if full_end < end:
            m_i, l_i, acc = _prefix_tile(
                qt, m_i, l_i, acc, k_head, v_head, pt_row, s_pp, full_end, end, num_pages, s_kc, s_vc, qk_scale,
                k_desc, v_desc, kvh * D, PAGE, D, BLOCK_N, PREC, True, False,
            )  # fmt: skip
    else:
        # Window: key P + j for j < WINDOW, visible to row r iff bit j of its ancestor mask is set.
        j = tl.arange(0, BLOCK_W)
        t = P + j
        wmask = (j < WINDOW) & (t < capacity) & (t >= 0)
        page = tl.load(pt_row + (t // PAGE) * s_pp, mask=wmask, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        slot = page * PAGE + t % PAGE
        if NEW_ROWS:
            # Window key j is new row b * R + j - new_off (keys [new_off, new_off + R) are the call's rows: a
            # verify's whole window, a draft lane step's K columns) when that row goes to the key's own slot.
            jn = (j >= new_off) & (j < new_off + R) & (j < WINDOW)
            row_n = b.to(tl.int64) * R + tl.maximum(j - new_off, 0)
            nslot = tl.load(new_slots + row_n * s_ns, mask=jn, other=-1)  # slots may be a strided view
            from_new = jn & (nslot == slot)
            kn = tl.load(k_new + row_n[:, None] * s_kn + kvh * s_knh + d[None, :], mask=jn[:, None], other=0.0)
            vn = tl.load(v_new + row_n[:, None] * s_vn + kvh * s_vnh + d[None, :], mask=jn[:, None], other=0.0)
            old = wmask & ~from_new
            kt = tl.load(k_head + slot[:, None] * s_kc + d[None, :], mask=old[:, None], other=0.0)
            vt = tl.load(v_head + slot[:, None] * s_vc + d[None, :], mask=old[:, None], other=0.0)
            kt = tl.where(from_new[:, None], kn, kt)
            vt = tl.where(from_new[:, None], vn, vt)
            if rb == 0:  # one program per (request, KV head) writes its head of the new rows
                ok = jn & (nslot >= 0) & (nslot < num_slots)
                tl.store(k_head + nslot[:, None] * s_kc + d[None, :], kn, mask=ok[:, None])
                tl.store(v_head + nslot[:, None] * s_vc + d[None, :], vn, mask=ok[:, None])
        else:
            kt = tl.load(k_head + slot[:, None] * s_kc + d[None, :], mask=wmask[:, None], other=0.0)
            vt = tl.load(v_head + slot[:, None] * s_vc + d[None, :], mask=wmask[:, None], other=0.0)
        amask = tl.load(ancestor_mask + b.to(tl.int64) * s_ab + r * s_ar, mask=row_ok, other=0)
        bits = (amask[:, None] >> j[None, :].to(tl.int64)) & 1
        vis = (bits != 0) & wmask[None, :] & row_ok[:, None]
        seen = tl.max(vis.to(tl.int32), 0) > 0
        vt = tl.where(seen[:, None], vt, 0.0)
        s = tl.dot(qt, tl.trans(kt.to(qt.dtype)), input_precision=PREC) * qk_scale
        s = tl.where(vis, s, float("-inf"))
        m_i = tl.max(s, 1)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp2(s - m_safe[:, None])
        l_i = tl.sum(p, 1)
        acc = tl.dot(p.to(qt.dtype), vt.to(qt.dtype), input_precision=PREC)

    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    row = (b.to(tl.int64) * R + r) * (HKV * G) + hq  # flat (b, r, hq)
    tl.store(lse_part + row * (NS + 1) + split, lse, mask=row_ok)
    # Empty states write no output row: the merge reads a partial only where its LSE is finite.
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptrs = o_part + (row[:, None] * (NS + 1) + split) * D + d[None, :]
    tl.store(o_ptrs, o, mask=(row_ok & ~empty)[:, None])


@triton.jit
def _split_keys(P, capacity, split, NS, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Keys ``[start, end)`` of prefix split ``split``: whole BLOCK_N tiles, >= MIN_CHUNK keys a split, the
    last split takes the rest; empty (start >= end) for splits past the prefix. A bad prefix_len never
    reaches past the page table (``capacity`` keys)."""
    p_end = tl.minimum(P, capacity)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(p_end, BLOCK_N), NS), MIN_CHUNK // BLOCK_N)
    start = split * per_split * BLOCK_N
    return start, tl.minimum(start + per_split * BLOCK_N, p_end)


@triton.jit
def _prefetch_prefix_tiles(
    k_cache, v_cache, page_table, prefix_len, s_kc, s_kh, s_vc, s_vh, s_pt, s_pp, s_pl, max_pages, num_pages, NS,
    HKV: tl.constexpr, PAGE: tl.constexpr, NRB: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr, TILES: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr,
):  # fmt: skip
    """L2 hints for the first TILES tiles of this program's prefix split (the same chunk arithmetic as the
    split's loop; PAGE % BLOCK_N == 0, so a tile lies in one page): [TILES, BLOCK_N, LINES] line addresses
    of K and of V, LINES 128-byte lines a key row of one head. The window program hints nothing."""
    split = tl.program_id(1)
    if split < NS:
        b = (tl.program_id(0) // NRB) // HKV
        kvh = (tl.program_id(0) // NRB) % HKV
        start, end = _split_keys(tl.load(prefix_len + b * s_pl), max_pages * PAGE, split, NS, BLOCK_N, MIN_CHUNK)
        tile = start // BLOCK_N + tl.arange(0, TILES)
        ok = tile * BLOCK_N < end
        pt_row = page_table + b.to(tl.int64) * s_pt
        page = tl.load(pt_row + (tile * BLOCK_N // PAGE) * s_pp, mask=ok, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)  # inside the cache whatever the table holds
        slot = (page * PAGE + (tile * BLOCK_N) % PAGE)[:, None] + tl.arange(0, BLOCK_N)[None, :]
        line = tl.arange(0, LINES) * LINE_ELEMS
        keep = ok[:, None, None]
        k_lines = k_cache + kvh.to(tl.int64) * s_kh + slot[:, :, None] * s_kc + line[None, None, :]
        v_lines = v_cache + kvh.to(tl.int64) * s_vh + slot[:, :, None] * s_vc + line[None, None, :]
        prefetch_l2(tl.where(keep, k_lines, k_cache))  # tiles past the split: the cache's first line again
        prefetch_l2(tl.where(keep, v_lines, v_cache))


@triton.jit
def cascade_merge_kernel(
    o_part, lse_part, out, num_rows, NS, D: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:  # stage 1's partials must be complete and visible before any load
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    # Both loads are issued at once (the partial outputs do not wait for the LSEs): one round trip to L2, not
    # two. An empty state (a split past the prefix) never wrote its output row, so it is selected away, not
    # multiplied by a zero weight (its memory may hold NaN).
    if ROWS == 1:  # one query row a program: [BLOCK_S] LSEs, [BLOCK_S, D] partial outputs (the H200-timed form)
        row = tl.program_id(0).to(tl.int64)
        smask = s < NS + 1
        lse = tl.load(lse_part + row * (NS + 1) + s, mask=smask, other=float("-inf"))
        o = tl.load(o_part + (row * (NS + 1) + s[:, None]) * D + d[None, :], mask=smask[:, None], other=0.0)
        mx = tl.max(lse, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(lse - mx)  # empty states weigh 0
        live = smask & (lse > float("-inf"))
        o = tl.where(live[:, None], o, 0.0)
        denom = tl.sum(w, 0)
        res = tl.sum(w[:, None] * o, 0) / tl.where(denom == 0.0, 1.0, denom)
        tl.store(out + row * D + d, res.to(out.dtype.element_ty))
    else:  # ROWS query rows a program: [ROWS, BLOCK_S] LSEs, [ROWS, BLOCK_S, D] partial outputs
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = row < num_rows
        smask = rmask[:, None] & (s[None, :] < NS + 1)
        state = row[:, None] * (NS + 1) + s[None, :]
        lse = tl.load(lse_part + state, mask=smask, other=float("-inf"))
        o = tl.load(o_part + state[:, :, None] * D + d[None, None, :], mask=smask[:, :, None], other=0.0)
        mx = tl.max(lse, 1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(lse - mx[:, None])
        live = smask & (lse > float("-inf"))
        o = tl.where(live[:, :, None], o, 0.0)
        denom = tl.sum(w, 1)
        res = tl.sum(w[:, :, None] * o, 1) / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(out + row[:, None] * D + d[None, :], res.to(out.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _prefix_tile(
    qt, m_i, l_i, acc, k_head, v_head, pt_row, s_pp, start_n, end, num_pages, s_kc, s_vc, qk_scale,
    k_desc, v_desc, col,
    PAGE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of prefix keys [start_n, start_n + BLOCK_N) (clipped to ``end`` when MASKED):
    online softmax in base 2 with the scale folded into one FMA; the accumulator rides in the dot.
    ``TMA`` (full tiles inside one page only): the tile is one box ``[slot0, col]`` of the descriptors, so
    the copy engine moves it into shared memory with no per-thread address math or gather."""
    d = tl.arange(0, D)
    t = start_n + tl.arange(0, BLOCK_N)
    if PAGE % BLOCK_N == 0:  # the tile lies in one page: one page-table read
        page = tl.load(pt_row + (start_n // PAGE) * s_pp).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        slot0 = page * PAGE + start_n % PAGE
        slot = slot0 + tl.arange(0, BLOCK_N)
    else:
        page = tl.load(pt_row + (t // PAGE) * s_pp, mask=t < end, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        slot = page * PAGE + t % PAGE
    if MASKED:
        kmask = t < end
        kt = tl.load(k_head + slot[:, None] * s_kc + d[None, :], mask=kmask[:, None], other=0.0)
        vt = tl.load(v_head + slot[:, None] * s_vc + d[None, :], mask=kmask[:, None], other=0.0)
    elif TMA:
        kt = k_desc.load([slot0.to(tl.int32), col])
        vt = v_desc.load([slot0.to(tl.int32), col])
    else:
        kt = tl.load(k_head + slot[:, None] * s_kc + d[None, :])
        vt = tl.load(v_head + slot[:, None] * s_vc + d[None, :])
    qk = tl.dot(qt, tl.trans(kt.to(qt.dtype)), input_precision=PREC)
    if MASKED:
        qk = tl.where(kmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(qt.dtype), vt.to(qt.dtype), acc, input_precision=PREC)
    return m_new, l_i, acc
