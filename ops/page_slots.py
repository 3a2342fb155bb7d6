"""Cache slots of key positions through a page table, in one kernel.

Key ``t`` of request ``b`` lives in slot ``page_table[b, t // page_size] * page_size + t % page_size``
(:mod:`treecompile.kv_cache`). Positions outside ``[0, capacity)`` (``capacity = pages * page_size``) map
to ``dummy_slot`` and never index the table out of bounds. In torch this is ~12 small kernels (compares,
where, gather, div, mod, mul, add, fills); a draft round computes it once per step, so inside a captured
round it cost ~70 us of kernel launches per round at SmolLM2 shapes on the H200. Here it is one.

Shapes
------
page_table  [B, P]  int32 or int64 page ids (any strides)
positions   [B, T]  int64 key positions (any strides)
slots       [B, T]  int64 (contiguous)

``torch.ops.treespec.page_slots(page_table, positions, page_size, dummy_slot) -> slots``. Only metadata is
checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

import logging

import torch

from ._common import HAS_TRITON, check_dim, check_dtype, check_same_device, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

__all__ = ["page_slots", "page_slots_reference"]


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::page_slots", mutates_args=())
def page_slots(page_table: torch.Tensor, positions: torch.Tensor, page_size: int, dummy_slot: int) -> torch.Tensor:
    """``page_table [B, P], positions [B, T] -> slots [B, T]`` int64; out-of-range positions -> dummy_slot."""
    _check_inputs(page_table, positions, page_size, dummy_slot)
    if use_triton(page_table, positions):
        slots = torch.empty(positions.shape, dtype=torch.int64, device=positions.device)
        _launch_page_slots(page_table, positions, page_size, dummy_slot, slots)
        return slots
    return page_slots_reference(page_table, positions, page_size, dummy_slot)


@page_slots.register_fake
def _(page_table: torch.Tensor, positions: torch.Tensor, page_size: int, dummy_slot: int):
    _check_inputs(page_table, positions, page_size, dummy_slot)
    return positions.new_empty(positions.shape, dtype=torch.int64)


# --------------------------------------------------------------------------------------------------
# Validation (metadata only)
# --------------------------------------------------------------------------------------------------


def _check_inputs(page_table: torch.Tensor, positions: torch.Tensor, page_size: int, dummy_slot: int) -> None:
    check_dim("page_table", page_table, 2, "[B, P]")
    check_dim("positions", positions, 2, "[B, T]")
    check_dtype("page_table", page_table, torch.int32, torch.int64)
    check_dtype("positions", positions, torch.int64)
    check_same_device(page_table=page_table, positions=positions)
    if positions.shape[0] != page_table.shape[0]:
        raise ValueError(
            f"positions: batch size {positions.shape[0]} does not match page_table's {page_table.shape[0]}"
        )
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    if isinstance(dummy_slot, bool) or not isinstance(dummy_slot, int) or dummy_slot < 0:
        raise ValueError(f"dummy_slot: expected a non-negative int, got {dummy_slot!r}")


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernel
# --------------------------------------------------------------------------------------------------

_BLOCK = 256


def _launch_page_slots(page_table, positions, page_size, dummy_slot, slots) -> None:
    B, T = positions.shape
    if B * T == 0:
        return
    _page_slots_kernel[(triton.cdiv(B * T, _BLOCK),)](
        page_table, positions, slots,
        page_table.stride(0), page_table.stride(1), positions.stride(0), positions.stride(1),
        B * T, T, page_table.shape[1] * page_size, page_size, dummy_slot,
        BLOCK=_BLOCK,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _page_slots_kernel(
        page_table, positions, slots, s_tb, s_tp, s_pb, s_pt, n, T, capacity, page_size, dummy_slot,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        b = (i // T).to(tl.int64)
        t = i % T
        pos = tl.load(positions + b * s_pb + t * s_pt, mask=live, other=-1)
        ok = (pos >= 0) & (pos < capacity)
        safe = tl.where(ok, pos, 0)
        page = tl.load(page_table + b * s_tb + (safe // page_size) * s_tp, mask=live & ok, other=0).to(tl.int64)
        slot = tl.where(ok, page * page_size + safe % page_size, dummy_slot)
        tl.store(slots + i, slot, mask=live)


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and oracle)
# --------------------------------------------------------------------------------------------------


def page_slots_reference(page_table: torch.Tensor, positions: torch.Tensor, page_size: int, dummy_slot: int):
    """Pure torch: the addressing rule of the module docstring."""
    capacity = page_table.shape[1] * page_size
    ok = (positions >= 0) & (positions < capacity)
    safe = torch.where(ok, positions, torch.zeros_like(positions))
    page = torch.gather(page_table, 1, safe // page_size).long() if page_table.shape[1] else torch.zeros_like(safe)
    slot = page * page_size + safe % page_size
    return torch.where(ok, slot, torch.full_like(slot, dummy_slot))
