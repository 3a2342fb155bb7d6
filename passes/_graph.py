"""Small helpers the passes share: reading Dynamo node metadata and telling attention apart."""

from __future__ import annotations

import operator

import torch
import torch.fx

# Attention calls a Dynamo graph of an HF model can hold. SDPA is what the pass rewrites; the others are
# named so that a model running them is refused instead of passed through.
SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_OTHER_ATTENTION_NAMES = ("flex_attention", "flash_attn", "_scaled_dot_product", "paged_attention")


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def is_other_attention(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or is_sdpa(node):
        return False
    name = getattr(node.target, "__name__", None) or str(node.target)
    return any(key in name for key in _OTHER_ATTENTION_NAMES)


def module_stack(node: torch.fx.Node) -> list[tuple[str, type]]:
    """``nn_module_stack`` of a node, outermost first, as (path, class) pairs."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value[0], value[1]
        out.append((path, cls if isinstance(cls, type) else type(cls)))
    return out


def example_shape(node) -> tuple | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def node_value(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    """The tensor a node stands for: a ``get_attr`` constant's own tensor, else its Dynamo example value."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = getattr(gm, node.target, None) if node.op == "get_attr" else node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None


def is_constant(node) -> bool:
    """A graph input or constant (a parameter or buffer): never written by the kernel just before a use, so a
    dependent launch may read it ahead of its dependency wait."""
    return isinstance(node, torch.fx.Node) and node.op in ("get_attr", "placeholder")


def example_dtype(node) -> torch.dtype | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


# Shape-only steps of HF's `repeat_kv` (x[:, :, None].expand(...).reshape(...)) and friends.
_REPEAT_METHODS = {"expand", "reshape", "view", "contiguous", "repeat_interleave", "unsqueeze"}


def is_repeat_step(node: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target in _REPEAT_METHODS:
        return True
    if node.op == "call_function" and node.target in (operator.getitem, torch.repeat_interleave, torch.unsqueeze):
        return True
    return False


def is_pure(node: torch.fx.Node) -> bool:
    """Conservative purity for dead-code elimination: FX treats every call_method as pure, but an
    in-place method (``x.masked_fill_(...)``) with no users still changes x."""
    if node.is_impure():
        return False
    target = node.target
    if node.op == "call_method":
        return not (target.endswith("_") and not target.startswith("_"))
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            return False
        module = getattr(target, "__module__", None)
        name = getattr(target, "__name__", "")
        if module in ("operator", "_operator"):  # and_, or_ are pure; iadd, setitem are not
            return not (name.startswith("i") and name[1:] in _OPERATOR_BINARY) and name != "setitem"
        return not (name.endswith("_") and not name.startswith("_"))
    return True


_OPERATOR_BINARY = {
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul",
}


def static_size(name: str, value) -> int:
    """A graph size the tree metadata is sliced to: it must be a plain int (``dynamic=False``)."""
    if not isinstance(value, int):
        raise ValueError(
            f"treespec pass: {name} is dynamic ({value}); compile with dynamic=False (the tree metadata "
            "is sliced to static B and T)"
        )
    return value


def check_each_layer_once(kind: str, done: list[str], bound: list[str]) -> None:
    """Every bound layer of ``kind`` rewritten exactly once (``done``: names in rewrite order)."""
    duplicated = sorted({name for name in done if done.count(name) > 1})
    missing = [name for name in bound if name not in done]
    if duplicated or missing:
        raise ValueError(
            f"treespec pass: the graph must rewrite each bound {kind} layer once; missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, duplicated {duplicated[:4]} (compile with fullgraph=True "
            "and a binding made for this model)"
        )


def register_constant(gm: torch.fx.GraphModule, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` (no copy) as a buffer ``name`` of ``gm`` that ``get_attr`` nodes can read."""
    if hasattr(gm, name):
        delattr(gm, name)
    gm.register_buffer(name, tensor, persistent=False)
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        # AOT autograd lifts a Dynamo graph's buffers as static inputs and wants a source for each (guard
        # dedup); these are treecompile's, reached by no user-code path: a named constant source.
        from torch._dynamo.source import ConstantSource

        sources[name] = ConstantSource(name)
