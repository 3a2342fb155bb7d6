"""The linear-attention benchmark's harness: ``--smoke`` runs every GDN / Mamba2 variant end to end on the CPU
(tiny shapes, the ops' reference paths, the same code as the GPU run) and prints every row; ops this build
lacks read "not built"; a failing variant is reported, not fatal; the floors and memory rows count the
right bytes."""

import json
import math

import pytest
import torch

from treecompile.bench import linear
from treecompile.bench.__main__ import BENCHES
from treecompile.ops.gdn_tree import gdn_branch_points

OPTIONAL = {"gdn_tree_verify_chunked", "gdn_tree_verify_staged", "mamba2_tree_verify_staged", "mamba2_tree_verify_chunked"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def _table(out: str, header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the markdown table whose header line is ``header``."""
    lines = out.splitlines()
    start = lines.index(header) + 2
    body = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        body.append([c.strip() for c in line.strip("|").split("|")])
    return body


def _expected_keys(nodes, accepts) -> list[str]:
    keys = []
    for model in ("gdn", "mamba2"):
        for n in nodes:
            keys += [f"{model}/tree_{n}", f"{model}/chain_{n}", f"{model}/staged_tree_{n}"]
            if n <= (16 if model == "gdn" else 64):
                keys += [f"{model}/chunked_tree_{n}", f"{model}/chunked_chain_{n}"]
        keys += [f"{model}/chain_{a}" for a in accepts if a > 1 and a not in nodes]
        keys += [f"{model}/decode_1", f"{model}/decode_step", f"{model}/decode_1_chunked"]
        keys += [f"{model}/{kind}_{a}" for a in accepts for kind in ("commit", "staged_commit")]
    return keys


def _op_of(key: str) -> str | None:
    """The optional op a row needs, if any."""
    model, name = key.split("/")
    if name.startswith("chunked_") or name.endswith("_chunked"):
        return f"{model}_tree_verify_chunked"
    if name.startswith("staged_tree_"):
        return f"{model}_tree_verify_staged"
    return None


def test_smoke_runs_every_variant_and_prints_the_full_table(tmp_path, capsys):
    path = tmp_path / "linear.json"
    assert linear.main(["--smoke", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(path.read_text())
    nodes, accepts = (8, 16), (1, 4, 8)
    assert result["setup"]["nodes"] == list(nodes) and result["setup"]["accepts"] == list(accepts)

    rows = {r["key"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(_expected_keys(nodes, accepts))
    built = {op: linear.op_available(op) for op in OPTIONAL}
    for key, r in rows.items():
        op = _op_of(key)
        if op is not None and not built[op]:
            assert r["us"] is None and r["note"] == "not built", r
            continue
        assert r["note"] == "" and math.isfinite(r["us"]) and r["us"] > 0, r
        assert math.isfinite(r["floor_us"]) and r["floor_us"] > 0, r

    header = linear.HEADER.splitlines()[0]
    body = _table(out, header)
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == ["model", "variant", "size", "us / layer", "floor us", "/ floor", "note"]
    assert len(body) == len(rows)
    for cells in body:
        assert len(cells) == len(columns), cells
        assert cells[0] in ("GDN", "Mamba2") and cells[2].startswith(("N=", "A=")), cells
        if cells[3] == "not built":
            assert cells[6] == "not built", cells
            continue
        assert "fail" not in cells[3] + cells[6], cells  # every built variant runs on the CPU
        assert float(cells[3]) > 0 and float(cells[4]) > 0 and float(cells[5]) > 0, cells
    sizes = [(c[0], c[2]) for c in body if "tree verify (`" in c[1] and "chunked" not in c[1] and "staged" not in c[1]]
    assert sizes == [("GDN", "N=8"), ("GDN", "N=16"), ("Mamba2", "N=8"), ("Mamba2", "N=16")]

    us = {k: r["us"] for k, r in rows.items()}
    targets = {(t["model"], t["name"]): t for t in result["ratios"] if t["limit"] is not None}
    for model in ("gdn", "mamba2"):
        for n in nodes:
            t = targets[model, f"tree / chain verify, N={n}"]
            assert t["limit"] == 1.5 and t["ratio"] == pytest.approx(us[f"{model}/tree_{n}"] / us[f"{model}/chain_{n}"])
        for a in accepts:
            chain = us[f"{model}/chain_{a}" if a > 1 else f"{model}/decode_1"]
            t = targets[model, f"replay commit A={a} / chain verify N={a}"]
            assert t["limit"] == 1.2 and t["ratio"] == pytest.approx(us[f"{model}/commit_{a}"] / chain)
            t = targets[model, f"replay commit A={a} / ({a} x decode step)"]
            assert t["ratio"] == pytest.approx(us[f"{model}/commit_{a}"] / (a * us[f"{model}/decode_step"]))
        for n in nodes:  # the chunked op's own tree / chain (GDN N <= 16, Mamba2 N <= 64)
            t = targets[model, f"chunked tree / chunked chain, N={n}"]
            want = us[f"{model}/chunked_tree_{n}"] / us[f"{model}/chunked_chain_{n}"]
            assert t["limit"] == 1.5 and t["ratio"] == pytest.approx(want)
    assert len(targets) == 2 * (2 * len(nodes) + 2 * len(accepts))
    verdicts = [c[4] for c in _table(out, linear.RATIO_HEADER.splitlines()[0])]
    assert verdicts.count("met") + verdicts.count("NOT met") == len(targets)

    memory = {(m["model"], m["N"]): m for m in result["memory"]}
    gdn, state = linear.GDN_SMOKE, 4 * 16 * 16 * 4  # Hv * Dk * Dv fp32, batch 1
    for n in nodes:
        parents = torch.tensor(result["trees"]["gdn"][str(n)]["parents"])
        points = int(gdn_branch_points(parents).sum())
        m = memory["gdn", n]
        assert m["branch_points"] == [points] and m["layers"] == gdn.model_layers == 36
        assert m["workspace_bytes"] == n * state and m["workspace_written_bytes"] == points * state
        assert m["scratch_layer_bytes"] == n * state and m["scratch_model_bytes"] == 36 * n * state
        assert m["payload_model_bytes"] == 36 * n * (2 * 16 + 4 * 16 + 2 * 4) * 4  # [k | v | g | beta] rows
        assert memory["mamba2", n]["workspace_bytes"] == 0
        assert memory["mamba2", n]["scratch_model_bytes"] == 64 * n * 4 * 16 * 16 * 4

    assert "87 us/layer" in out and "B200" in out and "H200" in out and "not a comparison" in out
    assert "[linear] gdn tree verify (`gdn_tree_verify`) N=8: " in out  # progress lines


def _tiny_setup(**kwargs) -> linear.Setup:
    base = dict(device=torch.device("cpu"), gdn=linear.GDN_SMOKE, mamba2=linear.MAMBA2_SMOKE, nodes=(8,),
                accepts=(1,), layers=1, reps=1, copy_bytes=1 << 20, smoke=True)  # fmt: skip
    return linear.Setup(**(base | kwargs))


def test_a_failing_variant_is_reported_and_the_run_goes_on(monkeypatch, capsys):
    verify = linear.Mamba2Model.verify

    def broken(self, kind, x, state, parents, *args):
        if kind == "tree" and not torch.equal(parents, linear.chain_parents(parents.shape[1], 1)):
            raise RuntimeError("operation not permitted when stream is capturing\nsecond line")
        return verify(self, kind, x, state, parents, *args)

    monkeypatch.setattr(linear.Mamba2Model, "verify", broken)
    result = linear.LinearBench(_tiny_setup(models=("mamba2",))).run()
    rows = {r["key"]: r for r in result["rows"]}
    assert rows["mamba2/tree_8"]["us"] is None
    note = "fail: RuntimeError: operation not permitted when stream is capturing; second line"
    assert rows["mamba2/tree_8"]["note"] == note
    for key in ("mamba2/chain_8", "mamba2/decode_1", "mamba2/decode_step", "mamba2/commit_1"):
        assert rows[key]["us"] > 0 and rows[key]["note"] == "", key
    out = capsys.readouterr().out
    assert "[linear] mamba2 tree verify (`mamba2_tree_verify`) N=8: fail: RuntimeError: operation not" in out
    report = linear.format_report(result)
    assert "| Mamba2 | tree verify (`mamba2_tree_verify`) | N=8 | fail | " in report
    assert "| Mamba2 | tree / chain verify, N=8 | - | <= 1.50 | n/a (a variant failed or is not built) |" in report


def test_ops_this_build_lacks_read_not_built(monkeypatch):
    absent = {"gdn_tree_verify_chunked", "gdn_tree_verify_staged"}
    monkeypatch.setattr(linear, "op_available", lambda name: name not in absent and hasattr(torch.ops.treespec, name))
    result = linear.LinearBench(_tiny_setup(models=("gdn",))).run()
    rows = {r["key"]: r for r in result["rows"]}
    for key in ("gdn/chunked_tree_8", "gdn/chunked_chain_8", "gdn/staged_tree_8"):
        assert rows[key]["us"] is None and rows[key]["note"] == "not built", key
    assert rows["gdn/tree_8"]["us"] > 0 and rows["gdn/staged_commit_1"]["us"] > 0
    report = linear.format_report(result)
    assert "| GDN | staged tree verify (`gdn_tree_verify_staged`) | N=8 | not built | " in report
    assert "| GDN | chunked tree / chunked chain, N=8 | - | <= 1.50 | n/a (a variant failed or is not built) |" in report


def test_eagle_trees_are_trees_of_n_nodes_with_reported_branch_points():
    for n in (1, 2, 5, 8, 16, 33, 64):
        parents, depth = linear.eagle_tree(n, batch=2, seed=n)
        assert parents.shape == depth.shape == (2, n)
        assert (parents[:, 0] == -1).all() and (parents[:, 1:] >= 0).all()
        assert (parents < torch.arange(n)).all()
        again, _ = linear.eagle_tree(n, batch=2, seed=n)
        assert torch.equal(parents, again)  # seeded
        for b in range(2):
            row = parents[b].tolist()
            children = [[c for c in range(n) if row[c] == t] for t in range(n)]
            expected = sum(any(c != t + 1 for c in kids) for t, kids in enumerate(children))
            assert linear.branch_points(parents)[b] == expected
    parents, depth = linear.eagle_tree(64, batch=1, seed=64)
    assert linear.branch_points(parents)[0] > 4 and int(depth.max()) == 6  # branchy, K=4 lanes over 6 steps


def test_floor_bytes_count_state_inputs_outputs_and_payload():
    """Smoke GDN (Hk=2, Hv=4, Dk=Dv=16, bf16 inputs) and Mamba2 (H=4, P=16, S_n=16, G=1), batch 2."""
    setup = _tiny_setup(batch=2)
    gdn = linear.GdnModel(setup)
    state = 2 * 4 * 16 * 16 * 4
    width = 2 * 16 + 4 * 16 + 2 * 4
    per_node = 2 * (2 * 2 * 16 + 2 * 4 * 16 + 2 * 4)  # q, k, v, o, g, beta in bf16
    assert gdn.verify_bytes(8, "tree") == state + 2 * 8 * per_node + 2 * 8 * width * 4
    assert gdn.verify_bytes(8, "staged") == state + 2 * 8 * per_node + 8 * state
    assert gdn.commit_bytes(4) == 2 * state + 2 * 4 * width * 4
    assert gdn.staged_commit_bytes() == 2 * state

    mamba = linear.Mamba2Model(setup)
    state = 2 * 4 * 16 * 16 * 4
    width = 4 * 16 + 2 * 4 + 16
    per_node = 2 * (2 * 4 * 16 + 4 + 2 * 16)  # x, y, dt, B, C in bf16
    assert mamba.verify_bytes(8, "tree") == state + 2 * 8 * per_node + 3 * 4 * 4 + 2 * 8 * width * 4


def test_registered_and_bad_options_are_refused(capsys):
    assert BENCHES["linear"] == "treecompile.bench.linear"
    for argv, message in (
        (["--smoke", "--nodes", "8,65"], "--nodes: expected a comma-separated list of ints in 1..64, got '8,65'"),
        (["--smoke", "--accepts", "x"], "--accepts: expected a comma-separated list of ints in 1..64, got 'x'"),
        (["--smoke", "--models", "gdn,rwkv"], "--models: expected a comma-separated subset of gdn,mamba2"),
        (["--smoke", "--layers", "0"], "--layers: expected a positive int, got 0"),
    ):
        with pytest.raises(SystemExit) as exc:
            linear.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert linear.main([]) == 2
        assert "needs a CUDA device (or --smoke)" in capsys.readouterr().out
