"""The Triton kernels compile for Hopper (sm_90) on the CPU machine, through ptxas to a cubin, and the hot loops
are software-pipelined (async copies into shared memory) where they should be.

No GPU is needed: ``triton.compile`` takes a target. This catches what the interpreter cannot (it runs the
kernels in Python): a construct the NVIDIA backend refuses (atomics' memory semantics, cache modifiers, TMA
descriptor loads, dependent-launch intrinsics), and a loop that silently lost its pipelining. The arguments
carry the 16-divisibility a real launch of aligned tensors gets from Triton's specialisation, without which
no load is wide enough for an async copy.

The tests' process runs Triton in its interpreter (conftest), where ``@triton.jit`` gives interpreted
functions that cannot be compiled, so one subprocess without ``TRITON_INTERPRET`` compiles every case (this
file run as a script) and the tests read its report.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys

import pytest

ASYNC_COPY = re.compile(r"async_copy_global_to_local|async_tma_copy_global_to_local")

CASCADE_TYPES = dict(
    q="*bf16", k_cache="*bf16", v_cache="*bf16", page_table="*i32", prefix_len="*i64", ancestor_mask="*i64",
    o_part="*fp32", lse_part="*fp32", k_desc="*bf16", v_desc="*bf16", k_new="*bf16", v_new="*bf16",
    new_slots="*i64", qk_scale="fp32",
)  # fmt: skip
CASCADE_SCALARS = ("R", "NS", "num_slots", "max_pages", "num_pages")  # any value: no divisibility
SKINNY_TYPES = dict(x="*bf16", w="*bf16", b="*bf16", r="*bf16", out="*bf16", ws="*fp32", counters="*i32")


def _cases() -> dict:
    """name -> (module, kernel, constexprs, types, unaligned args, num_warps, num_stages)."""
    cases = {}
    for tma in (False, True):
        for new_rows, pdl, l2 in ((False, False, 0), (True, True, 0), (True, True, 4)):
            types = dict(CASCADE_TYPES)
            if tma:
                types["k_desc"] = types["v_desc"] = "tensordesc<bf16[64,128]>"
            const = dict(HKV=8, G=4, PAGE=64, WINDOW=64, NRB=4, D=128, BLOCK_M=64, BLOCK_N=64, BLOCK_W=64,
                         MIN_CHUNK=256, PREC="tf32", NEW_ROWS=new_rows, TMA=tma, USE_PDL=pdl, L2_PREFETCH=l2,
                         L2_LINES=2, L2_LINE_ELEMS=64)  # fmt: skip
            name = f"stage1-{'tma' if tma else 'pointers'}-{'write+pdl' if pdl else 'plain'}{'-l2' if l2 else ''}"
            cases[name] = ("_tree_attention_kernels", "cascade_partial_kernel", const, types, CASCADE_SCALARS, 4, 3)
    for rows, pdl in ((1, True), (4, False)):
        cases[f"merge-rows{rows}"] = (
            "_tree_attention_kernels", "cascade_merge_kernel", dict(D=128, BLOCK_S=16, ROWS=rows, USE_PDL=pdl),
            dict(o_part="*fp32", lse_part="*fp32", out="*bf16"), ("num_rows", "NS"), 1 if rows == 1 else 4, 3,
        )  # fmt: skip
    # "-res": the residual epilogue; "-normout": with it, norm_weight * s and the partial sums of s^2 stored too
    # (skinny_linear_norm_out, passes/fuse_residual_norm.py)
    for split_k, l2, tma, res, norm_out in (
        (1, 0, False, False, False), (4, 0, False, False, False), (1, 4, False, False, False),
        (1, 0, True, False, False), (4, 0, True, False, False), (1, 0, False, True, False), (4, 0, False, True, False),
        (1, 0, False, True, True), (4, 0, False, True, True),
    ):  # fmt: skip
        const = dict(HAS_BIAS=True, HAS_RES=res, NORM_OUT=norm_out, EVEN_K=True, TMA=tma, PREC="tf32", USE_PDL=True,
                     BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, SPLIT_K=split_k, L2_LINES=l2 * 2, LINE_ELEMS=64)  # fmt: skip
        types = dict(SKINNY_TYPES, w_desc="tensordesc<bf16[32,128]>" if tma else "*bf16", u="*bf16", sq="*fp32",
                     g="*bf16")  # fmt: skip
        name = f"skinny-mma-split{split_k}{'-l2' if l2 else ''}{'-tma' if tma else ''}{'-res' if res else ''}"
        cases[name + ("-normout" if norm_out else "")] = (
            "skinny_linear", "_skinny_linear_kernel", const, types, ("M", "s_b", "s_rm", "s_g"), 4, 4,
        )  # fmt: skip
    # the gated gate/up GEMM at the 8B verify's tiles (gate/up's 128-wide slice, halved); "norm": with the row-scale
    # epilogue of passes/fuse_residual_norm.py (128 partial sums a row: the 8B o / down producers' 32-wide slices)
    for even, norm in ((True, False), (False, False), (True, True)):
        const = dict(EVEN_K=even, ROW_SCALE=norm, S_P2=128 if norm else 1, PREC="tf32", USE_PDL=True, BLOCK_M=64,
                     BLOCK_N=64, BLOCK_K=128)  # fmt: skip
        types = dict(x="*bf16", w="*bf16", out="*bf16", ss="*fp32", eps="fp32")
        cases[f"skinny-glu-{'even' if even else 'tail'}{'-norm' if norm else ''}"] = (
            "skinny_glu", "_skinny_glu_kernel", const, types, ("M", "S"), 4, 3,
        )  # fmt: skip
    for even, norm in ((True, False), (False, False), (True, True)):  # q/k/v + rotary embedding, 8B verify tiles
        const = dict(HAS_BIAS=not even, ROW_SCALE=norm, S_P2=128 if norm else 1, D=128, PER_HEAD=2, EVEN_K=even,
                     PREC="tf32", USE_PDL=True, BLOCK_M=64, BLOCK_N=32, BLOCK_K=128)  # fmt: skip
        types = dict(x="*bf16", w="*bf16", b="*bf16", cos="*bf16", sin="*bf16", q="*bf16", k="*bf16", v="*bf16",
                     ss="*fp32", eps="fp32")  # fmt: skip
        cases[f"skinny-qkv-rope-{'even' if even else 'tail'}{'-norm' if norm else ''}"] = (
            "skinny_qkv_rope", "_skinny_qkv_rope_kernel", const, types, ("M", "Hq", "Hkv", "s_b", "S"), 4, 4,
        )  # fmt: skip
    for split_k, prefetch, l2, pipeline in ((1, True, 0, False), (4, True, 0, False), (4, False, 0, False),
                                            (1, True, 2, False), (1, False, 0, True), (4, False, 0, True)):
        const = dict(HAS_BIAS=False, USE_PDL=True, PREFETCH=prefetch, PIPELINE=pipeline, BLOCK_M=1, BLOCK_N=4,
                     BLOCK_K=512, SPLIT_K=split_k, L2_LINES=l2 * 8, LINE_ELEMS=64, NUM_STAGES=3)  # fmt: skip
        name = f"skinny-gemv-split{split_k}-{'pipelined' if pipeline else 'prefetch' if prefetch else 'wait'}"
        const["HAS_RES"] = False
        cases[name + ("-l2" if l2 else "")] = (
            "skinny_linear", "_skinny_gemv_kernel", const, SKINNY_TYPES, ("M", "s_b", "s_rm"), 4, 3,
        )  # fmt: skip
    mlp_types = dict(x="*bf16", wg="*bf16", wu="*bf16", wd="*bf16", ws="*fp32", nw="*bf16", res="*bf16", eps="fp32")
    # the 8B decode's MLP (H 4096, I 14336) at the default tiles: with the residual + RMSNorm prologue and
    # every dim a multiple of its tile; plain, with every tail mask
    for even, pdl, norm, tma in ((True, True, True, False), (False, False, False, False), (True, True, True, True)):
        types = dict(mlp_types)
        if tma:
            types.update(g_desc="tensordesc<bf16[64,128]>", u_desc="tensordesc<bf16[64,128]>",
                         d_desc="tensordesc<bf16[128,64]>")  # fmt: skip
        const = dict(NORM=norm, HAS_RESIDUAL=norm, TMA=tma, EVEN_H=even, EVEN_I=even, EVEN_OUT=even, PREC="tf32",
                     USE_PDL=pdl, BLOCK_M=16, CHUNK=64, BLOCK_K=128, BLOCK_H=128, STAGES=3)  # fmt: skip
        name = f"mlp-chunk-{'even' if even else 'tails'}{'-tma' if tma else ''}"
        cases[name] = ("fused_mlp", "_mlp_chunk_kernel", const, types, ("M", "s_nw", "s_rm"), 4, 3)
    cases["mlp-reduce"] = (
        "fused_mlp", "_mlp_reduce_kernel", dict(USE_PDL=True, BLOCK=128, CHUNKS=16),
        dict(ws="*fp32", out="*bf16"), ("M", "chunks"), 4, 3,
    )  # fmt: skip
    import triton.language as tl

    topk_types = dict(logits_ptr="*bf16", cand_value_ptr="*fp32", cand_index_ptr="*i32", slice_max_ptr="*fp32",
                      slice_sum_ptr="*fp32", logp_ptr="*fp32", index_ptr="*i64", counters="*i32",
                      offset_ptr="*i64")  # fmt: skip
    for fused in (False, True):  # the shipped SmolLM2 head's top-k: 8k vocabulary, 256-entry slices, k = 8
        const = dict(K=8, BLOCK=256, WORK_DTYPE=tl.float32, FUSED_MERGE=fused, HAS_OFFSET=True, BLOCK_C=256,
                     BLOCK_NB=32)  # fmt: skip
        cases[f"topk-slice-{'fused' if fused else 'plain'}"] = (
            "draft_topk", "_draft_topk_slice_kernel", const, topk_types, ("vocab", "num_blocks"), 1, 3,
        )  # fmt: skip
    for scores in ("*fp32", "*fp64"):  # the draft round's tree selection (one program a request)
        sel_types = dict(scores_ptr=scores, tokens_ptr="*i64", parents_ptr="*i64", root_ptr="*i64",
                         out_tokens_ptr="*i64", out_parents_ptr="*i64", out_depth_ptr="*i64", out_mask_ptr="*i64",
                         out_cand_ptr="*i64")  # fmt: skip
        cases[f"select-tree-{scores[1:]}"] = (
            "select_tree", "_select_tree_kernel", dict(BLOCK_C=64, BLOCK_M=64), sel_types,
            ("num_candidates", "num_kept", "topk", "steps"), 8, 3,
        )  # fmt: skip
    for root in (True, False):  # one draft step's record and next lanes (the shipped K = 4: 16 children)
        exp_types = dict(logp_ptr="*bf16" if root else "*fp32", tokens_ptr="*i64", own_ptr="*i64", first_ptr="*i64",
                         lscore_ptr="*fp32", lmask_ptr="*i64", lcand_ptr="*i64", scores_ptr="*fp32",
                         parents_ptr="*i64", ntok_ptr="*i64", nscore_ptr="*fp32", nmask_ptr="*i64", ncand_ptr="*i64",
                         nlane_ptr="*i64")  # fmt: skip
        scalars = tuple(n for n in inspect.signature(_expand_kernel_fn()).parameters if n.startswith("s_"))
        cases[f"expand-lanes-{'root' if root else 'lanes'}"] = (
            "expand_lanes", "_expand_lanes_kernel", dict(ROOT=root, BLOCK=16, BLOCK_K=4), exp_types,
            ("R", "K", *scalars), 1, 3,
        )  # fmt: skip
    return cases


def _expand_kernel_fn():
    from treecompile.ops.expand_lanes import _expand_lanes_kernel

    return _expand_lanes_kernel.fn


def _hints_before_wait(ptx: str) -> bool:
    """Whether the first L2 hint comes before the first dependency wait (``griddepcontrol.wait``) in the PTX."""
    hint, wait = ptx.find("prefetch.global.L2"), ptx.find("griddepcontrol.wait")
    return hint >= 0 and (wait < 0 or hint < wait)


def compile_case(module, kernel_name, const, types, unaligned, warps, stages):
    """One case of :func:`_cases` compiled for sm_90 (Triton's compiled kernel, its ``asm`` dict). Pointers
    carry the 16-divisibility marks a real launch gets, except the ``unaligned`` arguments (also used by
    ``tests/gpu/ptxas_regs.py``)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(f"treecompile.ops.{module}"), kernel_name)
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig[n] not in ("constexpr", "fp32") and not sig[n].startswith("tensordesc") and n not in unaligned
    }
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs=attrs)  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def _compile_all() -> dict:
    """Run without TRITON_INTERPRET: every case compiled for sm_90; name -> report (or the error)."""
    report = {}
    for name, case in _cases().items():
        try:
            compiled = compile_case(*case)
            ttgir = compiled.asm["ttgir"]
            report[name] = dict(
                cubin_bytes=len(compiled.asm["cubin"]), async_copies=len(ASYNC_COPY.findall(ttgir)),
                tma_copies=ttgir.count("async_tma_copy_global_to_local"), atomics=ttgir.count("tt.atomic_rmw"),
                l2_hints=compiled.asm["ptx"].count("prefetch.global.L2"),
                hints_before_wait=_hints_before_wait(compiled.asm["ptx"]), cg_loads=compiled.asm["ptx"].count("ld.global.cg"),
                shared_bytes=int(getattr(compiled.metadata, "shared", 0) or 0),
                pdl_waits=compiled.asm["ptx"].count("griddepcontrol.wait"),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
            report[name] = dict(error=f"{type(exc).__name__}: {exc}"[:2000])
    return report


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entry(report, name):
    entry = report[name]
    assert "error" not in entry, entry.get("error")
    assert entry["cubin_bytes"] > 0
    return entry


@pytest.mark.parametrize("tma", ["pointers", "tma"])
@pytest.mark.parametrize("mode", ["plain", "write+pdl"])
def test_cascade_stage1_compiles_and_pipelines_the_prefix_loop(report, tma, mode):
    """The 8B verify's stage-1 config: the prefix tiles' loads are async copies (cp.async or TMA), so tile i+1
    streams in while tile i is in the tensor cores."""
    entry = _entry(report, f"stage1-{tma}-{mode}")
    assert entry["async_copies"] >= 2, "the prefix loop's K/V loads are not async copies"
    assert (entry["tma_copies"] > 0) == (tma == "tma")


@pytest.mark.parametrize(
    "name", ["stage1-pointers-write+pdl-l2", "stage1-tma-write+pdl-l2", "skinny-mma-split1-l2",
             "skinny-gemv-split1-prefetch-l2"],
)  # fmt: skip
def test_l2_prefetch_hints_come_before_the_dependency_wait(report, name):
    """``l2_prefetch``: the hints are in the PTX and ahead of ``griddepcontrol.wait``; without it, none."""
    entry = _entry(report, name)
    assert entry["l2_hints"] > 0 and entry["hints_before_wait"]
    assert _entry(report, name[: -len("-l2")])["l2_hints"] == 0


def test_draft_topk_fused_merge_compiles_with_its_counter(report):
    """The top-k slice kernel with the fused merge: the counter's atomics and the .cg reloads compile for
    sm_90; the plain slice kernel has no atomic."""
    entry = _entry(report, "topk-slice-fused")
    assert entry["atomics"] >= 2 and entry["cg_loads"] > 0
    assert _entry(report, "topk-slice-plain")["atomics"] == 0


@pytest.mark.parametrize("scores", ["fp32", "fp64"])
def test_select_tree_kernel_compiles(report, scores):
    """The one-kernel tree selection (int64 shifts and register "gathers" as masked sums) compiles for sm_90."""
    _entry(report, f"select-tree-{scores}")


@pytest.mark.parametrize("variant", ["root", "lanes"])
def test_expand_lanes_kernel_compiles(report, variant):
    _entry(report, f"expand-lanes-{variant}")


@pytest.mark.parametrize("rows", [1, 4])
def test_cascade_merge_compiles(report, rows):
    _entry(report, f"merge-rows{rows}")


@pytest.mark.parametrize("k_tail", ["even", "tail", "even-norm"])
def test_skinny_glu_kernel_compiles_pipelined(report, k_tail):
    """The gated GEMM streams x and both weight row ranges through async copies (three loads a K step), with
    the row-scale epilogue too."""
    entry = _entry(report, f"skinny-glu-{k_tail}")
    assert entry["async_copies"] >= 3 and entry["pdl_waits"] == 1, entry


@pytest.mark.parametrize("k_tail", ["even", "tail", "even-norm"])
def test_skinny_qkv_rope_kernel_compiles_pipelined(report, k_tail):
    """The q/k/v + rotary GEMM streams x and both head halves' weight rows through async copies."""
    entry = _entry(report, f"skinny-qkv-rope-{k_tail}")
    assert entry["async_copies"] >= 3 and entry["pdl_waits"] == 1, entry


@pytest.mark.parametrize("split_k,res", [(1, ""), (4, ""), (1, "-res"), (4, "-res"), (1, "-res-normout"),
                                         (4, "-res-normout")])
def test_skinny_mma_kernel_compiles_pipelined_with_split_k(report, split_k, res):
    """The 64-row MMA tiles (8B verify shapes) stream the weight through an async-copy pipeline; with split-K
    the counter's atomics (acq_rel, gpu scope) and the .cg reloads compile for sm_90; the residual epilogue too."""
    entry = _entry(report, f"skinny-mma-split{split_k}{res}")
    assert entry["async_copies"] >= 2, "the K loop's tiles are not async copies"
    assert (entry["atomics"] > 0) == (split_k > 1)


@pytest.mark.parametrize("split_k", [1, 4])
def test_skinny_mma_kernel_streams_its_weight_through_tma(report, split_k):
    """With ``tma`` the 64-row MMA tiles' weight loads are TMA copies, pipelined (several boxes in flight)."""
    entry = _entry(report, f"skinny-mma-split{split_k}-tma")
    assert entry["tma_copies"] >= 1 and entry["async_copies"] >= 2, f"the weight tiles are not TMA copies: {entry}"
    assert (entry["atomics"] > 0) == (split_k > 1)


@pytest.mark.parametrize("case", ["split1-prefetch", "split4-prefetch", "split4-wait", "split1-pipelined",
                                  "split4-pipelined"])  # fmt: skip
def test_skinny_gemv_kernel_compiles_with_split_k(report, case):
    entry = _entry(report, f"skinny-gemv-{case}")
    assert (entry["atomics"] > 0) == case.startswith("split4")


def test_pipelined_gemv_streams_through_async_copies(report):
    """The gemv kernel's PIPELINE loop is software-pipelined: its x and weight tile loads become async copies
    (two stages in flight at num_stages=3), where the register double buffer compiles to none (Triton 3.9's
    sm_90 compile: the 8B o / qkv gemv stream at 2.9-3.2 TB/s on the H200 may be this)."""
    assert _entry(report, "skinny-gemv-split1-pipelined")["async_copies"] >= 2
    assert _entry(report, "skinny-gemv-split1-prefetch")["async_copies"] == 0


@pytest.mark.parametrize("tails", ["even", "tails"])
def test_fused_mlp_chunk_kernel_compiles_with_both_loops_pipelined(report, tails):
    """The fused MLP's chunk kernel at the 8B decode's default tiles ("even": with the residual + RMSNorm
    prologue): the gate/up loop's tile loads (x, gate, up; the residual and norm weight with the prologue) and
    the down loop's tile load are async copies, so each weight streams while the previous tile is in the
    tensor cores; its shared memory fits a Hopper SM (227 KB) with room for a second program."""
    entry = _entry(report, f"mlp-chunk-{tails}")
    assert entry["async_copies"] >= 4, f"a loop's weight loads are not async copies: {entry}"
    assert 0 < entry["shared_bytes"] <= 113 * 1024, entry["shared_bytes"]
    assert entry["pdl_waits"] == (1 if tails == "even" else 0)


def test_fused_mlp_chunk_kernel_streams_its_weights_through_tma(report):
    """With TMA boxes (the 8B decode's default tiles, norm prologue on) the gate, up and down tiles are TMA
    copies into shared memory, pipelined in both loops."""
    entry = _entry(report, "mlp-chunk-even-tma")
    assert entry["tma_copies"] >= 3, f"not every weight tile is a TMA copy: {entry}"
    assert 0 < entry["shared_bytes"] <= 113 * 1024, entry["shared_bytes"]


def test_fused_mlp_reduce_kernel_compiles(report):
    assert _entry(report, "mlp-reduce")["pdl_waits"] == 1


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
