"""Write K/V rows into a slot-addressed KV cache, in place.

Shapes
------
k_cache, v_cache : ``[num_slots, Hkv, D]`` (mutated in place; bf16/fp16/fp32, float64 on CPU)
k, v             : ``[T, Hkv, D]`` rows to store, in the caches' dtype
slots            : ``int64 [T]``, row t goes to ``k_cache[slots[t]]``

Padded rows point at a dummy slot (``PagedKVCache`` reserves page 0 for this), so every call writes all T
rows without a data-dependent shape. A slot outside ``[0, num_slots)`` is skipped, never written out of
bounds; duplicate slots leave one of the rows (unspecified which), which only happens on the dummy slot.

FP8 E4M3 storage slots in here without changing structure: the cache dtype becomes ``float8_e4m3fn``, the
kernel narrows on store (``.to(cache dtype)``, unscaled like every FP8 KV cache in the seed) and the
attention kernels widen after loading.
"""

from __future__ import annotations

import logging

import torch

from ._common import HAS_TRITON, check_dim, check_dtype, check_same_device, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

logger = logging.getLogger(__name__)

_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@torch.library.custom_op("treespec::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store ``k[t], v[t]`` at ``slots[t]`` of ``k_cache, v_cache`` (see the module docstring)."""
    _validate_kv_write(k_cache, v_cache, k, v, slots)
    if use_triton(k_cache, v_cache, k, v, slots):
        _launch_kv_write(k_cache, v_cache, k, v, slots)
    else:
        kv_write_reference(k_cache, v_cache, k, v, slots)


@kv_write.register_fake
def _(k_cache, v_cache, k, v, slots) -> None:
    _validate_kv_write(k_cache, v_cache, k, v, slots)
    return None


def _validate_kv_write(k_cache, v_cache, k, v, slots) -> None:
    check_dim("k_cache", k_cache, 3, "[num_slots, Hkv, D]")
    check_dim("v_cache", v_cache, 3, "[num_slots, Hkv, D]")
    check_dim("k", k, 3, "[T, Hkv, D]")
    check_dim("v", v, 3, "[T, Hkv, D]")
    check_dim("slots", slots, 1, "[T]")
    check_dtype("k_cache", k_cache, *_CACHE_DTYPES)
    check_dtype("slots", slots, torch.int64)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache: must match k_cache, got {tuple(v_cache.shape)} {v_cache.dtype} vs "
            f"{tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(
            f"k, v: expected [T, {k_cache.shape[1]}, {k_cache.shape[2]}] each, got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if k.shape[0] != slots.shape[0]:
        raise ValueError(f"slots: expected [{k.shape[0]}] (one slot per row of k), got {tuple(slots.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} must equal the cache dtype {k_cache.dtype}")
    check_same_device(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slots=slots)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {t.stride()}")


def _launch_kv_write(k_cache, v_cache, k, v, slots) -> None:
    """One program per (row, KV head): copies D contiguous elements of K and of V."""
    T, H, D = k.shape
    if T == 0:
        return
    kv_write_kernel[(T, H)](
        k_cache, v_cache, k, v, slots,
        k_cache.shape[0], slots.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        D=D, BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def kv_write_kernel(
        k_cache, v_cache, k, v, slots,
        num_slots, s_slot,
        s_kc0, s_kc1, s_vc0, s_vc1,
        s_k0, s_k1, s_k2, s_v0, s_v1, s_v2,
        D: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slots + t * s_slot)  # slots may be a strided view (a [B, 1] column flattened)
        ok = (slot >= 0) & (slot < num_slots)  # never write out of bounds
        slot = tl.where(ok, slot, 0)
        d = tl.arange(0, BLOCK_D)
        dm = d < tl.where(ok, D, 0)  # a skipped row masks every element
        kr = tl.load(k + t * s_k0 + h * s_k1 + d * s_k2, mask=dm)
        vr = tl.load(v + t * s_v0 + h * s_v1 + d * s_v2, mask=dm)
        tl.store(k_cache + slot * s_kc0 + h * s_kc1 + d, kr.to(k_cache.dtype.element_ty), mask=dm)
        tl.store(v_cache + slot * s_vc0 + h * s_vc1 + d, vr.to(v_cache.dtype.element_ty), mask=dm)


def kv_write_reference(k_cache, v_cache, k, v, slots) -> None:
    """Pure-torch kv_write (the CPU path): out-of-range slots are skipped."""
    ok = (slots >= 0) & (slots < k_cache.shape[0])
    if bool(ok.all()):  # the common case, one index_copy_ per cache (the check is free on the CPU)
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        return
    idx = slots[ok]
    k_cache[idx] = k[ok].to(k_cache.dtype)
    v_cache[idx] = v[ok].to(v_cache.dtype)
