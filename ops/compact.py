"""KV compaction: move the accepted path's rows to the window's leading slots, in place.

After verify, request b's accepted nodes ``accepted_path[b, :accept_len[b]]`` (root first) must occupy
the first ``accept_len[b]`` rows of its verify window, so everything downstream sees a chain. For every
buffer and every ``i < accept_len[b]``::

    buffer[slots[b, i]] <- buffer[slots[b, accepted_path[b, i]]]      (values as before the call)

Source and destination rows overlap (path [0, 2, 3] moves 2 -> 1 and 3 -> 2); rows at
``i >= accept_len[b]`` are left untouched.

Shapes
------
buffers        list of [num_slots, ...] tensors, any dtype (fp32, bf16, fp16, fp8, uint8, ...), all
               sharing the slot space (same ``num_slots``) and the device; each row (``buffer[s]``)
               must be contiguous, rows may be strided (e.g. the K half of a [num_slots, 2, H, D] cache)
slots          int64 [B, W]   cache slot of each window row of request b, W >= N (paging is the caller's
                              business); ``slots[b, :N]`` must be distinct across the whole batch
accepted_path  int64 [B, N]   as returned by ``verify_tree_greedy`` (1 <= N <= 64)
accept_len     int64 [B]      1 <= accept_len[b] <= N

``torch.ops.treespec.compact_window_rows(buffers, slots, accepted_path, accept_len) -> ()`` mutates every
buffer. The copy is dtype-agnostic: rows are moved as 32-bit words when the row size, row stride and base
address allow it, else as bytes, so FP8 and bf16 caches move alike. Rows whose source equals their
destination (a chain's path) are skipped.

One launch per word size moves every buffer: the kernel reads each buffer's base address, row stride and
row size from a device pointer table. The table is cached per buffer set (keyed by data pointers, strides
and row sizes); building it is one host-to-device copy, which CUDA-graph capture forbids, so **call the op
once with the final buffers before capture** (the warm-up run). A capture that meets an unseen buffer set
falls back to one launch per buffer (correct, slower) and logs a warning. Tables a captured graph uses
are kept until :func:`clear_pointer_tables`; others are evicted least recently used first.

Boundary checks read metadata only; :func:`validate_accepted_path` checks the values (path is a root-first
increasing node list, lengths and slots in range, slots distinct) once, outside capture.
"""

from __future__ import annotations

import collections
import logging

import torch

from ._common import (
    HAS_TRITON,
    check_dim,
    check_dtype,
    check_num_nodes,
    triton_interpret,
    use_triton,
)
from .tree_mask import requests_per_program

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = [
    "compact_window_rows",
    "compact_window_rows_reference",
    "validate_accepted_path",
    "clear_pointer_tables",
]

_MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions 1 and 2
_TILE_WORDS = 4096  # rows x columns one program holds in registers


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::compact_window_rows", mutates_args=("buffers",))
def compact_window_rows(
    buffers: list[torch.Tensor],
    slots: torch.Tensor,
    accepted_path: torch.Tensor,
    accept_len: torch.Tensor,
) -> None:
    """Move each request's accepted rows to its window's leading slots in every buffer, in place."""
    _check_compact_inputs(buffers, slots, accepted_path, accept_len)
    if not buffers:
        return
    _check_no_aliasing(buffers)
    if use_triton(slots, accepted_path, accept_len, *buffers):
        _launch_compact_window_rows(buffers, slots, accepted_path, accept_len)
    else:
        compact_window_rows_reference(buffers, slots, accepted_path, accept_len)


@compact_window_rows.register_fake
def _(buffers, slots, accepted_path, accept_len) -> None:
    _check_compact_inputs(buffers, slots, accepted_path, accept_len)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each row ``t[s]`` is one dense run of memory (the row stride itself is free)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_compact_inputs(
    buffers: list[torch.Tensor],
    slots: torch.Tensor,
    accepted_path: torch.Tensor,
    accept_len: torch.Tensor,
) -> None:
    """Metadata-only checks (no host sync, safe under capture and on fake tensors)."""
    for name, t in (("slots", slots), ("accepted_path", accepted_path), ("accept_len", accept_len)):
        check_dtype(name, t, torch.int64)
    check_dim("slots", slots, 2, "[B, W]")
    check_dim("accepted_path", accepted_path, 2, "[B, N]")
    check_dim("accept_len", accept_len, 1, "[B]")
    batch, num_nodes = accepted_path.shape
    check_num_nodes("accepted_path.shape[1]", num_nodes)
    if slots.shape[0] != batch:
        raise ValueError(
            f"slots: batch size {slots.shape[0]} does not match accepted_path's batch size {batch}"
        )
    if accept_len.shape[0] != batch:
        raise ValueError(
            f"accept_len: batch size {accept_len.shape[0]} does not match accepted_path's batch size "
            f"{batch}"
        )
    if slots.shape[1] < num_nodes:
        raise ValueError(
            f"slots: the window must have W >= N = {num_nodes} rows per request, got W = {slots.shape[1]}"
        )
    if batch > _MAX_GRID_YZ:
        raise ValueError(f"accepted_path: batch size {batch} exceeds the limit {_MAX_GRID_YZ}")
    if len(buffers) > _MAX_GRID_YZ:
        raise ValueError(f"buffers: {len(buffers)} buffers exceed the limit {_MAX_GRID_YZ}")
    device = slots.device
    for name, t in (("accepted_path", accepted_path), ("accept_len", accept_len)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but slots is on {device}")
    num_slots = buffers[0].shape[0] if buffers and buffers[0].dim() else None
    for k, buf in enumerate(buffers):
        if buf.dim() < 1:
            raise ValueError(f"buffers[{k}]: expected a [num_slots, ...] tensor, got a 0-d tensor")
        if buf.device != device:
            raise ValueError(f"buffers[{k}] is on {buf.device} but slots is on {device}")
        if buf.shape[0] != num_slots:
            raise ValueError(
                f"buffers[{k}]: has {buf.shape[0]} slots but buffers[0] has {num_slots}; all buffers "
                "must share one slot space"
            )
        if not _rows_contiguous(buf):
            raise ValueError(
                f"buffers[{k}]: each row buffers[{k}][s] must be contiguous, got shape "
                f"{tuple(buf.shape)} with strides {buf.stride()}"
            )


def validate_accepted_path(
    accepted_path: torch.Tensor,
    accept_len: torch.Tensor,
    slots: torch.Tensor | None = None,
    num_slots: int | None = None,
) -> None:
    """Value checks for compaction (host-side, reads tensors: call once outside captured regions).

    Raises ValueError unless ``1 <= accept_len[b] <= N``, ``accepted_path[b, 0] == 0`` and the path is
    strictly increasing within ``[0, N)`` (a root-first tree path); with ``slots``: the window's slots
    ``slots[:, :N]`` are distinct over the whole batch and, with ``num_slots``, within ``[0, num_slots)``.
    """
    check_dtype("accepted_path", accepted_path, torch.int64)
    check_dtype("accept_len", accept_len, torch.int64)
    check_dim("accepted_path", accepted_path, 2, "[B, N]")
    check_dim("accept_len", accept_len, 1, "[B]")
    batch, num_nodes = accepted_path.shape
    check_num_nodes("accepted_path.shape[1]", num_nodes)
    if accept_len.shape[0] != batch:
        raise ValueError(
            f"accept_len: batch size {accept_len.shape[0]} does not match accepted_path's batch size "
            f"{batch}"
        )
    path = accepted_path.detach().cpu()
    lengths = accept_len.detach().cpu()
    for b in range(batch):
        n = int(lengths[b])
        if not 1 <= n <= num_nodes:
            raise ValueError(f"accept_len: need 1 <= accept_len[b] <= N = {num_nodes}, got {n} at b = {b}")
        row = path[b, :n]
        if int(row[0]) != 0:
            raise ValueError(
                f"accepted_path: must start at the root, got accepted_path[{b}, 0] = {int(row[0])}"
            )
        if n > 1 and not bool((row[1:] > row[:-1]).all()):
            raise ValueError(
                f"accepted_path: the accepted nodes of request {b} must increase, got {row.tolist()}"
            )
        if int(row[-1]) >= num_nodes:
            raise ValueError(
                f"accepted_path: node {int(row[-1])} of request {b} is outside the tree of N = {num_nodes}"
            )
    if slots is None:
        return
    check_dtype("slots", slots, torch.int64)
    check_dim("slots", slots, 2, "[B, W]")
    if slots.shape[0] != batch or slots.shape[1] < num_nodes:
        raise ValueError(f"slots: expected [B = {batch}, W >= {num_nodes}], got {tuple(slots.shape)}")
    window = slots[:, :num_nodes].detach().cpu().reshape(-1)
    if window.unique().numel() != window.numel():
        raise ValueError("slots: the window slots slots[:, :N] must be distinct across the batch")
    if num_slots is not None:
        low, high = int(window.min()), int(window.max())
        if low < 0 or high >= num_slots:
            raise ValueError(
                f"slots: window slots must lie in [0, num_slots = {num_slots}), got [{low}, {high}]"
            )


# --------------------------------------------------------------------------------------------------
# Triton launchers and kernels
# --------------------------------------------------------------------------------------------------


def _row_layout(buf: torch.Tensor) -> tuple[int, int, int]:
    """(word bytes, row stride in words, row size in words) for moving ``buf``'s rows as words."""
    row_bytes = buf[0].numel() * buf.element_size() if buf.shape[0] else 0
    stride_bytes = buf.stride(0) * buf.element_size()
    word = 4 if row_bytes % 4 == 0 and stride_bytes % 4 == 0 and buf.data_ptr() % 4 == 0 else 1
    return word, stride_bytes // word, row_bytes // word


_ALIAS_CHECKED: set = set()


def _check_no_aliasing(buffers: list[torch.Tensor]) -> None:
    """Two buffers sharing bytes would be moved twice, the second time from already moved rows.

    Reads data pointers (metadata, no sync); the pairwise check runs once per buffer set.
    """
    spans = []
    for buf in buffers:
        size = buf.element_size()
        row = buf[0].numel() * size if buf.shape[0] else 0
        start, stride = buf.data_ptr(), buf.stride(0) * size
        spans.append((start, start + (buf.shape[0] - 1) * stride + row, stride, row))
    key = tuple(spans)
    if key in _ALIAS_CHECKED:
        return
    for i in range(len(spans)):
        a_start, a_end, a_stride, a_row = spans[i]
        for j in range(i + 1, len(spans)):
            b_start, b_end, b_stride, b_row = spans[j]
            if a_row == 0 or b_row == 0 or a_end <= b_start or b_end <= a_start:
                continue
            if a_stride == b_stride and a_start != b_start:
                # Interleaved rows of one allocation (K and V halves of one cache): disjoint when
                # each row's bytes fit between the other's within one stride period.
                if a_start < b_start:
                    gap, first_row, second_row = b_start - a_start, a_row, b_row
                else:
                    gap, first_row, second_row = a_start - b_start, b_row, a_row
                gap %= a_stride
                if first_row <= gap and gap + second_row <= a_stride:
                    continue
            raise ValueError(
                f"buffers[{i}] and buffers[{j}] share memory; pass each physical region once"
            )
    if len(_ALIAS_CHECKED) >= 1024:  # bounded: only a cache of checks already passed
        _ALIAS_CHECKED.clear()
    _ALIAS_CHECKED.add(key)


# Pointer tables by buffer set, least recently used first. Tables a CUDA graph captured are pinned: the
# graph reads them at every replay, so they must outlive it. Others are evicted past _MAX_TABLES, which
# keeps memory bounded when buffers move every call (e.g. functionalized clones outside Inductor).
_POINTER_TABLES: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
_PINNED_TABLES: set = set()
_MAX_TABLES = 64
_warned_eviction = False


def clear_pointer_tables() -> None:
    """Drop every cached pointer table, pinned ones included (no CUDA graph captured with one of them
    may replay afterwards)."""
    _POINTER_TABLES.clear()
    _PINNED_TABLES.clear()


def _pointer_table(
    buffers: list[torch.Tensor], layouts: list[tuple[int, int, int]], device: torch.device
) -> torch.Tensor | None:
    """The cached int64 [num_buffers, 3] table (base address, row stride, row size in words), or None
    when it is missing and cannot be built now (CUDA-graph capture forbids the host-to-device copy)."""
    global _warned_eviction
    rows = [(buf.data_ptr(), stride, row) for buf, (_, stride, row) in zip(buffers, layouts)]
    key = (str(device), tuple(rows))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    table = _POINTER_TABLES.get(key)
    if table is not None:
        _POINTER_TABLES.move_to_end(key)
        if capturing:
            _PINNED_TABLES.add(key)
        return table
    if capturing:
        return None
    table = torch.tensor(rows, dtype=torch.int64, device=device)
    _POINTER_TABLES[key] = table
    logger.debug("compact_window_rows: built a pointer table for %d buffers", len(rows))
    if len(_POINTER_TABLES) > _MAX_TABLES:
        victim = next((k for k in _POINTER_TABLES if k not in _PINNED_TABLES), None)
        if victim is not None:
            del _POINTER_TABLES[victim]
            if not _warned_eviction:
                _warned_eviction = True
                logger.warning(
                    "compact_window_rows: more than %d buffer sets seen; each new set costs a "
                    "host-to-device copy. Keep KV buffers at fixed addresses.",
                    _MAX_TABLES,
                )
    return table


def _tile(num_nodes: int, batch: int, max_row_words: int, block_b: int | None) -> tuple[int, int, int]:
    """(requests, nodes, columns) one program moves; the interpreter prefers few, large programs."""
    block_n = triton.next_power_of_2(num_nodes)
    tile_words = _TILE_WORDS * (16 if triton_interpret() else 1)
    block_b = block_b or requests_per_program(batch, cap=max(1, 1024 // block_n))
    rows = block_b * block_n
    block_c = min(triton.next_power_of_2(max(max_row_words, 1)), max(16, tile_words // rows))
    return block_b, block_n, block_c


def _launch_compact_window_rows(
    buffers: list[torch.Tensor],
    slots: torch.Tensor,
    accepted_path: torch.Tensor,
    accept_len: torch.Tensor,
    fused: bool = True,
    block_b: int | None = None,
) -> None:
    """Move the rows with Triton: one launch per word size (``fused``) or one launch per buffer.

    ``block_b``: whole requests per program (a power of two; default ``requests_per_program``).
    """
    batch, num_nodes = accepted_path.shape
    layouts = [_row_layout(buf) for buf in buffers]
    live = [(buf, lay) for buf, lay in zip(buffers, layouts) if lay[2] > 0]
    if batch == 0 or not live:
        return
    index_args = (
        slots,
        accepted_path,
        accept_len,
        batch,
        num_nodes,
        slots.stride(0),
        slots.stride(1),
        accepted_path.stride(0),
        accepted_path.stride(1),
        accept_len.stride(0),
    )
    for word in (4, 1):
        group = [(buf, lay) for buf, lay in live if lay[0] == word]
        if not group:
            continue
        max_row = max(lay[2] for _, lay in group)
        bb, bn, bc = _tile(num_nodes, batch, max_row, block_b)
        programs_b = triton.cdiv(batch, bb)
        table = None
        if fused:
            table = _pointer_table([b for b, _ in group], [lay for _, lay in group], slots.device)
            if table is None:
                _warn_unfused_capture()
        if table is not None:
            grid = (triton.cdiv(max_row, bc), len(group), programs_b)
            _compact_rows_table_kernel[grid](
                table, *index_args, WORD_BYTES=word, BLOCK_B=bb, BLOCK_N=bn, BLOCK_C=bc
            )
            continue
        for buf, (_, stride, row) in group:
            grid = (triton.cdiv(row, bc), 1, programs_b)
            _compact_rows_kernel[grid](
                _word_view(buf, word), stride, row, *index_args, BLOCK_B=bb, BLOCK_N=bn, BLOCK_C=bc
            )


_warned_unfused = False


def _warn_unfused_capture() -> None:
    global _warned_unfused
    if not _warned_unfused:
        _warned_unfused = True
        logger.warning(
            "compact_window_rows: first call with these buffers happened inside CUDA-graph capture; "
            "falling back to one launch per buffer. Run the op once before capture (warm-up)."
        )


def _word_view(buf: torch.Tensor, word: int) -> torch.Tensor:
    """``buf`` as [num_slots, row_words] of int32 (word 4) or uint8 (word 1), sharing its memory."""
    # view(), never reshape(): a copy would silently move nothing.
    rows = buf.unsqueeze(1) if buf.dim() == 1 else buf.view(buf.shape[0], -1)
    rows = rows.view(torch.uint8)
    return rows.view(torch.int32) if word == 4 else rows


if HAS_TRITON:

    @triton.jit
    def _move_rows(
        base,
        row_stride,
        row_words,
        slots_ptr,
        path_ptr,
        accept_len_ptr,
        batch,
        num_nodes,
        stride_sb,
        stride_sn,
        stride_pb,
        stride_pn,
        stride_l,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # One program = BLOCK_B whole requests x one column chunk of one buffer. It loads every source
        # row of its requests' chunk before storing any (idea from SGLang's
        # copy_all_layer_kv_cache_tiled), so overlapping moves (path [0, 2, 3]: 2 -> 1 while 3 -> 2)
        # read pre-call values whatever the path's order. A request never spans two programs.
        rows = tl.arange(0, BLOCK_B * BLOCK_N)
        reqs = tl.program_id(2).to(tl.int64) * BLOCK_B + rows // BLOCK_N
        nodes = rows % BLOCK_N
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        live_req = reqs < batch
        n = tl.load(accept_len_ptr + reqs * stride_l, mask=live_req, other=0)
        live = live_req & (nodes < n) & (nodes < num_nodes)
        path = tl.load(path_ptr + reqs * stride_pb + nodes * stride_pn, mask=live, other=0)
        src = tl.load(slots_ptr + reqs * stride_sb + path * stride_sn, mask=live, other=0)
        dst = tl.load(slots_ptr + reqs * stride_sb + nodes * stride_sn, mask=live, other=0)
        move = live & (src != dst)  # a row already in place (the root, a chain) costs nothing
        mask = move[:, None] & (cols < row_words)[None, :]
        values = tl.load(base + src[:, None] * row_stride + cols[None, :], mask=mask)
        tl.debug_barrier()  # every thread's loads land before any thread's stores
        tl.store(base + dst[:, None] * row_stride + cols[None, :], values, mask=mask)

    @triton.jit
    def _compact_rows_kernel(
        words_ptr,
        row_stride,
        row_words,
        slots_ptr,
        path_ptr,
        accept_len_ptr,
        batch,
        num_nodes,
        stride_sb,
        stride_sn,
        stride_pb,
        stride_pn,
        stride_l,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        _move_rows(
            words_ptr, row_stride, row_words, slots_ptr, path_ptr, accept_len_ptr, batch, num_nodes,
            stride_sb, stride_sn, stride_pb, stride_pn, stride_l, BLOCK_B, BLOCK_N, BLOCK_C,
        )

    @triton.jit
    def _compact_rows_table_kernel(
        table_ptr,
        slots_ptr,
        path_ptr,
        accept_len_ptr,
        batch,
        num_nodes,
        stride_sb,
        stride_sn,
        stride_pb,
        stride_pn,
        stride_l,
        WORD_BYTES: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # Program axis 1 picks the buffer; its [address, row stride, row size] comes from the table, so
        # every buffer of one word size moves in this single launch.
        entry = table_ptr + tl.program_id(1).to(tl.int64) * 3
        address = tl.load(entry)
        row_stride = tl.load(entry + 1)
        row_words = tl.load(entry + 2)
        if WORD_BYTES == 4:
            base = address.to(tl.pointer_type(tl.int32))
        else:
            base = address.to(tl.pointer_type(tl.uint8))
        _move_rows(
            base, row_stride, row_words, slots_ptr, path_ptr, accept_len_ptr, batch, num_nodes,
            stride_sb, stride_sn, stride_pb, stride_pn, stride_l, BLOCK_B, BLOCK_N, BLOCK_C,
        )


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle)
# --------------------------------------------------------------------------------------------------


def compact_window_rows_reference(
    buffers: list[torch.Tensor],
    slots: torch.Tensor,
    accepted_path: torch.Tensor,
    accept_len: torch.Tensor,
) -> None:
    """Pure-torch compaction, in place, on any dtype (rows are moved as bytes). Fixed shapes: rows past
    ``accept_len`` are rewritten with their own pre-call bytes, which leaves them unchanged."""
    batch, num_nodes = accepted_path.shape
    nodes = torch.arange(num_nodes, device=accepted_path.device).expand(batch, num_nodes)
    live = nodes < accept_len.unsqueeze(1)
    path = torch.where(live, accepted_path, nodes)
    dst = slots[:, :num_nodes].reshape(-1)
    src = slots.gather(1, path).reshape(-1)
    for buf in buffers:
        if buf.numel() == 0:
            continue
        rows = _word_view(buf, 1)
        rows[dst] = rows[src]
