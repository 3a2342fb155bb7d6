"""Test setup shared by the whole suite.

Without a GPU the Triton kernels run in the CPU interpreter: ``TRITON_INTERPRET`` must be set before
Triton decorates any kernel, so it is set here, before treecompile is imported. Tests marked ``gpu``
skip where no CUDA device exists (and only there).
"""

import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_index_squeezes() -> None:
    """Triton <= 3.6's interpreter turns a one-element block (a loaded scalar used as a ``range`` bound, say) into
    a Python int with ``int(ndarray)``, which numpy >= 2.4 refuses for ndim > 0: every kernel with such a loop
    fails there (the GPU machine's triton 3.6 + numpy 2.5, in the ``interpreter`` tests' child). Upstream fixed it
    by squeezing first (triton-lang/triton#9171); where the installed interpreter lacks that fix, do the same."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        unfixed = original is not None and "int(self.handle.data))" in inspect.getsource(original)
    except (OSError, TypeError):
        unfixed = False
    if not unfixed:
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _interpreter_index_squeezes()

import pytest  # noqa: E402

import treecompile  # noqa: E402,F401  registers torch.ops.treespec.*

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``interpreter`` launches Triton kernels on CPU tensors, so it needs the interpreter, which
    Triton chooses once per process: where CUDA is present (this process compiles for the device) the test runs
    in a child pytest with no GPU visible instead, and fails with the child's output if the child fails.
    Without CUDA it runs here as any other test. Its fixtures are still set up here (cheap ones only)."""
    if "interpreter" not in pyfuncitem.keywords:
        return None
    import subprocess
    import sys

    from treecompile.ops._common import triton_interpret

    if triton_interpret():
        return None

    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", pyfuncitem.nodeid],
        cwd=pyfuncitem.config.rootpath, capture_output=True, text=True,
        env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    if child.returncode != 0 or " passed" not in child.stdout:
        pytest.fail(f"under the interpreter (child pytest, rc {child.returncode}):\n{child.stdout[-6000:]}\n"
                    f"{child.stderr[-2000:]}", pytrace=False)  # fmt: skip
    return True


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


def assert_partings_are_near_ties(model16, ids, mask, a, b, slack=3.0):
    """Two bf16 greedy decodes whose kernels round differently may part only at a near-tie: at each row's first
    differing new token j, over the prefix the rows share, the float32 model's logits of the two tokens differ by
    at most ``slack`` times the bf16 forward's own logit error there (max over the vocabulary of |bf16 - float32|;
    each run's error is about that, so two runs can swap tokens whose float32 gap is up to about twice it). A
    kernel fault parts rows at clear margins. An agreement threshold cannot tell the two apart: this tiny random
    model's top-2 gaps fall to 1e-5 in places, under its bf16 error of ~0.007, so one early near-tie flip costs
    a row's every later token (on a fifty-eighth-session H100, the fused MLP's test parted row 0 at its 19th new
    token, next to gaps of 0.002-0.004, and agreed on 58% of new tokens).

    ``model16``: a copy of the bf16 model taken before any speculator was built; ``ids`` / ``mask``: the left-
    padded prompts; ``a``, ``b``: ``[B, prompt + new]`` sequences. Returns each row's first parting (None: the
    row agrees to the end)."""
    model32 = copy.deepcopy(model16).float()
    L = ids.shape[1]
    firsts = []
    for r in range(ids.shape[0]):
        parted = (a[r, L:] != b[r, L:]).nonzero()
        if parted.numel() == 0:
            firsts.append(None)
            continue
        j = parted[0].item()
        am = torch.cat([mask[r : r + 1], mask.new_ones(1, j)], dim=1)
        pos = (am.cumsum(-1) - 1).clamp(min=0)  # HF generate's positions for a left-padded row
        with torch.no_grad():
            l32 = model32(a[r : r + 1, : L + j], attention_mask=am, position_ids=pos).logits[0, -1].double()
            l16 = model16(a[r : r + 1, : L + j], attention_mask=am, position_ids=pos).logits[0, -1].double()
        gap = (l32[a[r, L + j]] - l32[b[r, L + j]]).abs().item()
        err = (l16 - l32).abs().max().item()
        assert gap <= slack * err, f"row {r} parts at new token {j}: float32 gap {gap:.3g} > {slack} x {err:.3g}"
        firsts.append(j)
    return firsts


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
