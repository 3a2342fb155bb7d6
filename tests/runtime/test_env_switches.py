"""The 0 / 1 environment switches (README, "Environment switches") refuse any other value by name where they
are read. Before, several only looked for their non-default value, so ``TREECOMPILE_PDL=off`` quietly left
dependent launches on."""

import os
import subprocess
import sys

import pytest
import torch

from test_speculator import hf_greedy, tiny_llama  # the runtime tests' tiny float64 Llama
from treecompile.ops._common import env_switch, inductor_combo_patch, pdl_enabled, values_checkable


@pytest.mark.parametrize("raw,default,want", [("", True, True), ("", False, False), ("0", True, False),
                                              ("1", False, True), (" 1 ", False, True)])  # fmt: skip
def test_env_switch_reads_0_1_and_unset(monkeypatch, raw, default, want):
    monkeypatch.setenv("TREECOMPILE_TEST_SWITCH", raw)
    assert env_switch("TREECOMPILE_TEST_SWITCH", default) is want


@pytest.mark.parametrize("raw", ["yes", "2", "off", "true"])
def test_env_switch_refuses_anything_else_by_name(monkeypatch, raw):
    monkeypatch.setenv("TREECOMPILE_TEST_SWITCH", raw)
    with pytest.raises(ValueError, match=f"TREECOMPILE_TEST_SWITCH: expected 0 or 1, got '{raw}'"):
        env_switch("TREECOMPILE_TEST_SWITCH", True)


def test_pdl_switch_is_checked_on_every_device(monkeypatch):
    monkeypatch.setenv("TREECOMPILE_PDL", "off")
    with pytest.raises(ValueError, match="TREECOMPILE_PDL: expected 0 or 1, got 'off'"):
        pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TREECOMPILE_PDL", "1")
    assert pdl_enabled(torch.device("cpu")) is False  # on, but never off CUDA


def test_combo_kernels_switch(monkeypatch):
    monkeypatch.setenv("TREECOMPILE_COMBO_KERNELS", "no")
    with pytest.raises(ValueError, match="TREECOMPILE_COMBO_KERNELS: expected 0 or 1, got 'no'"):
        inductor_combo_patch(torch.device("cpu"))
    monkeypatch.setenv("TREECOMPILE_COMBO_KERNELS", "0")
    assert inductor_combo_patch(torch.device("cpu")) == {}


def test_check_values_switch(monkeypatch):
    off_cpu = torch.empty(1, device="meta")  # not a CPU tensor: the switch decides
    monkeypatch.setenv("TREECOMPILE_CHECK_VALUES", "yes")
    with pytest.raises(ValueError, match="TREECOMPILE_CHECK_VALUES: expected 0 or 1, got 'yes'"):
        values_checkable(off_cpu)
    monkeypatch.setenv("TREECOMPILE_CHECK_VALUES", "0")
    assert values_checkable(off_cpu) is False
    assert values_checkable(torch.empty(1)) is True  # CPU values are read without a sync, whatever the switch


def test_draft_fold_switch(monkeypatch):
    from treecompile.drafter import EagleDrafter

    model = tiny_llama()
    monkeypatch.setenv("TREECOMPILE_DRAFT_FOLD", "on")
    with pytest.raises(ValueError, match="TREECOMPILE_DRAFT_FOLD: expected 0 or 1, got 'on'"):
        EagleDrafter.for_target(model, seed=0)
    monkeypatch.setenv("TREECOMPILE_DRAFT_FOLD", "1")
    assert EagleDrafter.for_target(model, seed=0).fold_cache_write is True


def test_compiled_commit_switch_is_read_without_inductor_too(monkeypatch):
    from treecompile.drafter import EagleDrafter
    from treecompile.speculator import TreeSpeculator

    model = tiny_llama()
    drafter = EagleDrafter.for_target(model, seed=0)
    monkeypatch.setenv("TREECOMPILE_COMPILED_COMMIT", "2")
    with pytest.raises(ValueError, match="TREECOMPILE_COMPILED_COMMIT: expected 0 or 1, got '2'"):
        TreeSpeculator(model, drafter, topk=2, steps=2, num_nodes=4, max_batch_size=1, max_seq_len=32)
    monkeypatch.setenv("TREECOMPILE_COMPILED_COMMIT", "0")
    spec = TreeSpeculator(model, drafter, topk=2, steps=2, num_nodes=4, max_batch_size=1, max_seq_len=32)
    ids = torch.tensor([[3, 5, 7, 9]])
    out = spec.generate(ids, max_new_tokens=3, eos_token_id=None)
    assert torch.equal(out.sequences, hf_greedy(model, ids, max_new_tokens=3))


def test_topk_fused_merge_switch(monkeypatch):
    pytest.importorskip("triton")
    from treecompile.ops.draft_topk import _launch_draft_topk

    monkeypatch.setenv("TREECOMPILE_TOPK_FUSED_MERGE", "yes")
    logits = torch.zeros(2, 40)
    with pytest.raises(ValueError, match="TREECOMPILE_TOPK_FUSED_MERGE: expected 0 or 1, got 'yes'"):
        _launch_draft_topk(logits, 4, torch.empty(2, 4), torch.empty(2, 4, dtype=torch.int64), block=64)


def test_gemv_footprint_switch_fails_the_import_by_name():
    env = dict(os.environ, TREECOMPILE_GEMV_KEEP_FOOTPRINT="off", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", "import treecompile.ops.skinny_linear"], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode != 0
    assert "TREECOMPILE_GEMV_KEEP_FOOTPRINT: expected 0 or 1, got 'off'" in proc.stderr
