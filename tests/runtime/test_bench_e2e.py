"""``python -m treecompile.bench e2e --smoke``: the end-to-end harness on a tiny random Llama (CPU, float32).

One smoke run (module fixture, ~30 s) serves most tests: every configuration x batch size has a row with
finite positive numbers, treecompile's outputs equal HF greedy, accept lengths add up to the tokens the
rounds emitted, and ``--plot`` without matplotlib says so in one line while the rest still runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys

import pytest

from treecompile.bench import e2e
from treecompile.bench.__main__ import main as bench_main

BATCHES = (1, 2)
MAX_NEW = 8
PROMPTS = 2


def _run(argv: list[str]) -> tuple[int, str]:
    """``e2e.main(argv)`` on the CPU, where CUDA is present too (its default device there), and its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = e2e.main(["--device", "cpu", *argv])
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    json_path, png = tmp / "e2e.json", tmp / "e2e.png"
    with pytest.MonkeyPatch.context() as mp:  # matplotlib "not installed", whether or not it is
        mp.setitem(sys.modules, "matplotlib", None)
        mp.setitem(sys.modules, "matplotlib.pyplot", None)
        rc, stdout = _run(["--smoke", "--json", str(json_path), "--plot", str(png)])
    return {"rc": rc, "stdout": stdout, "result": json.loads(json_path.read_text()), "png": png}


def _expected_names():
    names = ["hf_eager", "tc_plain", f"chain({e2e.DEFAULT_CHAIN_STEPS})"]
    names += [f"tree({k},{s},{n})" for k, s, n in e2e.SMOKE_TREES]
    return names + ["hf_compile"]


def test_smoke_writes_every_configuration_row(smoke):
    assert smoke["rc"] == 0, smoke["stdout"][-3000:]
    result = smoke["result"]
    assert result["complete"] is True and result["setup"]["smoke"] is True
    rows = {(r["config"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {(name, b) for name in _expected_names() for b in BATCHES}
    assert len(rows) == len(result["rows"])  # no duplicates
    for (name, b), r in rows.items():
        assert r["error"] is None, (name, b, r["error"])
        assert r["prompts"] == PROMPTS
        assert r["new_tokens"] == PROMPTS * MAX_NEW  # the smoke target has no EOS: every row runs to the limit
        for key in ("tokens_per_s", "wall_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (name, b, key, r[key])
        assert math.isfinite(r["warmup_s"]) and r["warmup_s"] >= 0
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_s"])
    # The markdown table has one line per row.
    table = [line for line in smoke["stdout"].splitlines() if line.startswith("| ") and "batch" not in line]
    assert len(table) == len(rows)


def test_smoke_treecompile_outputs_equal_plain_greedy(smoke):
    for r in smoke["result"]["rows"]:
        assert r["reference"] == "hf_eager"
        assert r["matches"] == r["prompts"] and r["mismatched_prompts"] == []
        assert r["outputs_match"] is True, r["config"]


def test_smoke_tau_and_accept_lengths_add_up(smoke):
    saw_accepted_draft = False
    for r in smoke["result"]["rows"]:
        if r["tree"] is None:  # HF generate
            assert r["config"].startswith("hf_") and r["tau"] is None and r["accept_hist"] is None
            assert r["shrinks"] is None
            continue
        # Plain decode's requests all stop at the token limit together (no EOS in the smoke target), and a
        # batch of one has nothing to shrink to; a tree's requests can stop rounds apart.
        assert isinstance(r["shrinks"], int) and r["shrinks"] >= 0
        if r["config"] == "tc_plain" or r["batch_size"] == 1:
            assert r["shrinks"] == 0, (r["config"], r["batch_size"])
        hist = {int(k): v for k, v in r["accept_hist"].items()}
        # Prefill emits each request's first token; every later token comes from a round.
        assert sum(k * v for k, v in hist.items()) == r["new_tokens"] - r["prompts"]
        assert sum(hist.values()) == r["rounds"] > 0
        assert r["tau"] == pytest.approx((r["new_tokens"] - r["prompts"]) / r["rounds"])
        # Every batch ran at least as many rounds as its requests needed; the slots add up to the rounds.
        batches = -(-PROMPTS // r["batch_size"])
        assert len(r["batch_rounds"]) == batches and min(r["batch_rounds"]) >= 1
        assert r["rounds"] <= sum(r["batch_rounds"]) * r["batch_size"]
        assert r["occupancy"] == pytest.approx(r["rounds"] / (sum(r["batch_rounds"]) * r["batch_size"]))
        assert 0 < r["occupancy"] <= 1
        assert r["ms_per_batch_round"] == pytest.approx(r["wall_s"] * 1e3 / sum(r["batch_rounds"]))
        if r["config"] == "tc_plain":
            assert set(hist) == {1}
            # No EOS in the smoke target: every request takes MAX_NEW - 1 rounds, so no slot idles.
            assert r["batch_rounds"] == [MAX_NEW - 1] * batches and r["occupancy"] == 1.0
        else:
            assert min(hist) >= 1 and max(hist) <= r["tree"][1] + 1  # the root, then one token per depth
            saw_accepted_draft |= max(hist) > 1
    assert saw_accepted_draft, "no smoke round accepted a draft: the tau path went untested"


def test_smoke_speedups_are_relative_to_the_same_batch(smoke):
    rows = {(r["config"], r["batch_size"]): r for r in smoke["result"]["rows"]}
    for (name, b), r in rows.items():
        assert r["speedup_vs_tc_plain"] == pytest.approx(r["tokens_per_s"] / rows[("tc_plain", b)]["tokens_per_s"])
        assert r["speedup_vs_hf_compile"] == pytest.approx(r["tokens_per_s"] / rows[("hf_compile", b)]["tokens_per_s"])


def test_plot_without_matplotlib_prints_one_line_and_the_run_goes_on(smoke):
    lines = [line for line in smoke["stdout"].splitlines() if line.startswith("plot:")]
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0] and str(smoke["png"]) in lines[0]
    assert not smoke["png"].exists()
    assert smoke["rc"] == 0 and smoke["result"]["complete"] is True


def test_plot_with_matplotlib_writes_a_png(smoke, tmp_path):
    # matplotlib is in the "test" extra: without it write_plot returns False and this fails, never skips.
    path = tmp_path / "plot.png"
    assert e2e.write_plot(smoke["result"], str(path)) is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_configuration_is_reported_and_the_run_goes_on(tmp_path):
    json_path = tmp_path / "fail.json"
    # (4,6,16): 5 lane steps of 4 need 20 lane slots > 16 nodes, refused when the speculator is built.
    rc, stdout = _run(["--smoke", "--configs", "tc_tree", "--trees", "4,6,16;2,2,3", "--batch-sizes", "1",
                       "--prompts", "1", "--max-new-tokens", "4", "--json", str(json_path)])  # fmt: skip
    assert rc == 0
    assert any("tree(4,6,16): fail: ValueError" in line for line in stdout.splitlines())
    rows = {r["config"]: r for r in json.loads(json_path.read_text())["rows"]}
    assert rows["tree(4,6,16)"]["error"].startswith("ValueError") and rows["tree(4,6,16)"]["tokens_per_s"] is None
    assert rows["tree(2,2,3)"]["error"] is None and rows["tree(2,2,3)"]["tokens_per_s"] > 0
    assert "| 1 | tree(4,6,16) | fail: ValueError" in stdout


def test_repeats_time_every_pass_and_report_the_median(tmp_path):
    json_path = tmp_path / "repeats.json"
    rc, _ = _run(["--smoke", "--configs", "hf_eager,tc_tree", "--trees", "2,2,3", "--batch-sizes", "1",
                  "--prompts", "2", "--max-new-tokens", "4", "--repeats", "3", "--json", str(json_path)])  # fmt: skip
    assert rc == 0
    result = json.loads(json_path.read_text())
    assert result["setup"]["repeats"] == 3
    for row in result["rows"]:
        walls = row["wall_s_repeats"]
        assert len(walls) == 3 and all(w > 0 for w in walls)
        assert row["wall_s"] == sorted(walls)[1]
        assert math.isclose(row["tokens_per_s"], row["new_tokens"] / row["wall_s"])
        assert row["prompts"] == 2 and row["error"] is None
    assert {r["config"]: r["outputs_match"] for r in result["rows"]} == {"hf_eager": True, "tree(2,2,3)": True}


def test_shrink_ab_times_the_same_speculator_with_shrinking_off_then_on(tmp_path, monkeypatch):
    """--shrink-ab: at a batch size after a smaller one, each treecompile row has a "+shrink" twin; the
    passes alternate off / on on one speculator."""
    from treecompile.speculator import TreeSpeculator

    flags = []  # shrink_batch as each generate call saw it
    generate = TreeSpeculator.generate

    def recording_generate(self, *args, **kwargs):
        flags.append((self.num_nodes, self.shrink_batch))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(TreeSpeculator, "generate", recording_generate)
    json_path = tmp_path / "ab.json"
    rc, stdout = _run(["--smoke", "--configs", "hf_eager,tc_plain,tc_tree", "--trees", "2,3,6", "--batch-sizes", "1,2",
                       "--prompts", "3", "--max-new-tokens", "8", "--repeats", "2", "--shrink-ab",
                       "--json", str(json_path)])  # fmt: skip
    assert rc == 0, stdout[-3000:]
    result = json.loads(json_path.read_text())
    assert result["setup"]["shrink_ab"] is True
    rows = {(r["config"], r["batch_size"]): r for r in result["rows"]}
    twins = {"tc_plain+shrink", "tree(2,3,6)+shrink"}
    # No twin at batch 1 (nothing smaller to shrink onto) or for HF generate.
    assert set(rows) == {(n, b) for n in ("hf_eager", "tc_plain", "tree(2,3,6)") for b in (1, 2)} | {(t, 2) for t in twins}
    for (name, b), r in rows.items():
        assert r["error"] is None and r["outputs_match"] is True, (name, b, r["error"])
        assert len(r["wall_s_repeats"]) == 2
        if name in twins:
            base = rows[(name.removesuffix("+shrink"), b)]
            assert r["warmup_s"] == base["warmup_s"] and r["tree"] == base["tree"]
            assert r["speedup_vs_tc_plain"] == pytest.approx(r["tokens_per_s"] / rows[("tc_plain", b)]["tokens_per_s"])
        elif r["tree"] is not None:
            assert r["shrinks"] == 0, name  # shrinking off
    # 3 prompts at batch 2 end on a batch with one real request: its padded row stops first, so the tree's
    # shrink row moved at least that batch onto batch 1.
    assert rows[("tree(2,3,6)+shrink", 2)]["shrinks"] >= 1
    # Batch 2 of the tree: the warm-up, then per repeat two batches off, two on.
    tree_flags = [f for n, f in flags if n == 6]
    assert not any(tree_flags[: 1 + 2 * 3])  # batch 1 (warm-up + 2 repeats x 3 batches): off, as every row
    tree_b2 = tree_flags[1 + 2 * 3:]
    assert tree_b2 == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 2, tree_b2
    assert flags[-1] == (6, True)
    assert "tree(2,3,6)+shrink:" in stdout


class _Killed(BaseException):
    """Stands for the time limit's kill: not an Exception, so no configuration handler catches it."""


def test_json_is_written_after_each_configuration(tmp_path, monkeypatch):
    json_path = tmp_path / "partial.json"
    measure = e2e.E2EBench._measure
    calls = []

    def measure_then_die(self, config, b, row, twin=None):
        calls.append(config.name)
        if len(calls) == 2:
            raise _Killed
        measure(self, config, b, row, twin)

    monkeypatch.setattr(e2e.E2EBench, "_measure", measure_then_die)
    with pytest.raises(_Killed):
        _run(["--smoke", "--configs", "hf_eager", "--batch-sizes", "1,2", "--prompts", "1",
              "--max-new-tokens", "2", "--json", str(json_path)])  # fmt: skip
    partial = json.loads(json_path.read_text())
    assert partial["complete"] is False
    assert [(r["config"], r["batch_size"]) for r in partial["rows"]] == [("hf_eager", 1)]
    assert partial["rows"][0]["tokens_per_s"] > 0


@pytest.mark.parametrize(
    "args,match",
    [
        (["--trees", "4,6"], "--trees: expected 'topk,steps,num_nodes'"),
        (["--trees", "4,6,65"], "num_nodes <= 64"),
        (["--configs", "tc_plain,bogus"], "--configs: unknown ['bogus']"),
        (["--batch-sizes", "0"], "--batch-sizes: expected a comma-separated list of positive ints"),
        (["--dtype", "float64"], "--dtype: one of ['bfloat16', 'float16', 'float32'], got 'float64'"),
        (["--dtype", "float32"], "--dtype: the smoke model always runs in float32"),
        (["--repeats", "0"], "--repeats: expected an int in 1..20, got 0"),
        (["--shrink-ab", "--shrink-batch"], "--shrink-ab: times shrinking off and on itself; leave --shrink-batch unset"),
    ],
    ids=["trees-2-ints", "trees-65-nodes", "configs-bogus", "batch-0", "dtype-unknown", "dtype-smoke", "repeats-0",
         "shrink-ab-with-shrink-batch"],
)
def test_bad_arguments_are_one_clear_line(args, match, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["e2e", "--smoke", *args])  # through the bench dispatcher: "e2e" is registered
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_tc_plain_rounds_run_no_draft_head(tmp_path, monkeypatch):
    """treecompile's plain decode is the baseline a speculator must beat: its rounds skip the head."""
    from treecompile.drafter import EagleDrafter

    def no_drafts(*args, **kwargs):
        raise AssertionError("the draft head ran in a plain-decode round")

    monkeypatch.setattr(EagleDrafter, "draft_step0", no_drafts)
    monkeypatch.setattr(EagleDrafter, "draft_lanes", no_drafts)
    json_path = tmp_path / "plain.json"
    rc, stdout = _run(["--smoke", "--configs", "hf_eager,tc_plain,tc_chain", "--batch-sizes", "2", "--prompts", "2",
                       "--max-new-tokens", "4", "--json", str(json_path)])  # fmt: skip
    rows = {r["config"]: r for r in json.loads(json_path.read_text())["rows"]}
    assert rows["tc_plain"]["error"] is None and rows["tc_plain"]["outputs_match"] is True, stdout
    assert "AssertionError" in rows[f"chain({e2e.DEFAULT_CHAIN_STEPS})"]["error"]  # the patch does bite drafters
    assert rc == 0
