"""The rounds benchmark's harness: ``--smoke`` runs every variant end to end on the CPU (a tiny random Llama,
the same code path as the 8B GPU run) and prints the full table; a failing variant is reported, not fatal;
the weight-read floors count the bytes a forward and a draft round must read."""

import json

import pytest
import torch

from conftest import gpu_script
from treecompile.bench import rounds
from treecompile.bench.__main__ import BENCHES

SMOKE_ROWS = [
    "treecompile verify N=64 (K=4, S=5)",
    "treecompile decode (1-node tree)",
    "HF forward, StaticCache ctx 96",
    "HF forward, no cache",
    "treecompile draft round K=4, S=5 (Vd=128)",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def test_smoke_runs_every_variant_and_prints_the_full_table(tmp_path, capsys):
    path = tmp_path / "rounds.json"
    assert rounds.main(["--smoke", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0] == rounds.HEADER.splitlines()[0]
    columns = [c.strip() for c in table[0].strip("|").split("|")]
    assert columns == ["variant", "tokens", "ms", "floor ms", "/ floor", "/ decode(1)", "note"]
    body = [[c.strip() for c in line.strip("|").split("|")] for line in table[1:]]
    assert [r[0] for r in body] == [SMOKE_ROWS[0], SMOKE_ROWS[1], SMOKE_ROWS[2], SMOKE_ROWS[2], SMOKE_ROWS[3],
                                    SMOKE_ROWS[3], SMOKE_ROWS[4]]  # fmt: skip
    assert [r[1] for r in body] == ["64", "1", "1", "64", "1", "64", "5 steps"]
    for row in body:
        assert len(row) == len(columns), row
        assert "fail" not in row[2] and "fail" not in row[6], row  # every variant runs on the CPU
        assert float(row[2]) > 0 and float(row[3]) > 0 and float(row[4]) > 0, row
        assert row[5] == "-" if row[0] == SMOKE_ROWS[4] else float(row[5]) > 0, row
    assert "c = T_draft / T_verify(N=64) = " in out
    targets = [line for line in out.splitlines() if line.startswith("- ")]
    assert len(targets) == 3 and all(line.endswith(("-> met", "-> NOT met")) for line in targets)
    assert "[rounds] treecompile verify N=64" in out  # progress lines

    result = json.loads(path.read_text())
    ms = {r["key"]: r["ms"] for r in result["rows"]}
    assert set(ms) == {"verify_64", "decode", "hf_static_1", "hf_static_64", "hf_nocache_1", "hf_nocache_64",
                       "draft"}  # fmt: skip
    assert result["c"] == pytest.approx(ms["draft"] / ms["verify_64"])
    bandwidth = result["copy_bytes_per_s"]
    assert result["floors"]["target_ms"] == pytest.approx(result["target_read_bytes"] / bandwidth * 1e3)
    assert result["floors"]["draft_ms"] == pytest.approx(result["draft_read_bytes"] / bandwidth * 1e3)
    assert [t["limit"] for t in result["targets"]] == [1.15, 1.25, 1.3]
    assert result["targets"][0]["ratio"] == pytest.approx(ms["verify_64"] / ms["decode"])


def test_no_hf_leaves_out_only_hf_rows(tmp_path, capsys):
    """``--no-hf`` (A/B runs of treecompile switches): the verify, decode and draft rows and every target stay."""
    path = tmp_path / "rounds.json"
    assert rounds.main(["--smoke", "--device", "cpu", "--no-hf", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    body = [line for line in out.splitlines() if line.startswith("| ")][1:]  # after the header
    assert [line.split("|")[1].strip() for line in body] == [SMOKE_ROWS[0], SMOKE_ROWS[1], SMOKE_ROWS[4]]
    result = json.loads(path.read_text())
    assert [r["key"] for r in result["rows"]] == ["verify_64", "draft", "decode"]
    assert all(r["ms"] > 0 for r in result["rows"])
    assert [t["met"] is not None for t in result["targets"]] == [True, True, True]


def test_a_failing_variant_is_reported_and_the_run_goes_on(capsys):
    setup = rounds.Setup(device=torch.device("cpu"), dtype=torch.float32, target=dict(rounds.TARGET_SMOKE), ctx=8,
                         nodes=(64,), reps=1, smoke=True)  # fmt: skip
    bench = rounds.RoundsBench(setup)
    good = bench._row("decode", "treecompile decode (1-node tree)", "target", "1")
    bad = bench._row("verify_64", "treecompile verify N=64 (K=4, S=5)", "target", "64")

    def boom():
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    assert bench._attempt([bad], boom) is False
    assert bench._attempt([good], lambda: bench._timed(good, bench.clock.capture(lambda: torch.ones(4).sum())))
    assert bad.ms is None
    assert bad.note == "fail: RuntimeError: operation not permitted when stream is capturing; second line"
    assert good.ms is not None and good.note == ""
    out = capsys.readouterr().out
    assert "[rounds] treecompile verify N=64 (K=4, S=5): fail: RuntimeError: operation not permitted" in out

    ms = {"decode": good.ms, "verify_64": None, "draft": 2.0}
    floors = {"target_ms": good.ms, "draft_ms": 1.0}
    result = {
        "rows": [vars(good), vars(bad)], "floors": floors, "copy_bytes_per_s": 1e9, "target_read_bytes": 1,
        "head_bytes": 1, "draft_read_bytes": 1, "setup": {"steps": 5, "nodes": [64]}, "c": None, "c_floor": 0.5,
        "targets": rounds.check_targets(ms, floors),
    }  # fmt: skip
    report = rounds.format_report(result)
    assert "| treecompile verify N=64 (K=4, S=5) | 64 | fail | " in report
    assert "- verify(64) <= 1.15x decode(1): -x -> n/a (a variant failed)" in report
    assert "capturing; second line |" in report  # the whole note in its cell: no "|" of its own
    assert "- decode(1) <= 1.25x target weight-read floor: 1.00x -> met" in report
    assert "- draft round <= 1.3x its weight-read floor: 2.00x -> NOT met" in report


def test_weight_read_floors_count_what_a_forward_and_a_draft_round_read():
    """Smoke shape, float32: per layer q, k, v, o, the MLP and two norms; the final norm and the LM head; not
    the input embedding (a forward gathers T rows of it). The head: fc once, then S x (its decoder layer
    over the 2H-wide input, its norm, the draft-vocabulary LM head)."""
    from treecompile.drafter import EagleDrafter

    cfg = rounds.TARGET_SMOKE
    H, I, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    model = rounds.build_target(cfg, torch.device("cpu"), torch.float32)
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H
    assert rounds.target_read_bytes(model) == 4 * (L * layer + H + V * H)

    Vd, S = 100, 5
    drafter = EagleDrafter.for_target(model, seed=0, draft_vocab_size=Vd)
    fc = 3 * H * H
    rest = 2 * H + 2 * H * q + 2 * 2 * H * kv + q * H + H + 3 * H * I + H + H * Vd
    assert rounds.draft_read_bytes(drafter, S) == (4 * (fc + rest), 4 * (fc + S * rest))


def test_build_target_initialises_every_weight_and_the_rope_tables():
    model = rounds.build_target(rounds.TARGET_SMOKE, torch.device("cpu"), torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and not p.requires_grad, name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert 0.01 < p.float().std().item() < 0.03, name
    inv_freq = model.model.rotary_emb.inv_freq
    D, theta = rounds.TARGET_SMOKE["head_dim"], rounds.TARGET_SMOKE["rope_parameters"]["rope_theta"]
    expected = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    assert inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-6, atol=0)


def test_registered_and_bad_options_are_refused(capsys):
    assert BENCHES["rounds"] == "treecompile.bench.rounds"
    with pytest.raises(SystemExit) as exc:
        rounds.main(["--smoke", "--nodes", "64,65"])
    assert exc.value.code == 2
    assert "--nodes: expected a comma-separated list of tree sizes in 1..64, got '64,65'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        rounds.main(["--device", "cpu"])
    assert exc.value.code == 2
    assert "--device: only with --smoke (the full benchmark runs on CUDA), got --device cpu" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert rounds.main([]) == 2
        assert "needs a CUDA device (or --smoke)" in capsys.readouterr().out
        with pytest.raises(SystemExit) as exc:
            rounds.main(["--smoke", "--device", "cuda"])
        assert exc.value.code == 2
        assert "--device: 'cuda' asked for, but no CUDA device is available" in capsys.readouterr().err


def test_trace_gaps_splits_replays_and_measures_idle_time(tmp_path, capsys):
    """tests/gpu/trace_gaps.py on a made-up trace: two replays 1 ms apart, each 3 kernels with gaps of 2 and 5 us."""
    events = []
    for base in (0.0, 1000.0):
        for start, dur, name in ((0.0, 10.0, "gemm"), (12.0, 3.0, "norm"), (20.0, 10.0, "gemm")):
            events.append({"ph": "X", "cat": "kernel", "ts": base + start, "dur": dur, "name": name})
    events.append({"ph": "X", "cat": "cpu_op", "ts": 5.0, "dur": 900.0, "name": "host"})  # not a kernel: ignored
    path = tmp_path / "draft.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    tg = gpu_script("trace_gaps")
    groups = tg.replays(tg.kernels(str(path)), split_gap_us=200.0)
    assert [len(g) for g in groups] == [3, 3]
    assert tg.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("span 30.0 us, busy 23.0 us, idle 7.0 us") == 2
    assert "5.00  norm  ->  gemm" in out and "2.00  gemm  ->  norm" in out
    assert "20.0    2   10.00  gemm" in out


def test_inductor_kernels_reads_the_source_node_comments(tmp_path, capsys):
    """tests/gpu/inductor_kernels.py on a made-up Inductor module: the comments above the named kernel only."""
    module = (
        "from torch._inductor.async_compile import AsyncCompile\n\n"
        "# kernel path: /tmp/ic/ab/cab.py\n# Topologically Sorted Source Nodes: [sort], Original ATen: [aten.sort]\n"
        "triton_per_fused_sort_0 = async_compile.triton('triton_per_fused_sort_0', '''\nbody\n''', device_str='cuda')\n\n"
        "# kernel path: /tmp/ic/cd/ccd.py\n# Topologically Sorted Source Nodes: [mean, rsqrt], Original ATen: [aten.mean]\n"
        "triton_red_fused_1 = async_compile.triton('triton_red_fused_1', '''\nx = 1\n''', device_str='cuda')\n"
        "torch.ops.treespec.draft_topk.default\n"
    )
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "cmod.py").write_text(module)
    (tmp_path / "ab" / "other.py").write_text(module.replace("draft_topk", "verify"))
    tool = gpu_script("inductor_kernels")
    assert tool.main([str(tmp_path), "draft_topk", "triton_red_fused_1"]) == 0
    out = capsys.readouterr().out
    assert out.count("== triton_red_fused_1 in") == 1 and "Original ATen: [aten.mean]" in out
    assert "aten.sort" not in out and "(7 characters of kernel source)" in out
    assert tool.main([str(tmp_path), "-", "triton_red_fused_1"]) == 0
    assert capsys.readouterr().out.count("== triton_red_fused_1 in") == 2
    assert tool.main([str(tmp_path), "draft_topk", "triton_red_fused_99"]) == 1
    capsys.readouterr()


def test_inductor_kernels_prints_the_source_and_the_launches(tmp_path, capsys):
    """``--source``: the named kernel's own source and the lines before each of its launches in ``call``, not
    another kernel's."""
    module = (
        "triton_per_fused_sort_0 = async_compile.triton('triton_per_fused_sort_0', '''\nsort_body\n''')\n\n"
        "triton_red_fused_1 = async_compile.triton('triton_red_fused_1', '''\ndef k(in_ptr0):\n    tl.load(in_ptr0)\n''')\n"
        "def call(args):\n    buf7 = empty((4, 4096))\n    # Source Nodes: [embeds]\n"
        "    triton_red_fused_1.run(arg3_1, buf7, 4, 4096, stream=stream0)\n"
        "    triton_per_fused_sort_0.run(buf7, stream=stream0)\n"
    )
    (tmp_path / "cmod.py").write_text(module)
    tool = gpu_script("inductor_kernels")
    assert tool.main(["--source", str(tmp_path), "-", "triton_red_fused_1"]) == 0
    out = capsys.readouterr().out
    assert "    tl.load(in_ptr0)" in out and "sort_body" not in out
    assert "# launch at line 12:" in out and "triton_red_fused_1.run(arg3_1, buf7" in out
    assert "# Source Nodes: [embeds]" in out
    assert "best_config" not in out  # no "# kernel path:" comment above the kernel
    assert tool.main([str(tmp_path), "-", "triton_red_fused_1"]) == 0
    assert "tl.load" not in capsys.readouterr().out  # without --source: the comments only
    # the autotuner's pick beside the kernel's file (named by a hash in recent torch)
    (tmp_path / "kd").mkdir()
    (tmp_path / "kd" / "abc123.best_config").write_text('{"XBLOCK": 8, "R0_BLOCK": 512, "num_warps": 16}')
    path_comment = "# kernel path: " + str(tmp_path / "kd" / "ckd.py") + "\n"
    (tmp_path / "cmod.py").write_text(module.replace("triton_red_fused_1 = ", path_comment + "triton_red_fused_1 = "))
    assert tool.main(["--source", str(tmp_path), "-", "triton_red_fused_1"]) == 0
    out = capsys.readouterr().out
    assert '# best_config abc123.best_config: {"XBLOCK": 8, "R0_BLOCK": 512' in out and "# launch at line 13:" in out
    (tmp_path / "kd" / "abc123.best_config").unlink()
    assert tool.main(["--source", str(tmp_path), "-", "triton_red_fused_1"]) == 0
    assert "# best_config: none in" in capsys.readouterr().out


def test_paired_sweep_checks_each_config_and_sorts(monkeypatch, capsys):
    """tests/gpu/paired_sweep.py (the glu and rope sweeps' loop) with a stand-in timer: tiles past sm_90's shared
    memory are never tried, a config whose check fails (NaN, too large, or raising) is not timed, the rest come back
    fastest first."""
    import triton

    ts = gpu_script("paired_sweep")
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, rep: (fn(), ts_times.pop(0))[1])
    checked, ran = [], []

    def error(cfg):
        checked.append(cfg)
        if cfg[2] == 256:  # every 256-wide K step "writes" nothing
            return float("nan")
        if cfg[3] == 8 and cfg[4] == 6:
            raise RuntimeError("out of resource")
        return 0.02 if cfg[1] == 128 and cfg[4] == 5 else 0.0  # over the 1e-2 tolerance

    total = [(w, k, n, s) for w in (32, 128) for k in (64, 128, 256) for n in (4, 8) for s in (3, 4, 5, 6)]
    fits = [c for c in total if c[3] * (64 + 2 * c[0]) * c[1] * 2 <= ts.SMEM_LIMIT]
    ts_times = [float(100 - i) for i in range(len(fits))]  # later configs "faster": the result must be re-sorted
    rows = ts.sweep_tiles((32, 128), error, lambda cfg: ran.append(cfg), 1e-2, floor_us=50.0)
    assert len(checked) == len(fits) < len(total)  # nothing past the shared memory is compiled or checked
    assert all(c[2] != 256 and not (c[3] == 8 and c[4] == 6) and not (c[1] == 128 and c[4] == 5) for c in ran)
    assert any(c[1] == 128 and c[4] == 5 for c in checked)  # the too-large error was met, and refused
    assert [r["us"] for r in rows] == sorted(r["us"] for r in rows) and len(rows) == len(ran)
    assert set(rows[0]) == {"us", "block_n", "block_k", "warps", "stages"}
    assert "wrong: max err nan" in capsys.readouterr().out


def test_failure_reason_keeps_every_line_and_caps_the_length():
    from treecompile.bench import failure_reason
    from treecompile.drafter import EagleDrafter
    from treecompile.registry import resolve_tree_support

    model = rounds.build_target(dict(rounds.TARGET_SMOKE, head_dim=16), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError) as refused:
        resolve_tree_support(model, device=torch.device("cuda"), dtype=torch.bfloat16, max_seq_len=128)
    reason = failure_reason(refused.value)
    assert reason.startswith("ValueError: tree speculation is not supported here (2 blockers):; target layer 0 (")
    assert "head_dim 16 has no CUDA kernel" in reason and "target layer 1 (" in reason and "\n" not in reason
    capped = failure_reason(RuntimeError("x" * 1000), limit=50)
    assert len(capped) == 50 and capped.endswith("...")
    # The smoke model itself has a CUDA kernel for every layer, target and draft (asked without a GPU).
    model = rounds.build_target(dict(rounds.TARGET_SMOKE), torch.device("cpu"), torch.float32)
    drafter = EagleDrafter.for_target(model, seed=0).eval()
    for dtype in (torch.float32, torch.bfloat16):
        resolve_tree_support(model, drafter, device=torch.device("cuda"), dtype=dtype, max_seq_len=128)
