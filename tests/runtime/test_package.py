"""Packaging: the namespace layout, the backend entry point, the CLI."""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

import treecompile
from treecompile.backend import TreespecOptions


def test_ops_and_passes_install_inside_the_namespace():
    import treecompile.ops
    import treecompile.passes

    assert treecompile.ops.__name__ == "treecompile.ops"
    assert treecompile.passes.__name__ == "treecompile.passes"
    # Nothing named bare `ops` or `passes` may be importable from site-packages.
    for bare in ("ops", "passes"):
        code = f"import importlib.util, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; print(importlib.util.find_spec({bare!r}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
        assert out.stdout.strip() == "None", out.stdout + out.stderr


def test_backend_is_an_entry_point():
    names = [ep.name for ep in entry_points(group="torch_dynamo_backends")]
    assert "treespec" in names


def test_backend_works_without_importing_treecompile():
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='treespec', options={'inductor': False})\n"
        "y = f(torch.arange(4.0))\n"
        "assert torch.equal(y, torch.arange(4.0) * 2 + 1), y\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_backend_hands_the_graph_to_inductor():
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.sin(x) * 3, backend="treespec")
    x = torch.randn(5)
    torch.testing.assert_close(f(x), torch.sin(x) * 3)


def test_unknown_backend_option_is_refused():
    with pytest.raises(ValueError, match="unknown option.*bogus"):
        TreespecOptions.parse({"bogus": 1})
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="treespec", options={"bogus": 1})
    with pytest.raises(Exception, match="bogus"):
        f(torch.ones(2))


def test_cli_help_and_version():
    out = subprocess.run(["treecompile", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "treespec" in out.stdout
    out = subprocess.run(["treecompile", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and treecompile.__version__ in out.stdout
