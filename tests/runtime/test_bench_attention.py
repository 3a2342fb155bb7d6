"""The attention benchmark's streaming-read reference (``read_kv``, the "read us" column): it reads exactly
the first ``n`` elements of K and V (its partial sums match torch's, the tail block masked, nothing past ``n``
seen), writes every partial sum, and refuses bad arguments. Runs the Triton kernel in the CPU interpreter
without a GPU."""

import pytest
import torch

from treecompile.bench import attention
from treecompile.bench.attention import READ_BLOCK, read_kv

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("n", [1, READ_BLOCK - 3, READ_BLOCK, 2 * READ_BLOCK + 5])
def test_read_kv_sums_exactly_the_first_n(kernel_device, n):
    gen = torch.Generator().manual_seed(n)
    size = n + 100
    k = torch.randn(size, generator=gen).to(kernel_device)
    v = torch.randn(size, generator=gen).to(kernel_device)
    k[n:] = float("nan")  # past n: a read of it would poison the last sum
    v[n:] = float("inf")
    grid = -(-n // READ_BLOCK)
    out = torch.full((grid + 1,), float("nan"), device=kernel_device)  # one spare slot: must stay unwritten
    read_kv(k, v, n, out)
    ref = (k[:n].double() + v[:n].double())
    ref = torch.nn.functional.pad(ref, (0, grid * READ_BLOCK - n)).view(grid, READ_BLOCK).sum(dim=1)
    torch.testing.assert_close(out[:grid].double().cpu(), ref.cpu(), rtol=1e-5, atol=1e-3)
    assert torch.isnan(out[grid]), "read_kv wrote past its grid"


def test_read_kv_matches_the_bench_layout(kernel_device):
    """A bench-shaped paged cache ([slots, Hkv, D], bf16 on GPU / fp32 here): n = (P + N) * Hkv * D elements."""
    dtype = torch.bfloat16 if kernel_device == "cuda" else torch.float32
    P, N = 70, 5
    k = torch.randn(2 * attention.PAGE, attention.HKV, attention.D, dtype=dtype, device=kernel_device)
    v = torch.randn_like(k)
    n = (P + N) * attention.HKV * attention.D
    out = read_kv(k, v, n)
    assert out.shape == (-(-n // READ_BLOCK),)
    total = k.flatten()[:n].double().sum() + v.flatten()[:n].double().sum()
    torch.testing.assert_close(out.double().sum().cpu(), total.cpu(), rtol=1e-4, atol=1e-2)


def test_read_kv_refuses_bad_arguments():
    k = torch.zeros(64)
    with pytest.raises(ValueError, match="n must be in 1..64"):
        read_kv(k, k, 65)
    with pytest.raises(ValueError, match="n must be in 1..64"):
        read_kv(k, k, 0)
    with pytest.raises(ValueError, match="one dtype"):
        read_kv(k, k.double(), 8)
    with pytest.raises(ValueError, match="contiguous"):
        read_kv(torch.zeros(8, 16).t(), k, 8)
    with pytest.raises(ValueError, match="out must be float32"):
        read_kv(k, k, 8, out=torch.zeros(1, dtype=torch.float64))
