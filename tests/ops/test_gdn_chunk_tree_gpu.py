"""The chunked GDN tree verify on CUDA (compiled Triton) at Qwen3-Next shapes, against float64 on CPU.

The interpreter accepts code compiled Triton rejects (tl.dot shapes, precision), so the CPU tests in
test_gdn_chunk_tree.py are not enough. fp32 inputs also guard against TF32 products: they would miss the
fp32 tolerance below by an order of magnitude.
"""

import pytest
import torch

import treecompile.ops.gdn_chunk_tree  # noqa: F401  registers treespec::gdn_tree_verify_chunked
import treecompile.ops.gdn_tree as gdn
from conftest import poisoned

pytestmark = pytest.mark.gpu


def random_parents(batch, n, seed):
    """Request b: a chain, a star, then random trees."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        if b % 3 == 0:
            rows.append([i - 1 for i in range(n)])
        elif b % 3 == 1:
            rows.append([-1] + [0] * (n - 1))
        else:
            rows.append([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [8, 16], ids=lambda n: f"N{n}")
def test_gdn_tree_verify_chunked_on_cuda_qwen3_next_shapes(n, dtype):
    batch, hk, hv, dk, dv = 4, 16, 32, 128, 128
    gen = torch.Generator().manual_seed(n)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v = rnd(batch, n, hk, dk), rnd(batch, n, hk, dk), rnd(batch, n, hv, dv)
    g = (-5 * torch.rand(batch, n, hv, generator=gen, dtype=torch.float64)).to(dtype)
    beta = torch.rand(batch, n, hv, generator=gen, dtype=torch.float64).to(dtype)
    state = torch.randn(batch, hv, dk, dv, generator=gen, dtype=torch.float64).float() * 0.5
    parents = random_parents(batch, n, n + 1)
    width = gdn.gdn_payload_width(hk, dk, hv, dv)

    # float64 oracle from the very same (rounded) inputs: the sequential reference.
    inputs64 = [t.double() for t in (q, k, v, g, beta, state)]
    want_payload = poisoned((batch, n, width), torch.float64)
    workspace = torch.zeros(batch, n, hv, dk, dv, dtype=torch.float64)
    want = gdn.gdn_tree_verify_reference(*inputs64, parents, workspace, want_payload, None, True)

    cu = [t.cuda() for t in (q, k, v, g, beta)]
    state_cu = state.cuda()
    payload = poisoned((batch, n + 3, width), torch.float32, "cuda")
    got = torch.ops.treespec.gdn_tree_verify_chunked(*cu, state_cu, parents.cuda(), payload, None, True)
    torch.cuda.synchronize()
    assert got.dtype == dtype and got.shape == (batch, n, hv, dv)
    tol = 1.6e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(payload[:, :n].cpu().double(), want_payload, atol=1e-6, rtol=1e-6)
    assert payload[:, n:].isnan().all(), "payload rows >= N were written"
    assert torch.equal(state_cu.cpu(), state), "verify wrote the committed state"

    # The sequential CUDA op on the same inputs: same payload, outputs within fp32 accumulation order.
    seq_payload = poisoned((batch, n, width), torch.float32, "cuda")
    seq_ws = torch.empty(batch, n, hv, dk, dv, dtype=torch.float32, device="cuda")
    seq = torch.ops.treespec.gdn_tree_verify(*cu, state_cu, parents.cuda(), seq_ws, seq_payload, None, True)
    torch.testing.assert_close(payload[:, :n], seq_payload, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.float(), seq.float(), atol=tol, rtol=tol)
