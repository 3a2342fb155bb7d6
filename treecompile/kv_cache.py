"""The paged KV cache treecompile owns (HF cache classes append at their own length and ignore positions).

Layout
------
k[l], v[l]  : ``[num_slots, Hkv, D]`` per attention layer, ``num_slots = (1 + max_batch * pages_per_request)
              * page_size``. Page 0 (slots ``0 .. page_size - 1``) is the dummy page: padded and out-of-range
              writes land on slot 0 (:attr:`dummy_slot`) and no page table entry points at it.
page_table  : ``int32 [max_batch, pages_per_request]``; request b owns the fixed run of pages
              ``1 + b * pages_per_request ...`` (static assignment; a page allocator can replace the table's
              contents later without changing any op).
lengths     : ``int64 [max_batch]`` committed prefix length per request (the attention's ``prefix_len``).

Key ``t`` of request ``b`` lives in slot ``page_table[b, t // page_size] * page_size + t % page_size`` — the
addressing ``treespec::tree_attention_paged`` uses. All tensors are registered buffers, so their addresses
stay fixed for CUDA graphs and ``torch.compile`` sees them as module state.

FP8 E4M3 storage adds no structure: ``dtype=torch.float8_e4m3fn`` storage, ``kv_write`` narrows on store
(unscaled) and the attention kernels widen K/V to the query's dtype after loading; no layout change.
"""

from __future__ import annotations

import logging

import torch

import treecompile.ops  # noqa: F401  (registers torch.ops.treespec.page_slots)

logger = logging.getLogger(__name__)

_STORAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class PagedKVCache(torch.nn.Module):
    """Per-layer paged K/V storage with a dummy page, a static page table and per-request lengths.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : the attention layers' cache geometry.
    max_batch : requests the cache holds at once.
    max_seq_len : keys per request (prefix plus the speculative window); rounded up to whole pages.
    page_size : keys per page.
    dtype, device : storage dtype (bf16/fp16/fp32; float64 for CPU tests) and device.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_batch: int,
        max_seq_len: int,
        page_size: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
            ("max_batch", max_batch), ("max_seq_len", max_seq_len), ("page_size", page_size),
        ):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if dtype not in _STORAGE_DTYPES:
            raise ValueError(f"dtype: storage dtype must be one of {_STORAGE_DTYPES}, got {dtype}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_batch = max_batch
        self.page_size = page_size
        self.pages_per_request = -(-max_seq_len // page_size)
        self.capacity = self.pages_per_request * page_size
        self.num_slots = (1 + max_batch * self.pages_per_request) * page_size
        self.dummy_slot = 0
        shape = (self.num_slots, num_kv_heads, head_dim)
        for layer in range(num_layers):
            self.register_buffer(f"k{layer}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v{layer}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        first = 1 + torch.arange(max_batch, dtype=torch.int32, device=device)[:, None] * self.pages_per_request
        pages = first + torch.arange(self.pages_per_request, dtype=torch.int32, device=device)[None, :]
        self.register_buffer("page_table", pages, persistent=False)
        self.register_buffer("lengths", torch.zeros(max_batch, dtype=torch.int64, device=device), persistent=False)
        logger.debug(
            "PagedKVCache: %d layers x %s %s, %d pages of %d per request, %d slots",
            num_layers, shape, dtype, self.pages_per_request, page_size, self.num_slots,
        )  # fmt: skip

    @property
    def k(self) -> list[torch.Tensor]:
        """Per-layer key storage ``[num_slots, Hkv, D]``."""
        return [getattr(self, f"k{layer}") for layer in range(self.num_layers)]

    @property
    def v(self) -> list[torch.Tensor]:
        """Per-layer value storage ``[num_slots, Hkv, D]``."""
        return [getattr(self, f"v{layer}") for layer in range(self.num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.k0.dtype

    def slots(self, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Slots of ``positions int64 [B, T]`` for requests ``rows`` (default ``0..B-1``) -> ``int64 [B, T]``.

        Graph safe (a gather, no host read). Positions < 0 or >= :attr:`capacity` map to the dummy slot,
        never out of bounds.
        """
        if positions.dim() != 2 or positions.dtype != torch.int64:
            raise ValueError(f"positions: expected int64 [B, T], got {positions.dtype} {tuple(positions.shape)}")
        B = positions.shape[0]
        if rows is None:
            if B > self.max_batch:
                raise ValueError(f"positions: batch {B} exceeds max_batch {self.max_batch}")
            table = self.page_table[:B]
        else:
            if rows.shape != (B,):
                raise ValueError(f"rows: expected [{B}], got {tuple(rows.shape)}")
            table = self.page_table[rows]
        # One kernel on CUDA (torch.ops.treespec.page_slots); the torch reference on CPU.
        return torch.ops.treespec.page_slots(table, positions, self.page_size, self.dummy_slot)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``k, v [B, T, Hkv, D]`` (or ``[T, Hkv, D]``) at ``slots [B, T]`` (``[T]``) of ``layer``."""
        Hkv, D = k.shape[-2:]
        torch.ops.treespec.kv_write(
            getattr(self, f"k{layer}"), getattr(self, f"v{layer}"),
            k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D), slots.reshape(-1),
        )  # fmt: skip

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        ancestor_mask: torch.Tensor,
        window: int,
        scale: float,
        prefix_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tree attention of ``q [B, R, Hq, D]`` over ``layer``'s cache for requests ``0..B-1``; the prefix
        is :attr:`lengths` unless ``prefix_len int64 [B]`` is given."""
        B = q.shape[0]
        return torch.ops.treespec.tree_attention_paged(
            q, getattr(self, f"k{layer}"), getattr(self, f"v{layer}"), self.page_table[:B],
            self.lengths[:B] if prefix_len is None else prefix_len, ancestor_mask, self.page_size,
            window, scale,
        )  # fmt: skip

    def write_attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        ancestor_mask: torch.Tensor,
        window: int,
        scale: float,
        prefix_len: torch.Tensor | None = None,
        window_offset: int = 0,
    ) -> torch.Tensor:
        """:meth:`write` of ``k, v [B, T, Hkv, D]`` at ``slots [B, T]``, then :meth:`attention` of ``q [B, T,
        Hq, D]``, as one op (``tree_attention_paged_write``: on CUDA the window programs write the rows and
        read them as window keys ``[window_offset, window_offset + T)``)."""
        B, T = q.shape[:2]
        Hkv, D = k.shape[-2:]
        return torch.ops.treespec.tree_attention_paged_write(
            q, getattr(self, f"k{layer}"), getattr(self, f"v{layer}"), k.reshape(B * T, Hkv, D),
            v.reshape(B * T, Hkv, D), slots.reshape(B * T), self.page_table[:B],
            self.lengths[:B] if prefix_len is None else prefix_len, ancestor_mask, self.page_size, window, scale,
            window_offset,
        )  # fmt: skip

    def reset(self, rows: torch.Tensor | list[int] | None = None) -> None:
        """Forget requests ``rows`` (default: all): their lengths go to 0. K/V rows are not cleared because
        nothing reads past ``prefix_len + window``."""
        if rows is None:
            self.lengths.zero_()
        else:
            idx = torch.as_tensor(rows, dtype=torch.int64, device=self.lengths.device)
            self.lengths.index_fill_(0, idx, 0)
