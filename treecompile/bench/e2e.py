"""End-to-end benchmark: SmolLM2-135M-Instruct with an EAGLE-3 head, HF generation against treecompile's plain
decode, chain and trees, side by side in one run, on the held-out prompts, greedy.

    python -m treecompile.bench e2e --model smollm2 [--batch-sizes 1,4,16] [--max-new-tokens 256] [--prompts 8]
        [--trees "8,4,32;6,4,24;4,4,16"] [--chain-steps 5] [--configs hf_eager,hf_compile,tc_plain,tc_chain,tc_tree]
        [--head DIR] [--skip-hf-compile] [--inductor] [--json PATH] [--plot PATH.png] [--smoke]

Configurations (``--configs`` picks a subset; ``tc_tree`` stands for every ``--trees`` shape):

- ``hf_eager``: HF ``generate(do_sample=False)``, eager, dynamic cache. The reference "plain greedy" output.
- ``hf_compile``: HF ``generate`` with ``cache_implementation="static"`` and HF's automatic ``torch.compile``
  of the decode step in ``mode="default"`` (``reduce-overhead`` fails with a static cache in transformers 5.17,
  ENV.md). The static cache is sized once for the whole run (``max_cache_len``) so no batch recompiles for a
  new cache length. Its compilation (minutes on the GPU host) happens in the warm-up, reported apart;
  ``--skip-hf-compile`` drops it.
- ``tc_plain``: treecompile's own plain decode: a one-node tree through the same runtime, CUDA graphs; its
  rounds draft nothing (``TreeSpeculator`` skips the head for ``num_nodes=1``), so it is the decode a
  speculator has to beat.
- ``tc_chain``: the chain (``topk=1``, ``--chain-steps`` drafted tokens).
- ``tc_tree``: the trees ``(topk, steps, num_nodes)`` of ``--trees``.

Prompts: the held-out set (:func:`treecompile.prompts.heldout_prompts`, disjoint from the training prompts),
taken round-robin over its categories, chat template applied. Batch size b runs ``ceil(P / b) * b`` of them
(P = ``--prompts``) in batches of b, left-padded as HF expects.

Per configuration and batch size: a warm-up call on the first batch (compiles, captures the CUDA graphs; its
time is reported as ``warmup_s`` and excluded), then every batch timed (wall clock, device synchronized),
``--repeats`` passes over all batches (default 1). Reported: tokens/s (generated tokens, each row cut after its
first EOS, / the median pass's summed wall time; every pass under ``wall_s_repeats``), tau (tokens a
round emits, bonus included, over all rounds of all running requests), the accept-length histogram,
speedups against ``tc_plain`` and ``hf_compile`` at the same batch size, and how many sequences equal the
plain greedy reference (``hf_eager`` at the same batch size, else ``tc_plain``).

``--shrink-ab``: every treecompile row runs with batch shrinking off, and at a batch size listed after a
smaller one (a size to shrink onto) it gets a twin row ``<config>+shrink`` timed on the same speculator and
captured graphs with shrinking on; each repeat times the off pass, then the on pass, so the pair differs by
the flag alone (drift between processes or machines does not enter). List ``--batch-sizes`` smallest first.

Output: progress lines (flushed), a markdown table, ``--json`` rewritten after every configuration (a run
killed by a time limit leaves what it measured), ``--plot`` a PNG (tokens/s grouped by batch size; accept
length histograms); without matplotlib ``--plot`` says so in one line and the rest runs. A configuration that
fails prints ``fail: <reason>`` and the run goes on. Exit status: 0 unless every configuration failed (1) or
the setup did (2: bad arguments, a missing head or SmolLM2 package); mismatched outputs are reported, not fatal
(bf16 kernels of different row counts may round differently).

``--smoke``: a tiny random Llama (16-token vocabulary) and ``EagleDrafter.for_target`` (CPU: float32, no
graphs, one thread), 2 random prompts, 8 new tokens, batch sizes 1,2, small trees (2,3,6) and (4,3,12), the
same code path: CI's test of the harness.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from treecompile.bench import failure_reason
from treecompile.demo import (
    DTYPES,
    PAGE_SIZE,
    PREFILL_CHUNK,
    eos_token_ids,
    hf_greedy,
    pad_token_id,
    running_accept_lengths,
    speculator_seq_len,
    sync,
    trim_at_eos,
)

logger = logging.getLogger(__name__)

CONFIG_KEYS = ("hf_eager", "hf_compile", "tc_plain", "tc_chain", "tc_tree")
# The batch-1 shapes that pay with the shipped head on the H200 (thirty-sixth session, 56 held-out prompts, bf16,
# BENCHMARKS.md): (8, 4, 32) 2.13-2.14x treecompile plain, (6, 4, 24) 2.08x, (4, 4, 16) 2.06x; wider trees
# ((8, 5, 40) 1.88x, (12, 4, 48) 1.95x) gain tau but lose more in the round.
DEFAULT_TREES = ((8, 4, 32), (6, 4, 24), (4, 4, 16))
SMOKE_TREES = ((2, 3, 6), (4, 3, 12))
DEFAULT_CHAIN_STEPS = 5
REFERENCES = ("hf_eager", "tc_plain")  # the plain greedy output, in order of preference
SHRINK_SUFFIX = "+shrink"  # --shrink-ab: the twin row of a treecompile configuration with shrinking on
WARMUP_TOKENS = 16  # enough rounds to capture the graphs (and, for HF compile, to reach the dynamic recompile)
SMOKE_PROMPT_LENGTHS = (7, 12)
# A 16-token vocabulary: a random head then guesses a random target's next token often enough (1 in 16 per
# candidate) that smoke rounds accept drafts, so tau and the histograms are exercised beyond 1.
SMOKE_VOCAB = 16


def _say(message: str) -> None:
    """Progress for the person watching a long GPU run (flushed: a timeout still leaves the lines)."""
    print(f"[e2e] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One generation method. ``shape``: (topk, steps, num_nodes) for treecompile configs."""

    key: str
    name: str
    label: str
    shape: tuple[int, int, int] | None = None

    @property
    def treecompile(self) -> bool:
        return self.key.startswith("tc_")


def build_configs(keys, trees, chain_steps: int) -> list[Config]:
    """The configurations to run, in run order: the references first (later rows compare with them), HF
    compile last of its batch size (its compilation is the longest wait)."""
    out = []
    for key in ("hf_eager", "tc_plain", "tc_chain", "tc_tree", "hf_compile"):
        if key not in keys:
            continue
        if key == "hf_eager":
            out.append(Config(key, key, "HF generate, eager"))
        elif key == "hf_compile":
            out.append(Config(key, key, "HF generate, static cache + torch.compile"))
        elif key == "tc_plain":
            out.append(Config(key, key, "treecompile plain decode", (1, 1, 1)))
        elif key == "tc_chain":
            out.append(Config(key, f"chain({chain_steps})", f"treecompile chain, {chain_steps} drafts",
                              (1, chain_steps, chain_steps + 1)))  # fmt: skip
        else:
            for k, s, n in trees:
                out.append(Config(key, f"tree({k},{s},{n})", f"treecompile tree K={k} S={s} N={n}", (k, s, n)))
    return out


def parse_trees(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"K,S,N;K,S,N"`` -> ((K, S, N), ...)."""
    trees = []
    for part in text.split(";"):
        if not part.strip():
            continue
        try:
            values = tuple(int(x) for x in part.split(","))
        except ValueError:
            values = ()
        if len(values) != 3 or min(values) < 1 or values[2] > 64:
            raise ValueError(f"--trees: expected 'topk,steps,num_nodes' triples of positive ints (num_nodes <= 64) "
                             f"separated by ';', got {part.strip()!r}")  # fmt: skip
        trees.append(values)
    if not trees:
        raise ValueError(f"--trees: no tree in {text!r}")
    return tuple(trees)


def parse_ints(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{name}: expected a comma-separated list of positive ints, got {text!r}")
    return tuple(dict.fromkeys(values))


def parse_configs(text: str) -> tuple[str, ...]:
    keys = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [k for k in keys if k not in CONFIG_KEYS]
    if not keys or bad:
        raise ValueError(f"--configs: unknown {bad or text!r}; choose from {','.join(CONFIG_KEYS)}")
    return keys


# ---------------------------------------------------------------------------------------------------------
# Setup: model, drafter, prompts
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    batch_sizes: tuple[int, ...]
    max_new_tokens: int
    prompts: int
    configs: list[Config]
    smoke: bool = False
    head: str | None = None
    inductor: bool = False
    fuse_projections: bool = False  # q/k/v and gate/up as one linear each (treecompile rows; from the CLI: on for CUDA)
    skinny_linears: bool | None = None  # treespec::skinny_linear for few-row GEMMs; None: the speculator's default
    lookahead: bool = True  # launch each round before reading the last one's stop flags (CUDA graphs)
    shrink_batch: bool | None = None  # TreeSpeculator(shrink_batch=...): None keeps its default
    shrink_ab: bool = False  # treecompile rows with shrinking off, each with a "+shrink" twin (passes alternate)
    repeats: int = 1  # timed passes over the batches per row; tokens/s from the median pass
    dtype: str | None = None  # SmolLM2's dtype: None is bfloat16 on CUDA, float32 on CPU
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))


def heldout_in_order() -> list[str]:
    """The held-out prompts round-robin over their categories, so any prefix mixes chat, code, math, ..."""
    from treecompile.prompts import CATEGORIES, heldout_prompts

    by_category = [heldout_prompts(c) for c in CATEGORIES]
    out = []
    for i in range(max(len(p) for p in by_category)):
        out.extend(p[i] for p in by_category if i < len(p))
    return out


def _load_smollm2(setup: Setup):
    """(model, drafter, prompt token lists, tokenizer, description) for SmolLM2 and its head."""
    from treecompile.demo import shipped_head_path
    from treecompile.drafter import EagleDrafter
    from treecompile.models import load_smollm2
    from treecompile.train import chat_ids

    head = Path(setup.head) if setup.head is not None else shipped_head_path()
    if not (head / "config.json").is_file():
        raise ValueError(f"--head: {str(head)!r} has no config.json (expected an EAGLE-3 head directory)")
    if setup.dtype is not None:
        dtype = DTYPES[setup.dtype]
    else:
        dtype = torch.bfloat16 if setup.device.type == "cuda" else torch.float32
    model, tokenizer = load_smollm2(dtype=dtype, device=setup.device)
    drafter = EagleDrafter.from_pretrained(head, model)
    texts = heldout_in_order()
    need = max(-(-setup.prompts // b) * b for b in setup.batch_sizes)
    if need > len(texts):
        raise ValueError(f"--prompts/--batch-sizes: {need} prompts needed, the held-out set has {len(texts)}")
    prompts = [chat_ids(tokenizer, t) for t in texts[:need]]
    return model, drafter, prompts, tokenizer, {"model": "SmolLM2-135M-Instruct", "head": str(head)}


def _load_smoke(setup: Setup):
    from treecompile.bench.rounds import TARGET_SMOKE, build_target
    from treecompile.drafter import EagleDrafter

    model = build_target(dict(TARGET_SMOKE, vocab_size=SMOKE_VOCAB), setup.device, torch.float32)
    drafter = EagleDrafter.for_target(model, seed=0).to(setup.device, torch.float32).eval()
    need = max(-(-setup.prompts // b) * b for b in setup.batch_sizes)
    gen = torch.Generator().manual_seed(0)
    lengths = [SMOKE_PROMPT_LENGTHS[i % len(SMOKE_PROMPT_LENGTHS)] + i // 2 for i in range(need)]
    prompts = [torch.randint(1, SMOKE_VOCAB, (n,), generator=gen).tolist() for n in lengths]
    return model, drafter, prompts, None, {"model": "smoke (tiny random Llama)", "head": "random (for_target)"}


def left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as HF decoder-only generate wants it: ``input_ids`` and ``attention_mask`` [B, longest],
    padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p, dtype=torch.int64)
        mask[b, width - len(p):] = 1
    return ids.to(device), mask.to(device)


# ---------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    config: str
    label: str
    batch_size: int
    tree: list | None = None  # [topk, steps, num_nodes] of treecompile configurations
    prompts: int = 0
    new_tokens: int = 0
    wall_s: float | None = None  # the median timed pass over every batch
    wall_s_repeats: list | None = None  # every timed pass (``--repeats``)
    tokens_per_s: float | None = None
    warmup_s: float | None = None
    tau: float | None = None
    rounds: int | None = None
    accept_hist: dict | None = None
    # A batch runs until its last request stops: rounds each batch ran (first pass), and the share of
    # (request, round) slots in which a request still ran. 1.0 when every request of a batch needs as many
    # rounds; trees spread that need more than plain decode does (a request's tau varies by prompt).
    batch_rounds: list | None = None
    occupancy: float | None = None
    ms_per_batch_round: float | None = None  # the median pass's wall over the rounds its batches ran
    shrinks: int | None = None  # times the first timed pass moved a batch onto a smaller size (shrink_batch)
    reference: str | None = None
    matches: int | None = None
    outputs_match: bool | None = None
    mismatched_prompts: list | None = None
    speedup_vs_tc_plain: float | None = None
    speedup_vs_hf_compile: float | None = None
    error: str | None = None


class E2EBench:
    """Runs every (batch size, configuration); ``run_one`` never raises."""

    def __init__(self, setup: Setup, json_path: str | None = None) -> None:
        self.setup = setup
        self.json_path = json_path
        self.rows: list[Row] = []
        self.outputs: dict[tuple[str, int], list[list[int]]] = {}  # (config name, batch) -> tokens per prompt
        self._specs: dict[str, object] = {}
        self._shared = None  # (binding, runner) every speculator reuses: one traced graph per (B, T)
        self._compile_config = None
        self.meta: dict = {}
        self.t_start = time.time()

    # -- setup ----------------------------------------------------------------------------------------------

    def load(self) -> None:
        s = self.setup
        t0 = time.time()
        loaded = _load_smoke(s) if s.smoke else _load_smollm2(s)
        self.model, self.drafter, self.prompts, tokenizer, desc = loaded
        self.eos = eos_token_ids(self.model)
        self.pad = pad_token_id(tokenizer, self.eos)
        self.dtype = next(self.model.parameters()).dtype
        longest = max(len(p) for p in self.prompts)
        shapes = [c.shape for c in s.configs if c.shape is not None]
        self.max_seq_len = speculator_seq_len(longest, s.max_new_tokens, max([n for _, _, n in shapes], default=1))
        self.hf_cache_len = longest + s.max_new_tokens
        import transformers

        self.meta = {
            **desc, "device": torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else str(s.device),
            "dtype": str(self.dtype).removeprefix("torch."), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda_graphs": s.device.type == "cuda",
            "inductor": s.inductor, "fuse_projections": s.fuse_projections, "skinny_linears": s.skinny_linears, "lookahead": s.lookahead, "shrink_batch": s.shrink_batch, "shrink_ab": s.shrink_ab, "repeats": s.repeats, "smoke": s.smoke, "batch_sizes": list(s.batch_sizes),
            "max_new_tokens": s.max_new_tokens, "prompts_requested": s.prompts,
            "prompt_tokens": [len(p) for p in self.prompts], "configs": [c.name for c in s.configs],
        }  # fmt: skip
        _say(f"{desc['model']} ({self.meta['dtype']}, {self.meta['device']}), head {desc['head']}: loaded in "
             f"{time.time() - t0:.1f} s; {len(self.prompts)} prompts of {min(self.meta['prompt_tokens'])}.."
             f"{longest} tokens")  # fmt: skip

    def batches(self, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        count = -(-self.setup.prompts // b) * b
        chunks = [self.prompts[i : i + b] for i in range(0, count, b)]
        return [left_pad(c, self.pad, self.setup.device) for c in chunks]

    def _speculator(self, config: Config):
        spec = self._specs.get(config.name)
        if spec is None:
            from treecompile.speculator import TreeSpeculator

            k, s, n = config.shape
            spec = TreeSpeculator(self.model, self.drafter, topk=k, steps=s, num_nodes=n,
                                  max_batch_size=max(self.setup.batch_sizes), max_seq_len=self.max_seq_len,
                                  page_size=PAGE_SIZE, prefill_chunk=PREFILL_CHUNK,
                                  inductor=self.setup.inductor,
                                  fuse_projections=self.setup.fuse_projections,
                                  skinny_linears=self.setup.skinny_linears,
                                  lookahead=self.setup.lookahead, shrink_batch=self.setup.shrink_batch)  # fmt: skip
            if self._shared is None:
                self._shared = (spec.binding, spec.runner)
            else:
                spec.binding, spec.runner = self._shared
            self._specs[config.name] = spec
        return spec

    def _hf_compile_kwargs(self) -> dict:
        from transformers import CompileConfig

        if self._compile_config is None:
            if self.setup.device.type == "cuda":
                self._compile_config = CompileConfig(mode="default")
            else:  # HF compiles only on accelerators unless told; Dynamo alone keeps the smoke run short
                self._compile_config = CompileConfig(backend="eager", mode=None)
                self._compile_config._compile_all_devices = True
        return {"cache_implementation": "static", "compile_config": self._compile_config,
                "max_cache_len": self.hf_cache_len}  # fmt: skip

    def generator(self, config: Config) -> Callable[[torch.Tensor, torch.Tensor, int], tuple]:
        """``gen(input_ids, attention_mask, max_new_tokens) -> (new tokens per row, accept lengths or None)``."""
        if config.key in ("hf_eager", "hf_compile"):
            extra = self._hf_compile_kwargs() if config.key == "hf_compile" else {}

            def gen(ids, mask, n):
                return hf_greedy(self.model, ids, mask, n, self.eos, self.pad, **extra), None

            return gen
        spec = self._speculator(config)

        def gen(ids, mask, n):
            res = spec.generate(ids, attention_mask=mask, max_new_tokens=n, eos_token_id=self.eos or None,
                                pad_token_id=self.pad)  # fmt: skip
            return res.sequences[:, ids.shape[1]:].tolist(), res.accept_lengths

        return gen

    # -- measuring ------------------------------------------------------------------------------------------

    def run_one(self, config: Config, b: int) -> Row:
        row = Row(config=config.name, label=config.label, batch_size=b,
                  tree=list(config.shape) if config.shape else None)  # fmt: skip
        self.rows.append(row)
        twin = None
        if self._shrink_twin(config, b):  # --shrink-ab: the same speculator's passes with shrinking on
            twin = Row(config=f"{config.name}{SHRINK_SUFFIX}", label=f"{config.label}, batch shrinking",
                       batch_size=b, tree=row.tree)  # fmt: skip
            self.rows.append(twin)
        t0 = time.time()
        try:
            with torch.no_grad():
                self._measure(config, b, row, twin)
        except Exception as exc:  # noqa: BLE001 - report the configuration and go on
            row.error = failure_reason(exc)
            if twin is not None:
                twin.error = row.error
            logger.debug("%s", traceback.format_exc())
            _say(f"batch {b} {config.name}: fail: {row.error} ({time.time() - t0:.1f} s)")
            self._recover()
            return row
        for r in (row, twin) if twin is not None else (row,):
            tau = "" if r.tau is None else f", tau {r.tau:.2f}"
            match = "" if r.matches is None else f", {r.matches}/{r.prompts} match {r.reference}"
            shrinks = "" if twin is None else f", {r.shrinks} shrinks"
            _say(f"batch {b} {r.config}: {r.tokens_per_s:.1f} tokens/s ({r.new_tokens} tokens in "
                 f"{r.wall_s:.2f} s{tau}{match}{shrinks}; warm-up {row.warmup_s:.1f} s)")  # fmt: skip
        return row

    def _shrink_twin(self, config: Config, b: int) -> bool:
        """--shrink-ab: a treecompile row at a batch size with a smaller one run before it (so there is a
        size to shrink onto) gets a twin row with shrinking on."""
        s = self.setup
        if not s.shrink_ab or config.shape is None:
            return False
        return any(x < b for x in s.batch_sizes[: s.batch_sizes.index(b)])

    def _measure(self, config: Config, b: int, row: Row, twin: Row | None = None) -> None:
        """Warm up, then ``--repeats`` timed passes over every batch into ``row``; with a ``twin`` each
        repeat times a pass with shrinking off (``row``) and then one with it on (``twin``), on the same
        speculator and graphs, so the two differ by the flag alone."""
        s, device = self.setup, self.setup.device
        batches = self.batches(b)
        t0 = time.time()
        gen = self.generator(config)
        warm = s.max_new_tokens if config.key == "hf_compile" else min(WARMUP_TOKENS, s.max_new_tokens)
        spec = self._specs.get(config.name)  # None for HF generate
        ab = s.shrink_ab and spec is not None
        shrink_before = spec.shrink_batch if spec is not None else None
        targets = (row,) if twin is None else (row, twin)
        passes = {id(r): [] for r in targets}
        try:
            if ab:  # the row itself runs with shrinking off at every batch size
                spec.shrink_batch = False
            gen(*batches[0], warm)
            sync(device)
            row.warmup_s = time.time() - t0
            _say(f"batch {b} {config.name}: warm-up {row.warmup_s:.1f} s")
            for _ in range(s.repeats):  # greedy: every pass emits the same tokens; the first is kept
                for r in targets:
                    if ab:
                        spec.shrink_batch = r is twin
                    passes[id(r)].append(self._timed_pass(gen, batches, spec))
        finally:
            if ab:
                spec.shrink_batch = shrink_before
        for r in targets:
            self._fill(r, passes[id(r)])
        if twin is not None:
            twin.warmup_s = row.warmup_s
        self._derive()

    def _timed_pass(self, gen, batches, spec) -> dict:
        """One timed pass over every batch: outputs (cut at EOS), accept lengths, summed wall, rounds."""
        device = self.setup.device
        shrinks_before = spec.shrinks if spec is not None else 0
        outputs, alens, wall, brounds, slots = [], [], 0.0, [], 0
        for ids, mask in batches:
            sync(device)
            t = time.perf_counter()
            tokens, accept = gen(ids, mask, self.setup.max_new_tokens)
            sync(device)
            wall += time.perf_counter() - t
            outputs.extend(trim_at_eos(list(x), self.eos) for x in tokens)
            if accept is not None:
                alens.append(running_accept_lengths(accept).cpu())
                brounds.append(int(accept.shape[0]))
                slots += accept.numel()  # [rounds, B]
        shrinks = spec.shrinks - shrinks_before if spec is not None else None
        return {"outputs": outputs, "alens": alens, "wall": wall, "brounds": brounds, "slots": slots,
                "shrinks": shrinks}  # fmt: skip

    def _fill(self, row: Row, passes: list[dict]) -> None:
        """A row from its timed passes: tokens/s from the median wall; tokens, tau and rounds from the first."""
        first = passes[0]
        outputs, alens, brounds, slots = first["outputs"], first["alens"], first["brounds"], first["slots"]
        row.shrinks = first["shrinks"]
        walls = [p["wall"] for p in passes]
        row.prompts = len(outputs)
        row.new_tokens = sum(len(x) for x in outputs)
        row.wall_s = statistics.median(walls)
        row.wall_s_repeats = walls
        row.tokens_per_s = row.new_tokens / row.wall_s if row.wall_s > 0 else None
        if alens:
            alen = torch.cat(alens)
            row.rounds = int(alen.numel())
            row.tau = float(alen.float().mean()) if alen.numel() else None
            values, counts = torch.unique(alen, return_counts=True)
            row.accept_hist = {int(v): int(c) for v, c in zip(values, counts)}
            row.batch_rounds = brounds
            row.occupancy = row.rounds / slots if slots else None
            row.ms_per_batch_round = row.wall_s * 1e3 / sum(brounds) if sum(brounds) else None
        self.outputs[(row.config, row.batch_size)] = outputs

    def _recover(self) -> None:
        try:
            sync(self.setup.device)
            if self.setup.device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: the next configurations will report it
            logger.warning("device did not recover: %s", failure_reason(exc))

    def _derive(self) -> None:
        """Speedups and matches of every row from what has been measured so far."""
        tps = {(r.config, r.batch_size): r.tokens_per_s for r in self.rows if r.error is None}
        for r in self.rows:
            if r.error is not None or r.tokens_per_s is None:
                continue
            plain, hfc = tps.get(("tc_plain", r.batch_size)), tps.get(("hf_compile", r.batch_size))
            r.speedup_vs_tc_plain = r.tokens_per_s / plain if plain else None
            r.speedup_vs_hf_compile = r.tokens_per_s / hfc if hfc else None
            ref = next((k for k in REFERENCES if (k, r.batch_size) in self.outputs), None)
            mine = self.outputs.get((r.config, r.batch_size))
            if ref is None or mine is None:
                continue
            want = self.outputs[(ref, r.batch_size)]
            bad = [i for i, (x, y) in enumerate(zip(mine, want)) if x != y]
            r.reference, r.matches = ref, len(mine) - len(bad)
            r.outputs_match, r.mismatched_prompts = not bad, bad

    def result(self, complete: bool) -> dict:
        return {"bench": "e2e", "complete": complete, "wall_s": time.time() - self.t_start, "setup": self.meta,
                "rows": [dataclasses.asdict(r) for r in self.rows]}  # fmt: skip

    def write_json(self, complete: bool) -> None:
        if not self.json_path:
            return
        path = Path(self.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.result(complete), indent=1))
        os.replace(tmp, path)  # a reader (or a kill) never sees half a file

    def run(self) -> dict:
        self.load()
        self.write_json(False)
        for b in self.setup.batch_sizes:
            for config in self.setup.configs:
                self.run_one(config, b)
                self.write_json(False)
        self.write_json(True)
        return self.result(True)


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def _num(value, fmt: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:{fmt}}{suffix}"


def format_table(result: dict) -> str:
    lines = [
        "| batch | config | tokens/s | tau | occupancy | ms a round | vs tc plain | vs HF compile | match | new tokens "
        "| wall s | warm-up s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in sorted(result["rows"], key=lambda r: r["batch_size"]):  # stable: run order within a batch size
        if r["error"] is not None:
            lines.append(f"| {r['batch_size']} | {r['config']} | fail: {r['error']} | | | | | | | | | |")
            continue
        match = "-" if r["matches"] is None else f"{r['matches']}/{r['prompts']}"
        lines.append(
            f"| {r['batch_size']} | {r['config']} | {_num(r['tokens_per_s'])} | {_num(r['tau'], '.2f')} "
            f"| {_num(r.get('occupancy'), '.2f')} | {_num(r.get('ms_per_batch_round'), '.3f')} "
            f"| {_num(r['speedup_vs_tc_plain'], '.2f', 'x')} | {_num(r['speedup_vs_hf_compile'], '.2f', 'x')} "
            f"| {match} | {r['new_tokens']} | {_num(r['wall_s'], '.2f')} | {_num(r['warmup_s'])} |"
        )
    lines += ["", "occupancy: the share of (request, round) slots in which a request still ran (a batch runs until "
              "its last request stops); ms a round: wall over the rounds the batches ran (prefill included)"]
    refs = sorted({r["reference"] for r in result["rows"] if r.get("reference")})
    if refs:
        lines += ["", f"match: sequences equal to the plain greedy output of {' / '.join(refs)} at the same batch size"]
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> bool:
    """tokens/s per configuration grouped by batch size, and accept-length histograms of the drafting
    configurations (all batch sizes pooled). False (with one printed line) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot: matplotlib is not installed, so {path} was not written (pip install matplotlib); "
              f"the rest of the run is unaffected", flush=True)  # fmt: skip
        return False
    rows = [r for r in result["rows"] if r["error"] is None and r["tokens_per_s"]]
    batches = sorted({r["batch_size"] for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    hists: dict[str, dict[int, int]] = {}
    for r in rows:
        if r["accept_hist"] and r["config"] != "tc_plain":
            h = hists.setdefault(r["config"], {})
            for k, v in r["accept_hist"].items():
                h[int(k)] = h.get(int(k), 0) + v
    fig, (ax_tps, ax_hist) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(len(configs), 1)
    for i, name in enumerate(configs):
        tps = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["config"] == name}
        xs = [j + (i - (len(configs) - 1) / 2) * width for j, b in enumerate(batches) if b in tps]
        ax_tps.bar(xs, [tps[b] for b in batches if b in tps], width, label=name)
    ax_tps.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax_tps.set_ylabel("generated tokens / s")
    ax_tps.set_title(f"{result['setup'].get('model', '')}, {result['setup'].get('device', '')}")
    ax_tps.legend(fontsize="small")
    width = 0.8 / max(len(hists), 1)
    for i, (name, hist) in enumerate(hists.items()):
        total = sum(hist.values())
        lengths = sorted(hist)
        ax_hist.bar([k + (i - (len(hists) - 1) / 2) * width for k in lengths], [hist[k] / total for k in lengths],
                    width, label=name)  # fmt: skip
    lengths = sorted({k for h in hists.values() for k in h})
    if lengths:
        ax_hist.set_xticks(range(lengths[0], lengths[-1] + 1))
    ax_hist.set_xlabel("tokens emitted per round (accept length, bonus included)")
    ax_hist.set_ylabel("fraction of rounds")
    ax_hist.set_title("accept lengths")
    if hists:
        ax_hist.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def _setup_from_args(args) -> Setup:
    from treecompile.speculator import fuse_projections_default

    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: 'cuda' asked for, but no CUDA device is available")
    batch_sizes = parse_ints("--batch-sizes", args.batch_sizes or ("1,2" if args.smoke else "1,4,16"))
    trees = parse_trees(args.trees) if args.trees else (SMOKE_TREES if args.smoke else DEFAULT_TREES)
    keys = parse_configs(args.configs) if args.configs else CONFIG_KEYS
    if args.skip_hf_compile:
        keys = tuple(k for k in keys if k != "hf_compile")
    if args.chain_steps < 1 or args.chain_steps > 63:
        raise ValueError(f"--chain-steps: expected an int in 1..63, got {args.chain_steps}")
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (8 if args.smoke else 256)
    prompts = args.prompts if args.prompts is not None else (2 if args.smoke else 8)
    if not 1 <= args.repeats <= 20:
        raise ValueError(f"--repeats: expected an int in 1..20, got {args.repeats}")
    if max_new < 1 or prompts < 1:
        raise ValueError("--max-new-tokens and --prompts: expected positive ints")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"--dtype: one of {sorted(DTYPES)}, got {args.dtype!r}")
    if args.dtype is not None and args.smoke:
        raise ValueError("--dtype: the smoke model always runs in float32")
    if args.shrink_ab and args.shrink_batch is not None:
        raise ValueError("--shrink-ab: times shrinking off and on itself; leave --shrink-batch unset")
    return Setup(batch_sizes=batch_sizes, max_new_tokens=max_new, prompts=prompts,
                 configs=build_configs(keys, trees, args.chain_steps), smoke=args.smoke, head=args.head,
                 inductor=args.inductor, device=device, fuse_projections=fuse_projections_default(args.fuse_projections, device),
                 dtype=args.dtype, lookahead=args.lookahead, shrink_batch=args.shrink_batch, repeats=args.repeats,
                 skinny_linears=args.skinny_linears, shrink_ab=args.shrink_ab)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treecompile.bench e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2"], help="the target (only SmolLM2 so far)")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,4,16; smoke 1,2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per prompt (default 256; smoke 8)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="held-out prompts per batch size, rounded up to whole batches (default 8; smoke 2)")
    parser.add_argument("--trees", default=None,
                        help="'K,S,N;K,S,N;...' (default 4,6,32;4,5,16;8,6,64; smoke 2,3,6;4,3,12)")
    parser.add_argument("--chain-steps", type=int, default=DEFAULT_CHAIN_STEPS, help="drafted tokens of tc_chain")
    parser.add_argument("--configs", default=None, help=f"subset of {','.join(CONFIG_KEYS)} (default all)")
    parser.add_argument("--skip-hf-compile", action="store_true", help="drop hf_compile (its compile takes minutes)")
    parser.add_argument("--head", default=None, help="EAGLE-3 head directory (default the shipped SmolLM2 head)")
    parser.add_argument("--inductor", action="store_true",
                        help="compile treecompile's target with Inductor (minutes per batch size and tree size on "
                             "a slow host; off by default: CUDA graphs already remove launch overhead)")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                        help="q/k/v and gate/up as one linear each (default: TreeSpeculator's, on for CUDA, off for CPU)")
    parser.add_argument("--skinny-linears", action=argparse.BooleanOptionalAction, default=None,
                        help="run the treecompile rows' few-row bf16/fp16 GEMMs on treespec::skinny_linear (Triton) "
                             "instead of cuBLAS (default: TreeSpeculator's, on for 16-bit CUDA models)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed passes over every batch per row; tokens/s from the median pass (default 1)")
    parser.add_argument("--shrink-batch", action=argparse.BooleanOptionalAction, default=None,
                        help="move a batch's running requests onto smaller batch sizes already run as others stop "
                             "(default: the speculator's, on; list --batch-sizes smallest first so the smaller "
                             "sizes exist)")  # fmt: skip
    parser.add_argument("--shrink-ab", action="store_true",
                        help="time every treecompile row with shrinking off and, at batch sizes after a smaller "
                             "one, again with it on in a '+shrink' row: same speculator and graphs, passes "
                             "alternating (with --repeats)")  # fmt: skip
    parser.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True,
                        help="launch each CUDA-graph round before reading the previous round's stop flags (default on)")
    parser.add_argument("--dtype", default=None,
                        help="SmolLM2's dtype: bfloat16, float16 or float32 (default bfloat16 on CUDA, float32 on CPU); "
                             "float32 on the GPU checks that every row's text equals the plain greedy output")
    parser.add_argument("--json", default=None, help="write the results here (rewritten after every configuration)")
    parser.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama on the CPU (CI)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        setup = _setup_from_args(args)
    except (ValueError, RuntimeError) as exc:
        parser.error(str(exc))
    import treecompile  # noqa: F401  registers torch.ops.treespec

    names = ", ".join(c.name for c in setup.configs)
    _say(f"{'smoke' if setup.smoke else args.model} on {setup.device}; batch sizes {list(setup.batch_sizes)}; "
         f"{setup.max_new_tokens} new tokens; configs {names}")  # fmt: skip
    bench = E2EBench(setup, json_path=args.json)
    threads = torch.get_num_threads()
    if setup.smoke:  # a tiny model's matmuls only lose to thread hand-offs (20x on a busy 2-core CI box)
        torch.set_num_threads(1)
    try:
        result = bench.run()
    except (ValueError, ImportError) as exc:  # bad --head, missing SmolLM2 package: one line, no traceback
        print(f"e2e: {exc}", flush=True)
        return 2
    finally:
        torch.set_num_threads(threads)
    m = result["setup"]
    print()
    print(f"{m['model']} on {m['device']} ({m['dtype']}); torch {m['torch']}; transformers {m['transformers']}; "
          f"{m['max_new_tokens']} new tokens, greedy; {'CUDA graphs' if m['cuda_graphs'] else 'no CUDA graphs'}"
          f"{', inductor' if m['inductor'] else ''}; head {m['head']}; wall {result['wall_s']:.0f} s\n")  # fmt: skip
    print(format_table(result), flush=True)
    if args.plot:
        if write_plot(result, args.plot):
            _say(f"plot written to {args.plot}")
    failed = [r for r in result["rows"] if r["error"] is not None]
    return 1 if failed and len(failed) == len(result["rows"]) else 0
