"""One tree attention: every row sees the committed prefix in full and, in the W-key window after it, only
the keys its 64-bit ancestor mask names (seed 000, "One tree attention"; DESIGN.md, "the cascade").

Paged op ``torch.ops.treespec.tree_attention_paged``
----------------------------------------------------
q            : ``[B, R, Hq, D]``  R query rows per request (verify: R = N nodes; lanes: R = K)
k_cache      : ``[num_slots, Hkv, D]``, v_cache the same; Hq % Hkv == 0 (GQA, any group size)
page_table   : ``int32/int64 [B, max_pages]``; key t of request b lives in slot
               ``page_table[b, t // page_size] * page_size + t % page_size``
prefix_len   : ``int64 [B]``  P_b, the committed keys ``[0, P_b)`` every row sees
ancestor_mask: ``int64 [B, R]``  row r sees key ``P_b + j`` iff bit j (< window) is set
page_size, window (W <= 64), scale : ints / float, static
out          : ``[B, R, Hq, D]`` in q's dtype. A row that sees no key at all gets zeros.

Paged op with the cache write ``torch.ops.treespec.tree_attention_paged_write``
-----------------------------------------------------------------------------
``kv_write(k_cache, v_cache, k, v, slots)`` then ``tree_attention_paged(...)`` as one op, for a forward whose
R new rows are window keys ``[window_offset, window_offset + R)`` (a target's verify, decode or prefill chunk:
the whole window, ``window == R``, offset 0; a draft lane step: its K columns of the lane window, offset
``(step - 1) * K``): k, v ``[B * R, Hkv, D]`` (the caches' dtype), slots ``int64 [B * R]``,
``window_offset`` an int (default 0; ``window_offset + R <= window``); mutates both caches, returns the
attention. On CUDA the window programs read window key j of request b from row ``b * R + j - window_offset``
whenever that row is written to the key's own slot (else from the cache, as it was before the call: the lane
window's earlier columns, written by earlier steps) and one of them writes the
rows: the cache write costs no launch of its own. Contract for the GPU path: a row written to a slot other
than its key's (padding rows on the dummy slot) is never seen through another visible key. The CPU path runs
the two ops in order.

Functional form ``tree_attention(q, k, v, ancestor_mask, prefix_len, scale=None)``
--------------------------------------------------------------------------------
Contiguous ``k, v [B, L, Hkv, D]`` and ``q [B, N, Hq, D]``: the paged op with one page of L keys per request
(``page_table = arange(B)``, ``page_size = L``) and ``window = N``.

The cascade (CUDA, Triton; kernels in ``_tree_attention_kernels``): a split-K decode over the prefix in which
each program serves all R rows x G group heads of one KV head, so the prefix is read once per KV head; a
window program per (request, KV head) for the W masked keys; one merge by base-2 log-sum-exp. The number
of splits comes from static sizes only (graph safe); split programs past a request's prefix exit early.
Keys a row cannot see are never read into its result: masked K/V loads and a V tile cleared where no row
looks, so NaN/inf in unwritten or stale slots cannot leak (0 * NaN is NaN).

Validation at the op boundary reads metadata only (no host sync, capture safe). Value checks (mask bits
beyond the window, prefix + window past the page table) live in :func:`validate_tree_attention_values`,
which the functional form runs when not compiling or capturing. The kernels stay in bounds whatever the
values: key positions are clamped to the page table's capacity and page ids to the cache.
"""

from __future__ import annotations

import logging

import torch

from ._common import MAX_NODES, check_dim, check_dtype, check_same_device, use_triton

logger = logging.getLogger(__name__)

KERNEL_HEAD_DIMS = (64, 128, 256)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------------------
# The custom op and its fake
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::tree_attention_paged", mutates_args=())
def tree_attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_len: torch.Tensor,
    ancestor_mask: torch.Tensor,
    page_size: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Tree attention over a paged KV cache (see the module docstring for shapes and semantics)."""
    _validate_paged(q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window)
    if use_triton(q, k_cache, v_cache, page_table, prefix_len, ancestor_mask):
        return _launch_tree_attention_paged(
            q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale
        )
    return _tree_attention_paged_cpu(q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale)


@tree_attention_paged.register_fake
def _(q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale):
    _validate_paged(q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("treespec::tree_attention_paged_write", mutates_args=("k_cache", "v_cache"))
def tree_attention_paged_write(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    page_table: torch.Tensor,
    prefix_len: torch.Tensor,
    ancestor_mask: torch.Tensor,
    page_size: int,
    window: int,
    scale: float,
    window_offset: int = 0,
) -> torch.Tensor:
    """Write the R new rows of each request, then tree attention over the cache (module docstring)."""
    _validate_paged_write(
        q, k_cache, v_cache, k, v, slots, page_table, prefix_len, ancestor_mask, page_size, window, window_offset
    )
    if use_triton(q, k_cache, v_cache, k, v, slots, page_table, prefix_len, ancestor_mask):
        return _launch_tree_attention_paged(
            q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale,
            new_rows=(k, v, slots), window_offset=window_offset,
        )  # fmt: skip
    from .kv_write import kv_write_reference

    kv_write_reference(k_cache, v_cache, k, v, slots)
    return _tree_attention_paged_cpu(q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale)


@tree_attention_paged_write.register_fake
def _(q, k_cache, v_cache, k, v, slots, page_table, prefix_len, ancestor_mask, page_size, window, scale, window_offset=0):
    _validate_paged_write(
        q, k_cache, v_cache, k, v, slots, page_table, prefix_len, ancestor_mask, page_size, window, window_offset
    )
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ancestor_mask: torch.Tensor,
    prefix_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Tree attention over contiguous K/V.

    q ``[B, N, Hq, D]``, k/v ``[B, L, Hkv, D]``, ancestor_mask ``int64 [B, N]``, prefix_len ``int64 [B]``
    -> ``[B, N, Hq, D]``. Row i of request b attends keys ``[0, prefix_len[b])`` and key
    ``prefix_len[b] + j`` for every bit j set in ``ancestor_mask[b, i]``. Keys past
    ``prefix_len[b] + N`` may hold anything (NaN included). ``scale`` defaults to ``D ** -0.5``.
    """
    check_dim("q", q, 4, "[B, N, Hq, D]")
    check_dim("k", k, 4, "[B, L, Hkv, D]")
    check_dim("v", v, 4, "[B, L, Hkv, D]")
    B, N, _, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k, v: shapes must match, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B:
        raise ValueError(f"k: expected batch {B} (q's), got shape {tuple(k.shape)}")
    L = k.shape[1]
    if N > MAX_NODES:
        raise ValueError(f"q: the tree must have 1..{MAX_NODES} nodes, got N={N}")
    if L < N:
        raise ValueError(f"k: L={L} keys cannot hold a window of N={N} rows (need L >= N)")
    if scale is None:
        scale = D**-0.5
    if _values_checkable(q, prefix_len, ancestor_mask):
        validate_tree_attention_values(prefix_len, ancestor_mask, window=N, capacity=L)
    # One page of L keys per request: request b's keys are rows [b*L, (b+1)*L) of the flattened cache.
    page_table = torch.arange(B, device=q.device, dtype=torch.int32).unsqueeze(1)
    return torch.ops.treespec.tree_attention_paged(
        q, k.reshape(B * L, *k.shape[2:]), v.reshape(B * L, *v.shape[2:]),
        page_table, prefix_len, ancestor_mask, L, N, float(scale),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Boundary validation
# ---------------------------------------------------------------------------------------------------------


def _validate_paged(q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window) -> None:
    """Metadata-only checks (shapes, dtypes, devices): no host sync, safe while capturing."""
    check_dim("q", q, 4, "[B, R, Hq, D]")
    check_dim("k_cache", k_cache, 3, "[num_slots, Hkv, D]")
    check_dim("v_cache", v_cache, 3, "[num_slots, Hkv, D]")
    check_dim("page_table", page_table, 2, "[B, max_pages]")
    check_dim("prefix_len", prefix_len, 1, "[B]")
    check_dim("ancestor_mask", ancestor_mask, 2, "[B, R]")
    check_dtype("q", q, *_FLOAT_DTYPES)
    check_dtype("page_table", page_table, torch.int32, torch.int64)
    check_dtype("prefix_len", prefix_len, torch.int64)
    check_dtype("ancestor_mask", ancestor_mask, torch.int64)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, prefix_len=prefix_len,
        ancestor_mask=ancestor_mask,
    )  # fmt: skip
    B, R, Hq, D = q.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} must equal k_cache's {tuple(k_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} must equal q's dtype {q.dtype}")
        if t.stride(2) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {t.stride()}")
    Hkv = k_cache.shape[1]
    if k_cache.shape[2] != D:
        raise ValueError(f"k_cache: head dim {k_cache.shape[2]} must equal q's head dim {D}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"q: Hq={Hq} query heads must be a multiple of the cache's Hkv={Hkv} KV heads")
    if R < 1 or B < 1:
        raise ValueError(f"q: expected B >= 1 and R >= 1 rows, got shape {tuple(q.shape)}")
    if page_table.shape[0] != B or prefix_len.shape[0] != B or tuple(ancestor_mask.shape) != (B, R):
        raise ValueError(
            f"page_table [B, max_pages], prefix_len [B], ancestor_mask [B, R] must match q's B={B}, R={R}; "
            f"got {tuple(page_table.shape)}, {tuple(prefix_len.shape)}, {tuple(ancestor_mask.shape)}"
        )
    if window < 0 or window > MAX_NODES:
        raise ValueError(f"window: must be an int in 0..{MAX_NODES} (one 64-bit mask word), got {window}")
    if page_size < 1:
        raise ValueError(f"page_size: must be a positive int, got {page_size}")
    capacity = page_table.shape[1] * page_size
    if window > capacity:
        raise ValueError(
            f"page_table: {page_table.shape[1]} pages x page_size {page_size} = {capacity} keys is too short "
            f"for a window of {window}"
        )
    if k_cache.shape[0] < page_size:
        raise ValueError(f"k_cache: {k_cache.shape[0]} slots hold less than one page of {page_size}")
    if q.is_cuda:  # the kernels' limits; the CPU reference takes any head dim and float64
        _check_kernel_limits(q)


def _validate_paged_write(
    q, k_cache, v_cache, k, v, slots, page_table, prefix_len, ancestor_mask, page_size, window, window_offset=0
):  # fmt: skip
    from .kv_write import _validate_kv_write

    _validate_paged(q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window)
    _validate_kv_write(k_cache, v_cache, k, v, slots)
    check_same_device(q=q, k=k, v=v, slots=slots)
    B, R = q.shape[:2]
    if k.shape[0] != B * R:
        raise ValueError(f"k: expected B * R = {B * R} rows (one per query row), got shape {tuple(k.shape)}")
    if window_offset < 0 or window_offset + R > window:
        raise ValueError(
            f"window_offset: the R = {R} new rows are window keys [window_offset, window_offset + R), which must "
            f"lie in the window of {window} keys, got window_offset={window_offset}"
        )
    if q.is_cuda and (k.stride(2) != 1 or v.stride(2) != 1):
        raise ValueError(f"k, v: the head dim must be contiguous, got strides {k.stride()} and {v.stride()}")


def _check_kernel_limits(q) -> None:
    if q.shape[3] not in KERNEL_HEAD_DIMS:
        raise ValueError(
            f"q: head dim {q.shape[3]} is not supported by the kernels (supported: {KERNEL_HEAD_DIMS})"
        )
    check_dtype("q", q, torch.bfloat16, torch.float16, torch.float32)


def _values_checkable(*tensors: torch.Tensor) -> bool:
    """Value checks need a host read: only outside compilation and outside CUDA graph capture."""
    if torch.compiler.is_compiling():
        return False
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return False
    return True


def validate_tree_attention_values(
    prefix_len: torch.Tensor, ancestor_mask: torch.Tensor, window: int, capacity: int
) -> None:
    """Value checks (one host read; run once, outside capture): mask bits only below ``window``, and
    ``prefix_len + window <= capacity`` (the keys the page table or the contiguous K/V can hold)."""
    if window < MAX_NODES:
        beyond = ancestor_mask & ~((1 << window) - 1) if window > 0 else ancestor_mask
        if bool((beyond != 0).any()):
            bad = torch.nonzero(beyond != 0)[0].tolist()
            raise ValueError(
                f"ancestor_mask: bits at or above the window ({window}) are set, first at [b, r] = {bad}"
            )
    if bool((prefix_len < 0).any()):
        raise ValueError(f"prefix_len: must be >= 0, got {prefix_len.tolist()}")
    over = prefix_len + window > capacity
    if bool(over.any()):
        b = int(torch.nonzero(over)[0, 0])
        raise ValueError(
            f"prefix_len: request {b} has prefix_len {int(prefix_len[b])} + window {window} > {capacity} keys "
            f"(the page table is too short for the prefix; contiguous form: prefix_len must be <= L - N)"
        )


# ---------------------------------------------------------------------------------------------------------
# The Triton launcher
# ---------------------------------------------------------------------------------------------------------


def _launch_tree_attention_paged(
    q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale, num_splits=None,
    new_rows=None, window_offset: int = 0,
):  # fmt: skip
    """Run the cascade (prefix splits + window, then the merge). ``num_splits`` overrides the static choice;
    ``new_rows = (k, v, slots)``: the window reads and writes this call's rows (``tree_attention_paged_write``),
    window keys ``[window_offset, window_offset + R)``."""
    from ._tree_attention_kernels import launch_cascade

    _check_kernel_limits(q)
    return launch_cascade(
        q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale, num_splits,
        new_rows=new_rows, window_offset=window_offset,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The pure-torch reference: the CPU path and the oracle
# ---------------------------------------------------------------------------------------------------------


def tree_attention_paged_reference(
    q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale
) -> torch.Tensor:
    """Dense masked attention over every key the page table can address, in float64 for float64 inputs
    and float32 otherwise. ``[B, R, Hq, D]`` in q's dtype; rows that see nothing get zeros."""
    B, R, Hq, D = q.shape
    num_slots, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    work = torch.promote_types(q.dtype, torch.float32)
    capacity = page_table.shape[1] * page_size
    t = torch.arange(capacity, device=q.device)
    pages = page_table.long()[:, t // page_size]  # [B, C]
    slots = (pages * page_size + t % page_size).clamp(0, num_slots - 1)
    keys = k_cache[slots].to(work)  # [B, C, Hkv, D]
    vals = v_cache[slots].to(work)
    P = prefix_len.long()[:, None]  # [B, 1]
    j = t[None, :] - P  # window offset of key t, [B, C]
    in_window = (j >= 0) & (j < window)
    bit = (ancestor_mask[:, :, None] >> j.clamp(0, MAX_NODES - 1)[:, None, :]) & 1  # [B, R, C]
    visible = (t[None, None, :] < P[:, :, None]) | (in_window[:, None, :] & (bit != 0))  # [B, R, C]
    # Values no row looks at may be NaN/inf: clear them so 0-probability x NaN cannot poison the sum.
    vals = torch.where(visible.any(dim=1)[:, :, None, None], vals, torch.zeros((), dtype=work))
    qh = q.to(work).view(B, R, Hkv, G, D)
    scores = torch.einsum("brhgd,bchd->bhgrc", qh, keys) * scale  # [B, Hkv, G, R, C]
    vis = visible[:, None, None, :, :]
    scores = torch.where(vis, scores, torch.tensor(float("-inf"), dtype=work, device=q.device))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(vis, probs, torch.zeros((), dtype=work))  # rows with no key: NaN -> 0
    out = torch.einsum("bhgrc,bchd->brhgd", probs, vals).reshape(B, R, Hq, D)
    return out.to(q.dtype)


class _CpuPlan:
    """What the CPU path derives from a forward's metadata alone: the key slots, the visibility mask and
    what can be skipped. Every attention layer of one forward passes the same ``page_table`` / ``prefix_len``
    / ``ancestor_mask`` values, so the rewritten graph's 2nd..Lth layers reuse the plan the 1st built (SmolLM2
    shapes, 24 rows, 2 CPU threads: ~0.7 -> ~0.4-0.5 ms a layer, SDPA itself ~0.18).

    The plan is keyed by the three tensors' *values* (copies kept with it; they are a few hundred integers)
    plus the static arguments. Identity and version counters are not enough: Inductor's generated kernels
    write through raw pointers, so a buffer it reuses inside one compiled graph can hold a new mask under the
    same tensor object and version (a whole draft round compiled as one graph drafted from a stale plan).
    """

    __slots__ = ("values", "key", "slots", "visible", "seen", "all_seen", "rows_see_keys", "run_start", "C")

    def matches(self, tensors, key) -> bool:
        if key != self.key:
            return False
        return all(torch.equal(v, t) for v, t in zip(self.values, tensors))


_cpu_plan: _CpuPlan | None = None


def _plan_cpu(page_table, prefix_len, ancestor_mask, page_size, window, num_slots) -> _CpuPlan:
    global _cpu_plan
    tensors = (page_table, prefix_len, ancestor_mask)
    key = (page_size, window, num_slots, tuple((t.shape, t.dtype) for t in tensors))
    plan = _cpu_plan
    if plan is not None and plan.matches(tensors, key):
        return plan
    B, R = ancestor_mask.shape
    capacity = page_table.shape[1] * page_size
    longest = int(prefix_len.max()) if B else 0
    C = max(1, min(capacity, max(longest, 0) + window))
    t = torch.arange(C, device=ancestor_mask.device)
    pages = page_table.long()[:, t // page_size]  # [B, C]
    slots = (pages * page_size + t % page_size).clamp(0, num_slots - 1)
    P = prefix_len.long()[:, None]
    j = t[None, :] - P
    in_window = (j >= 0) & (j < window)
    bit = (ancestor_mask[:, :, None] >> j.clamp(0, MAX_NODES - 1)[:, None, :]) & 1
    visible = (t[None, None, :] < P[:, :, None]) | (in_window[:, None, :] & (bit != 0))  # [B, R, C]
    seen = visible.any(dim=1)  # [B, C]
    plan = _CpuPlan()
    plan.values = tuple(x.clone() for x in tensors)
    plan.key, plan.C, plan.slots, plan.visible = key, C, slots, visible
    plan.seen = seen[:, :, None, None]
    plan.all_seen = bool(seen.all())
    plan.rows_see_keys = bool(visible.any(dim=-1).all())
    # One request whose C keys sit in consecutive slots (a contiguous cache, or pages in order): K/V are a
    # view of the cache, no gather.
    start = int(slots[0, 0]) if B == 1 else -1
    plan.run_start = start if B == 1 and bool((slots[0] == start + t).all()) else None
    _cpu_plan = plan
    return plan


def _tree_attention_paged_cpu(
    q, k_cache, v_cache, page_table, prefix_len, ancestor_mask, page_size, window, scale
) -> torch.Tensor:
    """The CPU path: the reference's math on the keys that can be visible only, through SDPA.

    Reads keys ``[0, max_b(P_b) + window)`` instead of every addressable one (the host read of the longest
    prefix is free on the CPU, which captures nothing), and lets PyTorch's fused SDPA do the masked
    softmax-matmul (float32 at least, as the reference). Unseen values are cleared and rows that see no key
    return zeros, exactly as the reference; tests compare the op against the reference in float64. The
    metadata-only work is shared by the layers of a forward (:class:`_CpuPlan`).
    """
    B, R, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    plan = _plan_cpu(page_table, prefix_len, ancestor_mask, page_size, window, k_cache.shape[0])
    if plan.run_start is not None:
        keys = k_cache[plan.run_start : plan.run_start + plan.C][None]  # [1, C, Hkv, D], a view
        vals = v_cache[plan.run_start : plan.run_start + plan.C][None]
    else:
        keys, vals = k_cache[plan.slots], v_cache[plan.slots]  # [B, C, Hkv, D]
    keys, vals = keys.to(work), vals.to(work)
    # SDPA adds its boolean mask as 0 / -inf, and NaN + -inf is NaN: keys and values no row looks at (stale
    # or never written slots) are cleared, so masked scores are exact -inf and 0-probability x value is 0.
    zero = torch.zeros((), dtype=work)
    if not plan.all_seen:
        keys = torch.where(plan.seen, keys, zero)
        vals = torch.where(plan.seen, vals, zero)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(work).transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=plan.visible[:, None],
        scale=scale, enable_gqa=Hq != Hkv,
    )  # fmt: skip  # [B, Hq, R, D]
    if not plan.rows_see_keys:
        out = torch.where(plan.visible.any(dim=-1)[:, None, :, None], out, zero)
    return out.transpose(1, 2).contiguous().to(q.dtype)


def tree_attention_reference(q, k, v, ancestor_mask, prefix_len, scale=None) -> torch.Tensor:
    """Reference for :func:`tree_attention` (contiguous K/V), the same math as the paged reference."""
    B, N, _, D = q.shape
    L = k.shape[1]
    page_table = torch.arange(B, device=q.device, dtype=torch.int64).unsqueeze(1)
    return tree_attention_paged_reference(
        q, k.reshape(B * L, *k.shape[2:]), v.reshape(B * L, *v.shape[2:]), page_table, prefix_len,
        ancestor_mask, L, N, D**-0.5 if scale is None else scale,
    )  # fmt: skip

