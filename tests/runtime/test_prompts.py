"""The project's prompt sets (treecompile.prompts): sizes, variety, disjointness, determinism."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import pytest

import treecompile
from treecompile import prompts

BUILD_SCRIPT = Path(treecompile.__file__).parent / "data" / "build_prompts.py"


def _normalized(text: str) -> str:
    """Case, whitespace and punctuation folded: near-identical prompts compare equal."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def _build_module():
    if not BUILD_SCRIPT.is_file():
        pytest.skip("build_prompts.py is not shipped in installed wheels; runs from a source checkout")
    spec = importlib.util.spec_from_file_location("treecompile_build_prompts", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,minimum", [("train", 500), ("heldout", 40)])
def test_sizes_and_well_formed(name, minimum):
    get = {"train": prompts.training_prompts, "heldout": prompts.heldout_prompts}[name]
    items = get()
    assert len(items) >= minimum
    assert all(isinstance(p, str) and p.strip() == p and len(p) >= 10 for p in items)
    assert len(set(items)) == len(items), "duplicate prompts"
    assert len({_normalized(p) for p in items}) == len(items), "prompts that differ only in case/punctuation"


def test_demo_prompts_are_short_chat_prompts():
    demo = prompts.demo_prompts()
    assert 3 <= len(demo) <= 5
    assert all(isinstance(p, str) and 0 < len(p) <= 100 for p in demo)


@pytest.mark.parametrize("normalize", [False, True], ids=["exact", "normalized"])
def test_heldout_and_demo_are_disjoint_from_training(normalize):
    f = _normalized if normalize else (lambda s: s)
    train = {f(p) for p in prompts.training_prompts()}
    assert not train & {f(p) for p in prompts.heldout_prompts()}
    assert not train & {f(p) for p in prompts.demo_prompts()}


def test_reserved_heldout_topics_never_reach_training():
    module = _build_module()
    train_text = _normalized("\n".join(prompts.training_prompts()))
    reserved = module.HELDOUT_CHAT_TOPICS + module.HELDOUT_CODE_TASKS + module.HELDOUT_WRITING_SUBJECTS
    leaked = [t for t in reserved if _normalized(t) in train_text]
    assert leaked == []


def test_training_covers_every_category_and_varies():
    per_category = Counter(r["category"] for r in prompts.prompt_records("train"))
    assert set(per_category) == set(prompts.CATEGORIES)
    assert min(per_category.values()) >= 50, per_category
    assert set(r["category"] for r in prompts.prompt_records("heldout")) == set(prompts.CATEGORIES)
    # Variety beyond one template: many distinct openings and a broad vocabulary.
    train = prompts.training_prompts()
    openings = {" ".join(p.split()[:3]) for p in train}
    vocabulary = {w for p in train for w in _normalized(p).split()}
    assert len(openings) >= 60 and len(vocabulary) >= 800, (len(openings), len(vocabulary))


def test_category_filter_matches_records():
    code = prompts.training_prompts("code")
    assert code and all(r["category"] == "code" for r in prompts.prompt_records("train") if r["prompt"] in code)
    assert sum(len(prompts.training_prompts(c)) for c in prompts.CATEGORIES) == len(prompts.training_prompts())


def test_results_are_fresh_lists():
    first = prompts.training_prompts()
    first.clear()
    assert len(prompts.training_prompts()) >= 500
    demo = prompts.demo_prompts()
    demo.append("x")
    assert "x" not in prompts.demo_prompts()


@pytest.mark.parametrize("name", ["train", "heldout"])
def test_data_files_match_the_generator(name):
    # The committed JSON is the generator's output, byte for byte: edit the script, rerun it, commit both.
    module = _build_module()
    on_disk = (BUILD_SCRIPT.parent / f"prompts_{name}.json").read_text(encoding="utf-8")
    assert on_disk == module.render(name)
    assert module.render(name) == module.render(name), "generator is not deterministic"
    doc = json.loads(on_disk)
    assert doc["count"] == len(doc["prompts"]) == len(prompts.prompt_records(name))


@pytest.mark.parametrize("bad", [{"name": "test"}, {"name": "train", "category": "poetry"}], ids=str)
def test_bad_arguments_raise_value_error(bad):
    arg = "category" if "category" in bad else "name"
    with pytest.raises(ValueError, match=arg):
        prompts.prompt_records(**bad)
