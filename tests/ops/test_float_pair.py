"""Float scalars of float64 kernels: a compiled Triton launch takes a Python float as float32, the interpreter keeps
float64. On an H100 the float64 GDN kernel test with Dk = 8 (scale 8 ** -0.5, not a float32) failed where the
interpreter passes (no traceback was kept; this is the cause found since). The ops take float32 states only on
CUDA, so this reaches the launchers, which the tests and benchmarks call in float64 against float64 oracles. The
GDN and Mamba2 verify kernels now take ``_common.float_pair(x)``, two float32 values they add in their accumulator
type. Here the interpreter is made to round every float argument to float32 first, as a compiled launch does, so
the CPU suite sees what the GPU would: the float64 kernels meet their float64 oracles, and without the pair they
would not (the controls). The launches are on ``kernel_device``: on a GPU the rounding is what the compiled launch
does anyway, so the same checks hold there."""

from __future__ import annotations

import math
import struct

import pytest
import torch
import treecompile.ops.gdn_chunk_tree as chunked
import treecompile.ops.gdn_tree as gdn
import treecompile.ops.mamba2_chunk_tree as m2c
import treecompile.ops.mamba2_tree as m2
from test_gdn_chunk_tree import run_chunked, sequential
from test_gdn_tree import check_against_oracle as gdn_check
from test_gdn_tree import make_inputs as gdn_inputs
from test_gdn_tree import parents_tensor
from test_gdn_tree import run_verify as gdn_run
from test_mamba2_tree import check_against_oracle as m2_check
from test_mamba2_tree import make_inputs as m2_inputs
from test_mamba2_tree import run_verify as m2_run
from test_mamba2_tree import to_device
from treecompile.ops._common import float_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def as_float32(x: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


@pytest.mark.parametrize("x", [8**-0.5, 12**-0.5, 0.3, -1.1, 1e-30, 3.0e38, 0.25, 0.0, -0.0, 1 / 3])
def test_the_pair_is_two_float32_values_that_add_up_to_x(x):
    head, tail = float_pair(x)
    assert as_float32(head) == head and as_float32(tail) == tail  # a float32 argument carries each unchanged
    assert head == as_float32(x)  # in float32 the pair is float32(x) ...
    in_f32 = torch.tensor(head, dtype=torch.float32) + torch.tensor(tail, dtype=torch.float32)
    assert in_f32.item() == head  # ... bit for bit, so float32 kernels round as before
    in_f64 = torch.tensor(head, dtype=torch.float64) + torch.tensor(tail, dtype=torch.float64)
    assert abs(in_f64.item() - x) <= abs(x) * 2.0**-47  # and x to float64 precision (1e-30: tail subnormal-free)


def test_limits_and_values_past_float32():
    assert float_pair(math.inf) == (math.inf, 0.0) and float_pair(-math.inf) == (-math.inf, 0.0)
    head, tail = float_pair(math.nan)
    assert math.isnan(head) and tail == 0.0
    assert float_pair(1e300) == (1e300, 0.0)  # past float32: a launch makes it inf, as with x alone


class Float32Scalars:
    """A Triton kernel whose launches round every Python float argument to float32 first, as a compiled launch
    does (``triton.runtime.jit.mangle_type(0.3) == "fp32"``); the interpreter alone keeps float64."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.floats = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            self.floats += [a for a in args if isinstance(a, float)]
            return launch(*(as_float32(a) if isinstance(a, float) else a for a in args), **kwargs)

        return call


def _gdn_verify_misses(monkeypatch, pair, d) -> float:
    monkeypatch.setattr(gdn, "float_pair", pair)
    kernel = Float32Scalars(gdn._gdn_tree_verify_kernel)
    monkeypatch.setattr(gdn, "_gdn_tree_verify_kernel", kernel)
    parents = parents_tensor([("two_branches", 7), ("random", 7)], seed=6)
    q, k, v, g, beta, state = gdn_inputs(2, 7, hk=1, hv=2, dk=8, dv=16, seed=6)  # scale 8 ** -0.5
    on_d = (t.to(d) for t in (q, k, v, g, beta, state, parents))
    o, ws, payload = (t.cpu() for t in gdn_run(gdn._launch_gdn_tree_verify, *on_d))
    assert kernel.floats  # the launch went through the float32 rounding
    try:
        gdn_check(q, k, v, g, beta, state, parents, o, ws, payload, 1e-12)
        return 0.0
    except AssertionError:
        want = gdn.gdn_tree_verify_reference(q, k, v, g, beta, state, parents, ws.clone(), payload.clone(), None, True)
        return (o - want).abs().max().item()


def test_gdn_verify_float64_meets_its_oracle_with_float32_scalars(monkeypatch, kernel_device):
    assert _gdn_verify_misses(monkeypatch, float_pair, kernel_device) == 0.0


def test_gdn_verify_float64_would_miss_its_oracle_without_the_pair(monkeypatch, kernel_device):
    """The control: a scale passed alone is float32(8 ** -0.5), 2e-8 relative off, far past 1e-12."""
    assert _gdn_verify_misses(monkeypatch, lambda x: (x, 0.0), kernel_device) > 1e-10


@pytest.mark.parametrize("pair", ["float_pair", "alone"])
def test_gdn_chunked_float64_with_float32_scalars(monkeypatch, pair, kernel_device):
    if pair == "alone":
        monkeypatch.setattr(chunked, "float_pair", lambda x: (x, 0.0))
    kernel = Float32Scalars(chunked._gdn_tree_verify_chunked_kernel)
    monkeypatch.setattr(chunked, "_gdn_tree_verify_chunked_kernel", kernel)
    parents = parents_tensor([("random", 9), ("chain", 9)], seed=8)
    inputs = gdn_inputs(2, 9, hk=1, hv=2, dk=8, dv=16, seed=8)
    o, payload = run_chunked("kernel", *(t.to(kernel_device) for t in (*inputs, parents)))  # CPU copies back
    want_o, want_payload = sequential(*inputs, parents)
    torch.testing.assert_close(payload[:, :9], want_payload, atol=1e-11, rtol=1e-11)
    err = (o - want_o).abs().max().item()
    assert err < 1e-11 if pair == "float_pair" else err > 1e-10, err


@pytest.mark.parametrize("chunk", [False, True], ids=["sequential", "chunked"])
@pytest.mark.parametrize("pair", ["float_pair", "alone"])
def test_mamba2_dt_limits_float64_with_float32_scalars(monkeypatch, chunk, pair, kernel_device):
    """dt limits 0.6 and 1.3 (not float32 values) that bind: the clamped dt is the float64 limit."""
    module, name = (m2c, "_mamba2_tree_verify_chunked_kernel") if chunk else (m2, "_mamba2_tree_verify_kernel")
    if pair == "alone":
        monkeypatch.setattr(m2, "float_pair", lambda x: (x, 0.0))
    monkeypatch.setattr(module, name, Float32Scalars(getattr(module, name)))
    parents = parents_tensor([("random", 9)], seed=3)
    inputs = m2_inputs(1, 9, h=2, g=1, p=8, s=16, seed=4)
    kw = dict(dt_min=0.6, dt_max=1.3)
    d = kernel_device
    if chunk:
        y = torch.full(tuple(inputs[0].shape), float("nan"), dtype=torch.float64, device=d)
        buf = torch.full((1, 9, m2.mamba2_payload_width(2, 8, 1, 16)), float("nan"), dtype=torch.float64, device=d)
        m2c._launch_mamba2_tree_verify_chunked(*to_device(d, *inputs, parents), buf, y, True, 0.6, 1.3)
    else:
        y, buf = m2_run("kernel", *to_device(d, *inputs, parents), **kw)
    y, buf = y.cpu(), buf.cpu()
    dt = inputs[1] + inputs[6]
    dtp = torch.nn.functional.softplus(dt)
    assert (dtp < 0.6).any() and (dtp > 1.3).any()  # both limits bind
    if pair == "float_pair":
        m2_check("kernel", inputs, parents, y, buf, 1e-10, **kw)
    else:
        with pytest.raises(AssertionError):
            m2_check("kernel", inputs, parents, y, buf, 1e-10, **kw)
