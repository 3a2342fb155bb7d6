"""The greedy token of each row: ``torch.argmax`` over the vocabulary in two small kernels.

Why it exists: every verify and decode round takes the argmax of the target's logits over the whole
vocabulary. ``torch.argmax`` runs it as one reduction kernel that took ~12 us on the H200 for 1 or 64 rows
of SmolLM2's 49152 entries (18 us for 256 rows), 1-2% of a SmolLM2 round. Splitting each row into slices
(one program per (row, slice)) and merging the slices' winners in a second tiny kernel took 3.3 / 4.9 /
10.1 us for the same 1 / 64 / 256 rows (notes/gpu-2026-12-01/call1/argmax.json). The split is the same
two-stage pattern as ``draft_topk``.

Shapes
------
logits  [R, V]   float16 / bfloat16 / float32 / float64; last-dim stride 1, any row stride; V >= 1
index   [R]      int64: exactly ``torch.argmax(logits, dim=-1)``

Order is torch's: the first maximum; a NaN counts as greater than every number (the first NaN wins); an all
-inf row gives 0. Values are compared in float32 (float64 for float64 logits): widening 16-bit floats is
exact, so ties and order are those of the logits themselves.
Only metadata is checked at the boundary: no host sync, safe under CUDA-graph capture.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, check_dim, check_dtype, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["vocab_argmax", "vocab_argmax_reference"]

MAX_BLOCK = 4096  # vocabulary slice per stage-1 program (H200 sweep: best or within 0.2 us of it at 1-256 rows)
_NO_INDEX = 2**31 - 1  # index of out-of-range lanes: loses every tie to a real (lower) index

_LOGITS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("treespec::vocab_argmax", mutates_args=())
def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, -1)`` for ``logits [R, V]`` -> ``[R]`` int64."""
    _check_inputs(logits)
    if use_triton(logits):
        index = logits.new_empty((logits.shape[0],), dtype=torch.int64)
        _launch_vocab_argmax(logits, index)
        return index
    return vocab_argmax_reference(logits)


@vocab_argmax.register_fake
def _(logits: torch.Tensor) -> torch.Tensor:
    _check_inputs(logits)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def _check_inputs(logits: torch.Tensor) -> None:
    check_dim("logits", logits, 2, "[R, V]")
    check_dtype("logits", logits, *_LOGITS_DTYPES)
    if logits.shape[1] < 1:
        raise ValueError(f"logits: the vocabulary dim must hold at least 1 entry, got shape {tuple(logits.shape)}")
    if logits.shape[1] > _NO_INDEX:
        raise ValueError(f"logits: at most {_NO_INDEX} vocabulary entries (int32 indices), got {logits.shape[1]}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:  # each slice is read as one contiguous run
        raise ValueError(f"logits: the last dim must have stride 1, got strides {tuple(logits.stride())}")


# --------------------------------------------------------------------------------------------------
# Triton launcher and kernels
# --------------------------------------------------------------------------------------------------


def _launch_vocab_argmax(logits: torch.Tensor, index: torch.Tensor, block: int | None = None) -> None:
    """Fill preallocated ``index [R]`` int64. ``block``: the vocabulary slice per stage-1 program (a power of
    two; default ``min(MAX_BLOCK, next_power_of_2(V))``). Workspace sizes depend on shapes only: capturable."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    block = block or min(MAX_BLOCK, triton.next_power_of_2(vocab))
    if block & (block - 1):
        raise ValueError(f"block: expected a power of two, got {block}")
    num_blocks = triton.cdiv(vocab, block)
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    best_value = torch.empty((rows, num_blocks), dtype=work, device=logits.device)
    best_index = torch.empty((rows, num_blocks), dtype=torch.int32, device=logits.device)
    _argmax_slice_kernel[(rows, num_blocks)](
        logits, best_value, best_index, vocab, num_blocks, logits.stride(0),
        BLOCK=block, WORK_DTYPE=tl.float64 if work == torch.float64 else tl.float32,
        num_warps=4 if block >= 1024 else 1,
    )  # fmt: skip
    _argmax_merge_kernel[(rows,)](
        best_value, best_index, index, num_blocks, index.stride(0),
        BLOCK_NB=triton.next_power_of_2(num_blocks), num_warps=1,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _argmax_slice_kernel(
        logits_ptr, best_value_ptr, best_index_ptr, vocab, num_blocks, stride_lr,
        BLOCK: tl.constexpr, WORK_DTYPE: tl.constexpr,
    ):  # fmt: skip
        # Stage 1, one program per (row, slice): the slice's winner. A slice holding a NaN reports its first
        # NaN (stored as NaN); otherwise its largest value and the first index holding it.
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offs < vocab
        x = tl.load(logits_ptr + row * stride_lr + offs, mask=in_vocab, other=float("-inf")).to(WORK_DTYPE)
        is_nan = x != x  # noqa: PLR0124
        idx = tl.where(in_vocab, offs, 2147483647)
        best = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
        first_best = tl.min(tl.where(x == best, idx, 2147483647), axis=0)
        first_nan = tl.min(tl.where(is_nan, idx, 2147483647), axis=0)
        has_nan = first_nan < 2147483647
        out = row * num_blocks + blk
        tl.store(best_value_ptr + out, tl.where(has_nan, float("nan"), best))
        tl.store(best_index_ptr + out, tl.where(has_nan, first_nan, first_best))

    @triton.jit
    def _argmax_merge_kernel(best_value_ptr, best_index_ptr, index_ptr, num_blocks, stride_i, BLOCK_NB: tl.constexpr):
        # Stage 2, one program per row: the same rule over the slices' winners, which are in index order.
        row = tl.program_id(0).to(tl.int64)
        b = tl.arange(0, BLOCK_NB)
        in_b = b < num_blocks
        v = tl.load(best_value_ptr + row * num_blocks + b, mask=in_b, other=float("-inf"))
        i = tl.load(best_index_ptr + row * num_blocks + b, mask=in_b, other=2147483647)
        is_nan = v != v  # noqa: PLR0124
        best = tl.max(tl.where(is_nan, float("-inf"), v), axis=0)
        first_best = tl.min(tl.where(v == best, i, 2147483647), axis=0)  # padding's index loses every tie
        first_nan = tl.min(tl.where(is_nan, i, 2147483647), axis=0)
        sel = tl.where(first_nan < 2147483647, first_nan, first_best)
        tl.store(index_ptr + row * stride_i, sel.to(tl.int64))


# --------------------------------------------------------------------------------------------------
# Reference (CPU path and test oracle)
# --------------------------------------------------------------------------------------------------


def vocab_argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, -1)``: the contract itself."""
    return torch.argmax(logits, dim=-1)
