"""Shared plumbing for the `treespec` op library.

Every op module follows one shape: docstring with shapes, the `torch.library` custom op and its fake,
boundary validation, the Triton launcher, the kernel, and the pure-torch reference. The reference is the
CPU path and the test oracle; CUDA tensors go to the Triton launcher. Tests run the launchers on CPU
tensors under ``TRITON_INTERPRET=1``.

Validation here only reads shapes, dtypes and devices (metadata), never tensor values, so it adds no host
sync and is safe inside captured regions. Value checks (is `parents` a tree?) live in explicit
``validate_*`` helpers that callers run once, outside capture.
"""

from __future__ import annotations

import functools
import math
import os
import struct

import torch

MAX_NODES = 64  # the ancestor mask is one 64-bit word per node

try:  # Triton is optional on CPU-only machines.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def float_pair(x: float) -> tuple[float, float]:
    """``x`` as ``(head, tail)``: head the float32 nearest x, tail the float32 nearest ``x - head``.

    A compiled Triton kernel takes a Python float argument as float32 (the interpreter keeps float64), so a
    float64 kernel handed ``x`` alone would compute with float32(x): a scale of 8 ** -0.5 is then off by 2e-8
    relative. Kernels take both parts and form ``(tl.zeros((), acc) + head) + tail`` (the interpreter hands a
    float over as a Python float, with no ``.to``): x to about 2^-48 relative in float64, and exactly head =
    float32(x) in float32 (tail is at most half an ulp of head), so the float32 paths round as before.
    Non-finite x (an absent limit, +-inf) and x past float32's range are ``(x, 0.0)``."""
    if not math.isfinite(x):
        return x, 0.0
    try:
        head = struct.unpack("f", struct.pack("f", x))[0]  # round to nearest float32
    except OverflowError:  # some Pythons refuse values past float32's range, others round them to +-inf
        head = math.inf
    if not math.isfinite(head):  # past float32's range: the kernel sees +-inf, as with x alone
        return x, 0.0
    return head, struct.unpack("f", struct.pack("f", x - head))[0]


L2_PREFETCH_MAX = 16  # tiles a program may hint into L2 ahead (a power of two: a tl.arange length)


def check_l2_prefetch(name: str, tiles: int) -> int:
    """``tiles`` of an ``l2_prefetch`` setting: 0 (off) or a power of two up to L2_PREFETCH_MAX. Returns the
    count a launch uses: 0 under the interpreter, which has no inline PTX."""
    if tiles < 0 or tiles > L2_PREFETCH_MAX or tiles & (tiles - 1):
        raise ValueError(f"{name}: l2_prefetch must be 0 or a power of two up to {L2_PREFETCH_MAX}, got {tiles}")
    return 0 if triton_interpret() else tiles


if HAS_TRITON:

    @triton.jit
    def prefetch_l2(ptrs):
        """Hint the 128-byte lines holding ``ptrs`` (any shape) into L2: PTX ``prefetch.global.L2``, one a
        pointer. A hint never changes a result: L2 is where every SM's loads and stores of device memory meet,
        so a line fetched early cannot be a stale copy. It may therefore be issued before a dependent launch's
        ``gdc_wait``, on addresses computed from metadata that the previous kernel may still be writing (a
        wrong address only wastes the hint); callers keep the addresses inside their tensors."""
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )


_COUNTER_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def counter_table(owner: str, device: torch.device, size: int) -> torch.Tensor:
    """A zeroed ``int32 [size]`` arrival-counter table for ``owner``'s "last program to arrive finishes the
    job" kernels (split-K sums, the draft top-k's fused merge), one per (owner, device), allocated once and never
    freed or resized: a captured graph keeps its address. Every launch leaves its counters at zero again (the
    last program resets its own), so replays need no memset. Launches of one owner on one stream run one after
    another (a dependent launch waits for the grid before it before it touches the table); the table is not
    for concurrent launches on several streams. The first allocation cannot happen under CUDA-graph capture."""
    key = (owner, device)
    table = _COUNTER_TABLES.get(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{owner}: the first launch on a device allocates its counter table, which cannot happen under "
                "CUDA-graph capture: run the op once before capturing (a warm-up pass)"
            )
        table = _COUNTER_TABLES[key] = torch.zeros(size, dtype=torch.int32, device=device)
    if table.numel() < size:
        raise ValueError(f"{owner}: a launch counts at most {table.numel()} groups, got {size}")
    return table


PDL_ENV = "TREECOMPILE_PDL"


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def tma_device_ok(t: torch.Tensor) -> bool:
    """Whether Hopper TMA descriptors can serve ``t``'s device: a CUDA device of compute capability >= 9.0
    outside the interpreter, or a CPU tensor under the interpreter (which emulates descriptors)."""
    if t.is_cuda:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return not triton_interpret() and _capability(index)[0] >= 9
    return triton_interpret()


def tma_weights_ok(*weights: torch.Tensor) -> bool:
    """Whether the weights can be TMA box sources: 2-D, last dim contiguous, 16-byte aligned base and row
    stride, on a device where :func:`tma_device_ok` holds. Host metadata only (no sync)."""
    if not tma_device_ok(weights[0]):
        return False
    return all(w.dim() == 2 and w.stride(1) == 1 and (w.stride(0) * w.element_size()) % 16 == 0
               and w.data_ptr() % 16 == 0 for w in weights)  # fmt: skip


def env_switch(name: str, default: bool) -> bool:
    """A 0 / 1 environment switch, ``default`` when unset; anything else is refused by name."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    return default if value == "" else value == "1"


def env_tiles(name: str, first: str, first_ok, first_rule: str) -> tuple[int, int, int, int] | None:
    """A sweep winner forced onto every launch of a skinny op (round A/B runs): ``name="<first>,block_k,warps,
    stages"``, or None when unset. ``first`` names the op's slice width and ``first_ok(v)`` checks it (its rule,
    ``first_rule``, goes into the error); block_k a power of two >= 16, warps a power of two <= 16, stages 1..8.
    A malformed or out-of-range value is refused by name, never clamped."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        width, block_k, warps, stages = (int(v) for v in value.split(","))
    except ValueError:
        raise ValueError(f"{name}: expected four integers '{first},block_k,warps,stages', got {value!r}") from None
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (width, block_k, warps))
    if not pow2 or not first_ok(width) or block_k < 16 or warps > 16 or not 1 <= stages <= 8:
        raise ValueError(f"{name}: {first} ({first_rule}), block_k (>= 16) and warps (<= 16) powers of two, stages "
                         f"1..8; got {value!r}")  # fmt: skip
    return width, block_k, warps, stages


def pdl_enabled(device: torch.device) -> bool:
    """Whether treecompile's Triton kernels launch as programmatic dependent launches on ``device``.

    On by default on CUDA devices of compute capability >= 9.0 (Hopper and newer), never in the interpreter;
    ``TREECOMPILE_PDL=0`` turns it off. Each such kernel waits for the previous kernel (``gdc_wait``) before it
    touches any memory, then lets the next one launch (``gdc_launch_dependents``), so its launch and its
    programs' start overlap the previous kernel's tail; the math is unchanged (a GPU test compares tokens
    with and without). :func:`inductor_pdl_patch` gives the Inductor kernels of treecompile's compiles the
    same. H200 (notes/gpu-2026-12-01-s13): SmolLM2 plain decode 993 -> 1293 tokens/s, its (8, 6, 64) tree
    1930 -> 2255; 8B verify(64) 5.40 -> 5.33 ms. Read at launch time: under CUDA graphs a kernel keeps the
    mode it was captured with.
    """
    if not env_switch(PDL_ENV, True) or device.type != "cuda" or triton_interpret():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


def inductor_pdl_patch(device: torch.device | None = None) -> dict:
    """Inductor config patches for a treecompile compile whose kernels run on ``device`` (default: the
    current CUDA device, if any): ``{"triton.enable_pdl": True}`` where :func:`pdl_enabled` holds and this
    torch's Inductor has the switch, else ``{}``. Only treecompile's own compiles get it; a user's other
    ``torch.compile`` calls keep Inductor's default."""
    if device is None:
        if not torch.cuda.is_available():
            return {}
        device = torch.device("cuda", torch.cuda.current_device())
    if not pdl_enabled(device):
        return {}
    import torch._inductor.config as inductor_config

    return {"triton.enable_pdl": True} if hasattr(inductor_config, "triton.enable_pdl") else {}


COMBO_ENV = "TREECOMPILE_COMBO_KERNELS"


def inductor_combo_patch(device: torch.device | None = None) -> dict:
    """Inductor config patches that turn on its combo kernels for a treecompile compile on ``device`` (default:
    the current CUDA device, if any): ``{"combo_kernels": True}`` on CUDA where this torch's Inductor has the
    switch, else ``{}``; ``TREECOMPILE_COMBO_KERNELS=0`` turns it off.

    Combo kernels launch independent small kernels of one graph as one (a layer's q and k rope, the draft
    round's tree bookkeeping): at batch 1 a round is a chain of launch-bound kernels, and one launch fewer is
    ~2 us. H200, SmolLM2-135M's shape, random weights, batch 1 (``tests/gpu/loop_profile.py`` with and without,
    one machine; notes/gpu-2026-12-04-s31.md): plain decode round 0.685 -> 0.647 ms, (4, 4, 16) round 1.035 ->
    0.967-0.970 ms; end to end (real weights, same machine) plain 1421 -> 1503 tokens/s, tree 2625 -> 2789. The
    8B decode read 4.562 ms with them against 4.597 without, on another machine start: within what starts vary
    by. The fused kernels compute what the separate ones did (float32 tokens equal, GPU test)."""
    if not env_switch(COMBO_ENV, True):
        return {}
    if device is None:
        if not torch.cuda.is_available():
            return {}
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda" or triton_interpret():
        return {}
    import torch._inductor.config as inductor_config

    return {"combo_kernels": True} if hasattr(inductor_config, "combo_kernels") else {}


def inductor_patches(device: torch.device | None = None) -> dict:
    """Every Inductor config patch a treecompile compile on ``device`` gets: :func:`inductor_pdl_patch` and
    :func:`inductor_combo_patch`. A user's other ``torch.compile`` calls keep Inductor's defaults."""
    return {**inductor_pdl_patch(device), **inductor_combo_patch(device)}


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op call should take the Triton path: all tensors on CUDA and Triton importable."""
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def check_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype {want}, got {t.dtype}")


def check_dim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor {layout}, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device: {listing}")


def check_num_nodes(name: str, n: int) -> None:
    if n < 1 or n > MAX_NODES:
        raise ValueError(f"{name}: the tree must have 1..{MAX_NODES} nodes, got {n}")


def values_checkable(*tensors: torch.Tensor) -> bool:
    """Whether an op may read tensor values to validate them (e.g. that ``parents`` is a tree).

    Always for CPU tensors: reading them costs no device sync. On CUDA a value check is a device-to-host
    copy, i.e. a sync on every call, so it runs only when ``TREECOMPILE_CHECK_VALUES=1`` asks for it and
    never while a CUDA graph is being captured. Callers on CUDA run the ``validate_*`` helpers once,
    outside capture, instead.
    """
    if all(t.device.type == "cpu" for t in tensors):
        return True
    if not env_switch("TREECOMPILE_CHECK_VALUES", False):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
