"""A loaded scalar bounds a ``range`` loop in the interpreter (the tree-attention prefix splits, the sweeps' K
loops do this). Triton <= 3.6's interpreter failed that under numpy >= 2.4 (``int`` of a one-element array);
``tests/conftest.py`` squeezes first where the installed Triton lacks upstream's fix. Without it this test fails
with ``TypeError: only 0-dimensional arrays can be converted to Python scalars`` (checked on triton 3.6.0 with
numpy 2.4.6 and 2.5.2). ``interpreter``: where CUDA is present it runs in a child pytest under the interpreter.
"""

import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _sum_below_kernel(n_ptr, out_ptr):
    n = tl.load(n_ptr)
    acc = tl.zeros((), tl.int32)
    for i in range(0, n):
        acc += i
    tl.store(out_ptr, acc)


@pytest.mark.interpreter
@pytest.mark.parametrize("n", [0, 1, 5])
def test_loaded_scalar_bounds_a_loop(n):
    out = torch.full((1,), -1, dtype=torch.int32)
    _sum_below_kernel[(1,)](torch.tensor([n], dtype=torch.int32), out)
    assert out.item() == n * (n - 1) // 2
