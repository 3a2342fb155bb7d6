"""Test setup shared by the whole suite.

Without a GPU the Triton kernels run in the CPU interpreter: ``TRITON_INTERPRET`` must be set before
Triton decorates any kernel, so it is set here, before treecompile is imported. Tests marked ``gpu``
skip where no CUDA device exists (and only there).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import treecompile  # noqa: E402,F401  registers torch.ops.treespec.*

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _registered_tiles_stay_in_their_test(monkeypatch):
    """``register_tiles`` adds to a module-level table for the whole process: each test starts from none."""
    from treecompile.ops import skinny_linear

    monkeypatch.setattr(skinny_linear, "_REGISTERED", {})


def poisoned(shape, dtype, device="cpu"):
    """A fresh tensor whose every element fails a comparison if a kernel forgets to write it."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -(2**31) + 7, dtype=dtype, device=device)


def gpu_script(name: str):
    """A ``tests/gpu/NAME.py`` device script loaded as a module (its smoke modes run on the CPU), with
    ``tests/gpu`` importable for the scripts' own imports of each other."""
    import importlib.util
    import pathlib
    import sys

    folder = pathlib.Path(__file__).resolve().parent / "gpu"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def kernel_device():
    """Where Triton launchers run in this session: CUDA when present, else CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-tensor tests: on a busy 2-core machine more threads only
    add spin-wait contention. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
