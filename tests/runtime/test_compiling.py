"""compile_inference's keyed private copies: many batch sizes never meet Dynamo's recompile limit."""

import pytest
import torch

from treecompile.compiling import batch_key, compile_inference
from treecompile.drafter import DraftContext


def _double(x):
    return x * 2


def test_a_keyed_compile_gives_each_batch_size_its_own_code_object():
    """With the recompile limit at 1, an unkeyed fullgraph compile fails at its second batch size (what a
    speculator's compiled commit did at its ninth); keyed by batch size, ten sizes compile without one
    recompile, each returning its own size's result."""
    keyed = compile_inference(_double, "_double_keyed", key=batch_key, backend="eager", fullgraph=True)
    unkeyed = compile_inference(_double, "_double_unkeyed", backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=1, error_on_recompile=True):
        for b in range(1, 11):
            x = torch.arange(b * 3, dtype=torch.float32).view(b, 3)
            assert torch.equal(keyed(x), x * 2)
        unkeyed(torch.ones(1, 3))
        with pytest.raises(Exception, match="[Rr]ecompil"):
            unkeyed(torch.ones(2, 3))


def test_a_keyed_function_inside_a_compiled_region_is_traced_inline():
    """Called while Dynamo traces a larger function (the whole draft round), the keyed wrapper runs the
    function itself: no compile inside a trace and no graph break."""
    inner = compile_inference(_double, "_double_inner", key=batch_key, backend="eager", fullgraph=True)

    def outer(x):
        return inner(x) + 1

    compiled = torch.compile(outer, backend="eager", fullgraph=True)
    x = torch.randn(4, 3)
    assert torch.equal(compiled(x), x * 2 + 1)


def test_batch_key_reads_the_leading_size_rank_and_draft_step():
    ctx = DraftContext(history=torch.zeros(2, 8, dtype=torch.int64), vc=torch.zeros(2, dtype=torch.int64),
                       lane_tokens=torch.zeros(2, 4, dtype=torch.int64), step=3)  # fmt: skip
    assert batch_key("drafter", "draft_lanes", None, torch.zeros(2, 4, 8), 7, ctx) == ((2, 3), (3,))
    assert batch_key(torch.zeros(5, 2)) == ((5, 2), ())
    assert batch_key(torch.zeros(5, 2)) != batch_key(torch.zeros(5, 2, 1))
    assert batch_key(4, "x") == (None, ())
