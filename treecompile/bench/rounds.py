"""Round benchmark (GPU): the pieces of one speculative round of an 8B-shaped Llama against HF's own captured
forward and the weight-read floors, side by side in one run.

    python -m treecompile.bench rounds [--ctx 2048] [--nodes 64,32,16] [--reps 20] [--json PATH] [--smoke]

Setup: a random Llama shaped like Llama-3-8B (hidden 4096, 32 layers, 32 heads / 8 KV heads, head_dim 128,
intermediate 14336, vocab 128256) in bf16, built on the meta device and initialised in place on the GPU;
batch 1; a prompt of ``ctx`` random tokens prefilled. The draft head is EAGLE-3-sized:
``EagleDrafter.for_target(model, draft_vocab_size=32000)`` (one decoder layer, fc over three target states).

What is timed (each a CUDA graph of eager kernels, ``inductor=False``: Inductor compiles take minutes on the
slow host, and inside a graph eager kernels pay no launch overhead):

- **verify N** (N = 64, 32, 16): treecompile's ``_verify_round`` after a K=4, S=5 draft round drafted the
  tree: the target forward over the N nodes, the greedy walk, KV and hidden-row compaction. Replays run over
  the same committed state (a round is idempotent until commit).
- **decode**: the same verify graph for a one-node tree (``topk=1, num_nodes=1``): treecompile's plain
  1-token decode step.
- **HF forward** for T = 1 and 64 tokens, captured by hand (``torch.cuda.graph`` around ``model(...)``; the
  ``reduce-overhead`` route fails with a static cache, ENV.md), two ways: ``StaticCache``: HF's static cache
  holding the prefilled prompt (keys ctx .. ctx+T written; SDPA reads all ctx + 256 slots under a mask: the
  fair comparison); ``no cache``: a ``[1, T]`` input and ``use_cache=False`` (attention over the T tokens
  only, cheaper than a real decode step).
- **draft round** (K=4, S=5): step 0 over the pending rows, S-1 lane steps of K rows, tree selection.
- ``c = T_draft / T_verify(N=64)``.

Timing: median of ``--reps`` replays, CUDA events around the replay only, L2 cleaned (a 256 MiB read) before
each. Floors come from the same run: the copy bandwidth (a 1 GiB device-to-device copy, bytes read + written
over time); the target floor = the weight bytes one forward reads (every parameter but the input embedding
table, of which a forward gathers T rows) / bandwidth; the draft floor = (fc once + S x (midlayer, norm, LM
head)) bytes / bandwidth (step 0 fuses the target states through fc; each step reads the rest once for all
K lanes; the token embedding is the target's, gathered).

Targets (issue 4): verify(64) <= 1.15x decode; decode <= 1.25x the target floor; draft round <= 1.3x its
floor. A variant that fails prints ``fail: <reason>`` and the run goes on; progress lines are flushed so a
timeout still leaves partial output.

``--smoke`` runs a tiny random Llama on whatever device exists, or on ``--device`` (CPU: float32, no graphs, the
functions are called eagerly and timed with ``time.perf_counter``) through the same code, so CI tests the harness.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import time
import traceback
from typing import Callable

import torch

from treecompile.bench import failure_reason

logger = logging.getLogger(__name__)

TARGET_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
)  # fmt: skip
# head_dim 64: the smallest with a CUDA tree-attention kernel (16 had every CUDA smoke variant refused).
TARGET_SMOKE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
)  # fmt: skip
PREFILL_CHUNK = 64  # every speculator prefills through the T=64 graph, traced once (the verify(64) graph)
INIT_STD = 0.02


@dataclasses.dataclass
class Setup:
    """One benchmark configuration (``--smoke`` shrinks every size, keeps the code path)."""

    device: torch.device
    dtype: torch.dtype
    target: dict
    ctx: int = 2048
    nodes: tuple[int, ...] = (64, 32, 16)
    topk: int = 4
    steps: int = 5
    draft_vocab: int = 32000
    hf_tokens: tuple[int, ...] = (1, 64)  # empty: no HF rows (an A/B of treecompile switches needs none)
    reps: int = 20
    copy_bytes: int = 1 << 30
    smoke: bool = False
    inductor: bool = False  # compile the rewritten target with Inductor (fused norms / rope / MLP glue)
    profile_dir: str | None = None  # write a kernel-time table per treecompile variant here
    fuse_projections: bool | None = None  # q/k/v and gate/up as one linear each (None: TreeSpeculator default)
    skinny_linears: bool | None = None  # treespec::skinny_linear for few-row GEMMs; None: the speculator's default

    @property
    def graphs(self) -> bool:
        return self.device.type == "cuda"


def _say(message: str) -> None:
    """Progress for the person watching a long GPU run (flushed: a timeout still leaves the lines)."""
    print(f"[rounds] {message}", flush=True)


def attempt(rows, what: Callable[[], None], clock, untimed: Callable, say: Callable) -> bool:
    """Run one variant's ``what`` (no grad) for a benchmark that goes on past failures: on an exception,
    every row of ``rows`` still ``untimed(row)`` gets the note ``fail: <reason>`` and ``say(row, message)``
    reports it; the clock recovers the device (a failed capture leaves a stream in capture mode)."""
    t0 = time.time()
    try:
        with torch.no_grad():
            what()
        return True
    except Exception as exc:  # noqa: BLE001 - report the variant and go on
        reason = failure_reason(exc)
        logger.debug("%s", traceback.format_exc())
        for row in rows:
            if untimed(row):
                row.note = f"fail: {reason}"
                say(row, f"fail: {reason} ({time.time() - t0:.1f} s)")
        clock.recover()
        return False


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------


class Clock:
    """Captures a function and times its replays.

    CUDA: ``capture`` warms ``fn`` up twice on a side stream, captures it into a CUDA graph and returns the
    graph's replay; ``time`` cleans L2, runs ``pre`` (state resets the graph must not contain), then records
    events around the replay only. CPU: ``capture`` returns ``fn`` after one warm-up call and ``time`` uses
    ``time.perf_counter`` around each call.
    """

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device = device
        self.reps = reps
        self._flush: list[torch.Tensor] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _flush_l2(self) -> None:
        # Reading (not zeroing) 256 MiB leaves L2 full of clean lines: the timed graph pays no write-backs.
        if self.device.type != "cuda":
            return
        if not self._flush:
            self._flush.extend([torch.ones(64 << 20, device=self.device), torch.empty((), device=self.device)])
        torch.sum(self._flush[0], dim=0, out=self._flush[1])

    def capture(self, fn: Callable[[], object], pre: Callable[[], None] | None = None) -> Callable[[], None]:
        pre = pre or (lambda: None)
        if self.device.type != "cuda":
            pre()
            fn()
            return fn
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                pre()
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        pre()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
        pre()
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay  # the bound method keeps the graph (and its memory pool) alive

    def time(self, run: Callable[[], object], pre: Callable[[], None] | None = None) -> float:
        """Median milliseconds of ``run`` over ``reps`` calls (after 3 untimed ones)."""
        pre = pre or (lambda: None)
        if self.device.type != "cuda":
            times = []
            for i in range(-1, self.reps):
                pre()
                t0 = time.perf_counter()
                run()
                if i >= 0:
                    times.append((time.perf_counter() - t0) * 1e3)
            return float(sorted(times)[len(times) // 2])
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(-3, self.reps):
            self._flush_l2()
            pre()
            if i >= 0:
                starts[i].record()
            run()
            if i >= 0:
                ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return float(times[len(times) // 2])

    def recover(self) -> None:
        """After a failed variant: drain the device so the next one starts clean (best effort)."""
        try:
            self._sync()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: the next variants will report it
            logger.warning("device did not recover: %s", failure_reason(exc))


def measure_copy_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``, median of ``reps``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    clock = Clock(device, reps)
    ms = clock.time(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------------------
# Models and weight bytes
# ---------------------------------------------------------------------------------------------------------


def build_target(config_kwargs: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random Llama built on the meta device and initialised in place on ``device`` (an 8B model in seconds:
    no host-side init, no host-to-device copy). Norm weights 1, every other weight N(0, INIT_STD^2); RoPE
    tables rebuilt (``to_empty`` leaves buffers uninitialised) in float32, as ``from_pretrained`` keeps them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_kwargs)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if hasattr(child, "inv_freq") and hasattr(child, "config"):
                    with torch.device(device):
                        setattr(parent, child_name, type(child)(child.config))
    model.requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model.eval()


def _param_bytes(params) -> int:
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def target_read_bytes(model) -> int:
    """Weight bytes one forward reads: all parameters, minus the input embedding table unless the LM head
    shares it (a forward gathers only T rows of it)."""
    total = _param_bytes(model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def draft_read_bytes(drafter, steps: int) -> tuple[int, int]:
    """``(head bytes, floor bytes)`` of the draft head: its own parameters (the token embedding is the
    target's and only gathered), and what S steps must read: fc once (step 0) + S x the rest."""
    fc = _param_bytes(drafter.fc.parameters())
    rest = _param_bytes(p for name, p in drafter.named_parameters() if not name.startswith("fc."))
    return fc + rest, fc + steps * rest


# ---------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One timed variant. ``kind``: "target" (a forward of the target: floor = target floor) or "draft"."""

    key: str
    label: str
    kind: str
    tokens: str
    ms: float | None = None
    note: str = ""


class RoundsBench:
    """Holds the model, the drafter and the clock; each ``measure_*`` appends rows and never raises."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.clock = Clock(setup.device, setup.reps)
        self.rows: dict[str, Row] = {}
        self._shared = None  # (binding, runner) every speculator reuses: one traced graph per shape
        self.model = None
        self.drafter = None
        gen = torch.Generator().manual_seed(1)
        self.prompt = torch.randint(0, setup.target["vocab_size"], (setup.ctx,), generator=gen).tolist()
        # prompt + one verify window + the lane window, with room to spare
        self.max_seq_len = setup.ctx + 2 * max(max(setup.nodes), PREFILL_CHUNK)

    def _row(self, key: str, label: str, kind: str, tokens: str) -> Row:
        row = self.rows[key] = Row(key, label, kind, tokens)
        return row

    def _attempt(self, rows: list[Row], what: Callable[[], None]) -> bool:
        return attempt(rows, what, self.clock, untimed=lambda row: row.ms is None, say=lambda row, msg: _say(
            f"{row.label}: {msg}"))

    def _timed(
        self, row: Row, run: Callable[[], None], pre: Callable[[], None] | None = None,
        eager: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        row.ms = self.clock.time(run, pre)
        _say(f"{row.label}: {row.ms:.3f} ms")
        if self.setup.profile_dir:
            self._profile(row, run, row.key, pre)
            if eager is not None and self.setup.graphs:  # kernels by name even where graph nodes are not traced
                self._profile(row, eager, row.key + "_eager", pre)

    def _profile(self, row: Row, run: Callable[[], None], name: str, pre=None, replays: int = 5) -> None:
        """Kernel time per kernel name over ``replays`` runs of ``run`` (torch.profiler, CUDA activity),
        written to ``<profile_dir>/<name>.txt`` (and, on CUDA, the Chrome trace to ``<name>.trace.json``): where
        a round's time goes. Best effort."""
        import os

        from torch.profiler import ProfilerActivity, profile

        try:
            os.makedirs(self.setup.profile_dir, exist_ok=True)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.setup.graphs else [])
            with profile(activities=activities) as prof:
                for _ in range(replays):
                    if pre is not None:
                        pre()
                    run()
                self.clock._sync()
            sort = "self_cuda_time_total" if self.setup.graphs else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
            path = os.path.join(self.setup.profile_dir, f"{name}.txt")
            with open(path, "w") as f:
                f.write(f"{row.label}: {row.ms:.3f} ms per run (timed); profile of {replays} runs\n\n{table}\n")
            if self.setup.graphs:  # the kernels in time order: the gaps between them are a round's idle time
                prof.export_chrome_trace(os.path.join(self.setup.profile_dir, f"{name}.trace.json"))
            _say(f"{row.label}: profile written to {path}")
        except Exception as exc:  # noqa: BLE001 - a profile is a diagnostic, never a reason to fail the run
            _say(f"{row.label}: profile failed: {failure_reason(exc)}")

    # -- setup ----------------------------------------------------------------------------------------------

    def build(self) -> None:
        from treecompile.drafter import EagleDrafter

        s = self.setup
        t0 = time.time()
        self.model = build_target(s.target, s.device, s.dtype)
        _say(f"target built in {time.time() - t0:.1f} s: {target_read_bytes(self.model) / 1e9:.3f} GB read per forward")
        t0 = time.time()
        self.drafter = EagleDrafter.for_target(self.model, seed=0, draft_vocab_size=s.draft_vocab)
        self.drafter.requires_grad_(False).eval()
        head, _ = draft_read_bytes(self.drafter, s.steps)
        _say(f"draft head built in {time.time() - t0:.1f} s: {head / 1e9:.3f} GB of weights")

    def _speculator(self, topk: int, steps: int, num_nodes: int):
        """A TreeSpeculator prefilled with the prompt and warmed up by one eager round (Dynamo trace of the
        T=N graph, Triton JIT), over the shared binding: the KV cache and the traced graphs are the same
        for every variant (the prompt is), so the 32-layer trace of each shape happens once."""
        from treecompile.speculator import TreeSpeculator

        s = self.setup
        spec = TreeSpeculator(
            self.model, self.drafter, topk=topk, steps=steps, num_nodes=num_nodes, max_batch_size=1,
            max_seq_len=self.max_seq_len, prefill_chunk=PREFILL_CHUNK, inductor=s.inductor, cuda_graphs=False,
            fuse_projections=s.fuse_projections, skinny_linears=s.skinny_linears,
        )  # fmt: skip
        if self._shared is None:
            self._shared = (spec.binding, spec.runner)
        else:
            spec.binding, spec.runner = self._shared
        st = spec._new_state(1, [s.ctx], [self.prompt], [], 1)
        t0 = time.time()
        spec._prefill(st, s.ctx)
        spec._draft_fn(st)
        spec._verify_round(st)
        self.clock._sync()
        _say(f"speculator topk={topk} steps={spec.steps} N={spec.num_nodes}: prefill {s.ctx} + warm-up round "
             f"{time.time() - t0:.1f} s")  # fmt: skip
        return spec, st

    # -- variants -------------------------------------------------------------------------------------------

    def measure_tree(self, num_nodes: int, with_draft: bool) -> None:
        s = self.setup
        verify = self._row(f"verify_{num_nodes}", f"treecompile verify N={num_nodes} (K={s.topk}, S={s.steps})",
                           "target", str(num_nodes))  # fmt: skip
        rows = [verify]
        if with_draft:
            draft = self._row("draft", f"treecompile draft round K={s.topk}, S={s.steps} (Vd={s.draft_vocab})",
                              "draft", f"{s.steps} steps")  # fmt: skip
            rows.append(draft)
        state = {}

        def setup():
            state["spec"], state["st"] = self._speculator(s.topk, s.steps, num_nodes)

        if not self._attempt(rows, setup):
            return
        spec, st = state["spec"], state["st"]
        run_verify, run_draft = (lambda: spec._verify_round(st)), (lambda: spec._draft_fn(st))
        self._attempt([verify], lambda: self._timed(verify, self.clock.capture(run_verify), eager=run_verify))
        if with_draft:
            self._attempt([draft], lambda: self._timed(draft, self.clock.capture(run_draft), eager=run_draft))

    def measure_decode(self) -> None:
        row = self._row("decode", "treecompile decode (1-node tree)", "target", "1")
        state = {}

        def setup():
            state["spec"], state["st"] = self._speculator(1, 1, 1)

        if self._attempt([row], setup):
            spec, st = state["spec"], state["st"]
            run = lambda: spec._verify_round(st)  # noqa: E731
            self._attempt([row], lambda: self._timed(row, self.clock.capture(run), eager=run))

    def measure_hf_static(self) -> None:
        """HF forward over a StaticCache holding the prompt. Every call writes keys ctx .. ctx+T: the cache's
        write counter (a tensor in transformers 5.24, bumped inside the call) is reset before each call,
        outside the graph."""
        from transformers import StaticCache

        s, model = self.setup, self.model
        label = f"HF forward, StaticCache ctx {s.ctx}"
        rows = [self._row(f"hf_static_{t}", label, "target", str(t)) for t in s.hf_tokens]
        state = {}

        def setup():
            cache = StaticCache(config=model.config, max_cache_len=s.ctx + 4 * max(s.hf_tokens))
            ids = torch.tensor([self.prompt], device=s.device)
            pos = torch.arange(s.ctx, device=s.device)[None]
            for start in range(0, s.ctx, 512):  # chunks bound the prefill's activations
                chunk = pos[:, start : start + 512]
                model(input_ids=ids[:, start : start + 512], position_ids=chunk, use_cache=True, logits_to_keep=1,
                      **self._cache_kwargs(cache, chunk[0]))  # fmt: skip
            state["cache"] = cache

        if not self._attempt(rows, setup):
            return
        cache = state["cache"]

        def reset():
            for layer in getattr(cache, "layers", ()):
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):
                    length.fill_(s.ctx)
                elif isinstance(length, int):
                    layer.cumulative_length = s.ctx

        for t, row in zip(s.hf_tokens, rows):
            ids = torch.randint(0, s.target["vocab_size"], (1, t), device=s.device)
            pos = torch.arange(s.ctx, s.ctx + t, device=s.device)[None]
            kwargs = self._cache_kwargs(cache, pos[0])

            def step(ids=ids, pos=pos, kwargs=kwargs):
                model(input_ids=ids, position_ids=pos, use_cache=True, **kwargs)

            self._attempt([row], lambda step=step, row=row: self._timed(row, self.clock.capture(step, reset), reset))

    def measure_hf_nocache(self) -> None:
        """HF forward of a static ``[1, T]`` input without a cache: attention over the T tokens only."""
        s, model = self.setup, self.model
        for t in s.hf_tokens:
            row = self._row(f"hf_nocache_{t}", "HF forward, no cache", "target", str(t))
            ids = torch.randint(0, s.target["vocab_size"], (1, t), device=s.device)

            def step(ids=ids):
                model(input_ids=ids, use_cache=False)

            self._attempt([row], lambda step=step, row=row: self._timed(row, self.clock.capture(step)))

    def _cache_kwargs(self, cache, positions: torch.Tensor) -> dict:
        """The cache keyword of this transformers (5.24: ``cache``; earlier 5.x: ``past_key_values``), plus
        ``cache_position`` where the model still takes one (else it derives it from the cache with a host
        read, which a capture cannot contain)."""
        params = inspect.signature(self.model.forward).parameters
        kwargs = {"cache" if "cache" in params else "past_key_values": cache}
        if "cache_position" in params or "cache_position" in inspect.signature(self.model.model.forward).parameters:
            kwargs["cache_position"] = positions
        return kwargs

    # -- the run --------------------------------------------------------------------------------------------

    def run(self) -> dict:
        s = self.setup
        t_start = time.time()
        bandwidth = measure_copy_bandwidth(s.device, s.copy_bytes)
        _say(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + written, {s.copy_bytes >> 20} MiB copy)")
        self.build()
        nodes = sorted(set(s.nodes), reverse=True)  # the largest tree first: verify(64) and the draft round
        variants = [lambda: self.measure_tree(nodes[0], with_draft=True), self.measure_decode]
        if s.hf_tokens:
            variants += [self.measure_hf_static, self.measure_hf_nocache]
        variants += [lambda n=n: self.measure_tree(n, with_draft=False) for n in nodes[1:]]
        for measure in variants:
            measure()
            self.clock.recover()  # the variant's graphs and caches are gone: hand their memory back
        target_bytes = target_read_bytes(self.model)
        head_bytes, draft_bytes = draft_read_bytes(self.drafter, s.steps)
        floors = {
            "target_ms": target_bytes / bandwidth * 1e3,
            "draft_ms": draft_bytes / bandwidth * 1e3,
        }
        result = {
            "device": torch.cuda.get_device_name() if s.device.type == "cuda" else str(s.device),
            "torch": torch.__version__,
            "transformers": _transformers_version(),
            "setup": {
                "smoke": s.smoke, "dtype": str(s.dtype), "ctx": s.ctx, "batch": 1, "topk": s.topk,
                "steps": s.steps, "nodes": nodes, "draft_vocab": s.draft_vocab, "reps": s.reps,
                "cuda_graphs": s.graphs, "target": s.target,
            },  # fmt: skip
            "copy_bytes_per_s": bandwidth,
            "target_read_bytes": target_bytes,
            "head_bytes": head_bytes,
            "draft_read_bytes": draft_bytes,
            "floors": floors,
            "rows": [dataclasses.asdict(r) for r in self.rows.values()],
            "wall_s": time.time() - t_start,
        }
        ms = {r.key: r.ms for r in self.rows.values()}
        verify_key = f"verify_{nodes[0]}"
        result["c"] = _ratio(ms.get("draft"), ms.get(verify_key))
        both = (ms.get("draft"), ms.get(verify_key))
        result["round_ms"] = None if None in both else sum(both)
        result["c_floor"] = _ratio(floors["draft_ms"], floors["target_ms"])
        result["targets"] = check_targets(ms, floors, verify_key)
        return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def check_targets(ms: dict, floors: dict, verify_key: str = "verify_64") -> list[dict]:
    """Issue 4's targets: ``{"name", "limit", "ratio", "met"}`` each (ratio/met None where a time is missing)."""
    checks = [
        (f"{verify_key.replace('_', '(')}) <= 1.15x decode(1)", 1.15, ms.get(verify_key), ms.get("decode")),
        ("decode(1) <= 1.25x target weight-read floor", 1.25, ms.get("decode"), floors["target_ms"]),
        ("draft round <= 1.3x its weight-read floor", 1.3, ms.get("draft"), floors["draft_ms"]),
    ]
    out = []
    for name, limit, a, b in checks:
        ratio = _ratio(a, b)
        out.append({"name": name, "limit": limit, "ratio": ratio, "met": None if ratio is None else ratio <= limit})
    return out


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------

HEADER = (
    "| variant | tokens | ms | floor ms | / floor | / decode(1) | note |\n"
    "|---|---:|---:|---:|---:|---:|---|"
)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_report(result: dict) -> str:
    floors = result["floors"]
    rows = result["rows"]
    decode = next((r["ms"] for r in rows if r["key"] == "decode"), None)
    order = sorted(rows, key=_row_order)
    lines = [HEADER]
    for r in order:
        floor = floors["target_ms"] if r["kind"] == "target" else floors["draft_ms"]
        vs_decode = _ratio(r["ms"], decode) if r["kind"] == "target" else None
        cell = "fail" if r["ms"] is None else _ms(r["ms"])
        lines.append(
            f"| {r['label']} | {r['tokens']} | {cell} | {_ms(floor)} | {_x(_ratio(r['ms'], floor))} "
            f"| {_x(vs_decode)} | {r['note']} |"
        )
    bw = result["copy_bytes_per_s"]
    lines += [
        "",
        f"copy bandwidth {bw / 1e12:.3f} TB/s (bytes read + written); target weights read per forward "
        f"{result['target_read_bytes'] / 1e9:.3f} GB -> floor {floors['target_ms']:.3f} ms; draft head "
        f"{result['head_bytes'] / 1e9:.3f} GB, S={result['setup']['steps']} steps read "
        f"{result['draft_read_bytes'] / 1e9:.3f} GB -> floor {floors['draft_ms']:.3f} ms",
        f"c = T_draft / T_verify(N={result['setup']['nodes'][0]}) = {_x(result['c'])} "
        f"(floors alone: {_x(result['c_floor'])}); one round (draft + verify) = {_ms(result.get('round_ms'))} ms",
        "",
        "targets:",
    ]
    for t in result["targets"]:
        verdict = "n/a (a variant failed)" if t["met"] is None else ("met" if t["met"] else "NOT met")
        lines.append(f"- {t['name']}: {_x(t['ratio'])}x -> {verdict}")
    return "\n".join(lines)


def _row_order(row: dict) -> tuple[int, int]:
    """Verify rows (largest tree first), decode, HF static (by T), HF without cache (by T), the draft round."""
    key = row["key"]
    for rank, prefix in enumerate(("verify_", "decode", "hf_static_", "hf_nocache_", "draft")):
        if key.startswith(prefix):
            number = key[len(prefix):]
            n = int(number) if number.isdigit() else 0
            return rank, -n if prefix == "verify_" else n
    return 5, 0


def _setup_from_args(args) -> Setup:
    from treecompile.speculator import fuse_projections_default, skinny_linears_default

    hf_tokens = () if args.no_hf else (1, 64)
    if args.smoke:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return Setup(
            device=device, dtype=dtype, target=dict(TARGET_SMOKE), ctx=args.ctx or 96,
            nodes=_int_list(args.nodes) if args.nodes else (64,), draft_vocab=128, hf_tokens=hf_tokens,
            reps=args.reps or 3, copy_bytes=8 << 20, smoke=True, inductor=args.inductor, profile_dir=args.profile,
            fuse_projections=fuse_projections_default(args.fuse_projections, device),
        )  # fmt: skip
    return Setup(
        device=torch.device("cuda"), dtype=torch.bfloat16, target=dict(TARGET_8B), ctx=args.ctx or 2048,
        nodes=_int_list(args.nodes) if args.nodes else (64, 32, 16), reps=args.reps or 20, inductor=args.inductor,
        hf_tokens=hf_tokens,
        profile_dir=args.profile, fuse_projections=fuse_projections_default(args.fuse_projections, torch.device("cuda")),
        skinny_linears=skinny_linears_default(args.skinny_linears, torch.device("cuda"), torch.bfloat16),
    )  # fmt: skip


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(",") if x.strip())
    bad = [v for v in values if not 1 <= v <= 64]
    if not values or bad:
        raise ValueError(f"--nodes: expected a comma-separated list of tree sizes in 1..64, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treecompile.bench rounds", description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=None, help="prompt tokens prefilled (default 2048; smoke 96)")
    parser.add_argument("--nodes", default=None, help="verify tree sizes (default 64,32,16; smoke 64)")
    parser.add_argument("--reps", type=int, default=None, help="timed replays per variant (default 20; smoke 3)")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama on any device (CI)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="the smoke run's device (default cuda when available, else cpu); the full run is CUDA's")
    parser.add_argument("--inductor", action="store_true",
                        help="compile the rewritten target with Inductor (minutes per graph shape on a slow host)")
    parser.add_argument("--no-hf", action="store_true",
                        help="leave out HF's own forward rows (A/B runs of treecompile switches: those rows do not "
                             "change between the runs, and each costs captures on a fresh machine)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="also write a kernel-time table (torch.profiler) per variant into DIR")
    parser.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                        help="q/k/v and gate/up as one linear each (default: TreeSpeculator's, on for CUDA, off for CPU)")
    parser.add_argument("--skinny-linears", action=argparse.BooleanOptionalAction, default=None,
                        help="run treecompile's few-row bf16 GEMMs on treespec::skinny_linear (Triton) instead of "
                             "cuBLAS (default: TreeSpeculator's, on for 16-bit CUDA models)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.device is not None and not args.smoke:
        parser.error(f"--device: only with --smoke (the full benchmark runs on CUDA), got --device {args.device}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device: 'cuda' asked for, but no CUDA device is available")
    if not args.smoke and not torch.cuda.is_available():
        print("rounds benchmark needs a CUDA device (or --smoke)")
        return 2
    if args.ctx is not None and args.ctx < 1:
        parser.error(f"--ctx: expected a positive int, got {args.ctx}")
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps: expected a positive int, got {args.reps}")
    try:
        setup = _setup_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    import treecompile  # noqa: F401  registers torch.ops.treespec

    mode = ("CUDA graphs" if setup.graphs else "eager, no graphs") + (" of Inductor code" if setup.inductor else "")
    _say(f"device {setup.device} ({mode}), {setup.dtype}, ctx {setup.ctx}, nodes {list(setup.nodes)}, "
         f"reps {setup.reps}{', smoke' if setup.smoke else ''}")  # fmt: skip
    result = RoundsBench(setup).run()
    print()
    print(
        f"device: {result['device']}; torch {result['torch']}; transformers {result['transformers']}; "
        f"{setup.dtype}; batch 1; ctx {setup.ctx}; {'CUDA graphs' if setup.graphs else 'eager (no CUDA)'}; "
        f"median of {setup.reps}; wall {result['wall_s']:.0f} s\n"
    )
    print(format_report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0
