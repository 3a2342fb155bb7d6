"""Linear-attention tree benchmark (GPU): GDN and Mamba2 tree verify, chain verify, 1-token decode and the two
commit paths (replay, staged), per layer, side by side in one run.

    python -m treecompile.bench linear [--nodes 8,16,32,64] [--accepts 1,4,8] [--batch 1] [--layers 20]
                                       [--reps 20] [--models gdn,mamba2] [--json PATH] [--smoke]

Shapes. GDN as in Qwen3-Next-80B-A3B's linear-attention layers: Hk=16 key heads, Hv=32 value heads,
Dk=Dv=128; q, k, v, g, beta bf16, the recurrent state fp32; batch ``--batch`` (1). Qwen3-Next-80B has 48
layers, 36 of them GDN (every 4th is full attention). Mamba2 as in Mamba2-2.7B's mixer: H=80 heads, head
dim P=64, state size S_n=128, G=1 group; x, dt, B, C bf16; A, D, dt_bias and the state fp32; 64 layers.

Trees: EAGLE-like, selected by ``treecompile.draft_tree.DraftTree`` (K=4 lanes, S = min(6, N/K + 1) steps)
from random peaked log-probs (seeded). The output prints each tree's depth and branch points (nodes with a
child other than the next node: where GDN verify stores a state for a later reload, and where a Mamba2
program replays ancestors).

What is timed, per model, per layer:

- **tree verify** N (8, 16, 32, 64): ``gdn_tree_verify`` (branch points' states go to ONE workspace shared
  by all layers) / ``mamba2_tree_verify`` (no workspace); the chunked forms ``gdn_tree_verify_chunked``
  (N <= 16) and ``mamba2_tree_verify_chunked`` (N <= 64), each on the tree and on a chain; and the
  staged verifies (``gdn_tree_verify_staged``, ``mamba2_tree_verify_staged``: every node's state into a
  per-layer scratch) where this build has them ("not built" otherwise);
- **chain verify** of the same N (parents t - 1), and of N = A for the commit comparisons;
- **1-token decode**: the verify op at N = 1 (reads the state, writes none), and a **decode step**: verify
  N = 1 + replay commit A = 1 (what treecompile's plain decode runs per linear layer);
- **replay commit** of A accepted nodes (1, 4, 8): ``gdn_replay_commit`` / ``mamba2_replay_commit`` (read
  the state, replay A payload rows, write the state), against a chain decode of A, read two ways: the chain
  verify at N = A, and A x the decode step; and the **staged commit** (``ssm_commit_staged``: copies the
  last accepted node's scratch state into the pool).

Timing: each variant is ONE CUDA graph calling the op R times (``--layers``, default 20), each call with its
own layer's tensors (state, inputs, payload, scratch; the GDN workspace is shared, as in a forward), L2
cleaned before each replay (a 256 MiB read), CUDA events around the replay only (the host is too slow to
time single launches); reported: median of ``--reps`` replays / R, in microseconds per layer. Floors: the
bytes a variant must move (the state read, and written for commits; inputs, outputs, payload or scratch
rows; not the branch-point workspace traffic) over the device-to-device copy bandwidth of the same run.

Targets (issue #6): tree verify <= 1.5x chain verify at equal N (for each op: sequential, chunked); replay commit of A <= 1.2x a chain decode
of A (both readings reported). Memory: the GDN workspace (one layer's state per node, shared by all layers)
against the staged path's per-layer scratch x the model's layers, and the replay payload x layers.

Context, not a comparison: SGLang's chunked tree GDN kernel is published at 87 us/layer on a B200
(Blackwell, 8 TB/s HBM3e) for a 129-node tree with 16 key heads and 48 value heads. This benchmark runs on
an H200 (Hopper, 4.8 TB/s HBM3e) with 32 value heads and N <= 64: the hardware, the heads and the tree size
all differ, so that number is printed as context only.

A variant that fails prints ``fail: <reason>`` and the run goes on; progress lines are flushed so a timeout
still leaves partial output. ``--smoke`` runs tiny shapes on whatever device exists (CPU: the ops' reference
paths, no graphs, ``time.perf_counter``) through the same code, so CI tests the harness.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from treecompile.bench import failure_reason
from treecompile.bench.rounds import Clock, attempt, measure_copy_bandwidth

logger = logging.getLogger(__name__)

CONTEXT = (
    "context, not a comparison: SGLang's chunked tree GDN kernel is published at 87 us/layer on a B200 "
    "(Blackwell, 8 TB/s HBM3e) for a 129-node tree, 16 key heads, 48 value heads; the GPU run here is an H200 "
    "(Hopper, 4.8 TB/s HBM3e) with 32 value heads and N <= 64: hardware, heads and tree size all differ"
)
TREE_LIMIT = 1.5  # tree verify / chain verify at equal N
COMMIT_LIMIT = 1.2  # replay commit of A / a chain decode of A
OPTIONAL_MODULES = {"gdn_tree_verify_chunked": "treecompile.ops.gdn_chunk_tree"}  # op -> module not in ops/__init__


@dataclasses.dataclass(frozen=True)
class GdnShape:
    num_k_heads: int = 16
    num_v_heads: int = 32
    head_k_dim: int = 128
    head_v_dim: int = 128
    model_layers: int = 36  # Qwen3-Next-80B-A3B: 48 layers, every 4th full attention
    model: str = "Qwen3-Next-80B-A3B"


@dataclasses.dataclass(frozen=True)
class Mamba2Shape:
    num_heads: int = 80
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 1
    model_layers: int = 64
    model: str = "Mamba2-2.7B"


GDN_SMOKE = GdnShape(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, model="smoke")
MAMBA2_SMOKE = Mamba2Shape(num_heads=4, head_dim=16, state_size=16, n_groups=1, model="smoke")


@dataclasses.dataclass
class Setup:
    """One benchmark configuration (``--smoke`` shrinks the shapes and counts, keeps the code path)."""

    device: torch.device
    gdn: GdnShape = GdnShape()
    mamba2: Mamba2Shape = Mamba2Shape()
    models: tuple[str, ...] = ("gdn", "mamba2")
    nodes: tuple[int, ...] = (8, 16, 32, 64)
    accepts: tuple[int, ...] = (1, 4, 8)
    batch: int = 1
    layers: int = 20  # R: op calls (each its own layer's tensors) per captured graph
    reps: int = 20
    input_dtype: torch.dtype = torch.bfloat16
    copy_bytes: int = 1 << 30
    smoke: bool = False

    @property
    def graphs(self) -> bool:
        return self.device.type == "cuda"


def _say(message: str) -> None:
    """Progress for the person watching a long GPU run (flushed: a timeout still leaves the lines)."""
    print(f"[linear] {message}", flush=True)


def op_available(name: str) -> bool:
    return hasattr(torch.ops.treespec, name)


def import_optional_ops() -> dict[str, str]:
    """Import the op modules ``treecompile.ops`` may not import itself. ``{op: reason}`` for those whose module
    exists but fails to import (a module that does not exist is simply not built)."""
    import importlib

    import treecompile.ops  # noqa: F401  registers torch.ops.treespec.*

    broken = {}
    for op, module in OPTIONAL_MODULES.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                broken[op] = f"import {module}: {failure_reason(exc)}"
        except Exception as exc:  # noqa: BLE001 - reported on the rows of its op
            broken[op] = f"import {module}: {failure_reason(exc)}"
    return broken


# ---------------------------------------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------------------------------------


def eagle_tree(num_nodes: int, batch: int, seed: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parents, depth)`` int64 ``[B, N]`` of an EAGLE-like tree per request: ``DraftTree`` (K=4 lanes, up
    to 6 steps; smaller K for N < 8) over peaked random log-probs, the best N-1 candidates kept."""
    from treecompile.draft_tree import DraftTree

    topk = 4 if num_nodes >= 8 else max(1, num_nodes // 2)
    steps = max(1, min(6, num_nodes // topk + 1))
    tree = DraftTree(topk, steps, num_nodes)
    gen = torch.Generator().manual_seed(seed)

    def draft(*lead: int):
        logp = torch.log_softmax(3.0 * torch.randn(*lead, vocab, generator=gen), dim=-1)
        top = logp.topk(topk, dim=-1)
        return top.values, top.indices

    lanes = tree.begin(*draft(batch))
    for _ in range(1, steps):
        lanes = tree.expand(lanes, *draft(batch, topk))
    selected = tree.select(torch.zeros(batch, dtype=torch.int64))
    return selected.parents, selected.depth


def chain_parents(num_nodes: int, batch: int) -> torch.Tensor:
    return (torch.arange(num_nodes, dtype=torch.int64) - 1).expand(batch, num_nodes).clone()


def branch_points(parents: torch.Tensor) -> list[int]:
    """Per request: nodes with a child other than the next node."""
    from treecompile.ops.gdn_tree import gdn_branch_points

    return [int(x) for x in gdn_branch_points(parents).sum(dim=1)]


# ---------------------------------------------------------------------------------------------------------
# The two models: inputs, op calls and the bytes each variant must move
# ---------------------------------------------------------------------------------------------------------


class _Model:
    """What the bench needs of a model family; one layer's tensors are a dict."""

    key: str
    title: str
    verify_ops: dict[str, str]  # kind ("tree", "chunked", "staged") -> op name
    commit_op: str
    payload_width: int  # elements of one replay payload row
    model_layers: int  # the real model's layers of this kind (memory rows)
    chunked_max_nodes = 0
    workspace_shared = False  # GDN: one branch-point workspace for all layers

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.gen = torch.Generator(device=setup.device).manual_seed(0)

    def _randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        s = self.setup
        return torch.randn(*shape, generator=self.gen, device=s.device).to(dtype or s.input_dtype)

    @property
    def state_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def state_bytes(self) -> int:
        """One layer's state, all requests."""
        return math.prod(self.state_shape) * 4

    def new_state(self) -> torch.Tensor:
        return self._randn(*self.state_shape, dtype=torch.float32) * 0.5

    def payload(self, n: int) -> torch.Tensor:
        return torch.empty((self.setup.batch, n, self.payload_width), dtype=torch.float32, device=self.setup.device)

    def scratch(self, n: int) -> torch.Tensor:
        b, rest = self.state_shape[0], self.state_shape[1:]
        return torch.empty((b, n, *rest), dtype=torch.float32, device=self.setup.device)

    def commit(self, state, payload, path, accept_len) -> Callable[[], None]:
        op = getattr(torch.ops.treespec, self.commit_op)
        return lambda: op(state, payload, path, accept_len)

    def commit_bytes(self, accepted: int) -> int:
        return 2 * self.state_bytes + self.setup.batch * accepted * self.payload_width * 4

    def staged_commit_bytes(self) -> int:
        return 2 * self.state_bytes  # one node's state read per request, the state written

    def verify_bytes(self, n: int, kind: str) -> int:
        buffer = self.state_bytes * n if kind == "staged" else self.setup.batch * n * self.payload_width * 4
        return self.state_bytes + self.io_bytes(n) + buffer

    def inputs(self, n: int) -> dict:
        """One layer's random inputs over n nodes, and its payload buffer."""
        raise NotImplementedError

    def verify(self, kind: str, x: dict, state, parents, buf) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    def io_bytes(self, n: int) -> int:
        """Inputs read and outputs written by a verify over n nodes."""
        raise NotImplementedError


class GdnModel(_Model):
    key = "gdn"
    verify_ops = {"tree": "gdn_tree_verify", "chunked": "gdn_tree_verify_chunked", "staged": "gdn_tree_verify_staged"}
    commit_op = "gdn_replay_commit"
    chunked_max_nodes = 16
    workspace_shared = True

    def __init__(self, setup: Setup) -> None:
        from treecompile.ops.gdn_tree import gdn_payload_width

        super().__init__(setup)
        s = self.shape = setup.gdn
        self.title = f"GDN ({s.model}: Hk={s.num_k_heads}, Hv={s.num_v_heads}, Dk={s.head_k_dim}, Dv={s.head_v_dim})"
        self.model_layers = s.model_layers
        self.payload_width = gdn_payload_width(s.num_k_heads, s.head_k_dim, s.num_v_heads, s.head_v_dim)
        self.workspace: torch.Tensor | None = None

    @property
    def state_shape(self) -> tuple[int, ...]:
        s = self.shape
        return (self.setup.batch, s.num_v_heads, s.head_k_dim, s.head_v_dim)

    def shared_workspace(self, n: int) -> torch.Tensor:
        """The one workspace every layer shares (grown to the largest tree asked for)."""
        if self.workspace is None or self.workspace.shape[1] < n:
            self.workspace = self.scratch(n)
        return self.workspace

    def inputs(self, n: int) -> dict:
        s, b = self.shape, self.setup.batch
        return {
            "q": self._randn(b, n, s.num_k_heads, s.head_k_dim),
            "k": self._randn(b, n, s.num_k_heads, s.head_k_dim),
            "v": self._randn(b, n, s.num_v_heads, s.head_v_dim),
            "g": F.logsigmoid(self._randn(b, n, s.num_v_heads, dtype=torch.float32)).to(self.setup.input_dtype),
            "beta": torch.sigmoid(self._randn(b, n, s.num_v_heads, dtype=torch.float32)).to(self.setup.input_dtype),
            "payload": self.payload(n),
        }

    def verify(self, kind, x, state, parents, buf=None):
        ops, n = torch.ops.treespec, parents.shape[1]
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], state, parents)
        if kind == "tree":
            workspace = self.shared_workspace(n)
            return lambda: ops.gdn_tree_verify(*args, workspace, x["payload"])
        if kind == "chunked":
            return lambda: ops.gdn_tree_verify_chunked(*args, x["payload"])
        if kind == "staged":
            return lambda: ops.gdn_tree_verify_staged(*args, buf)
        raise ValueError(kind)

    def io_bytes(self, n: int) -> int:
        s, b = self.shape, self.setup.batch
        e = torch.empty((), dtype=self.setup.input_dtype).element_size()
        qk = 2 * s.num_k_heads * s.head_k_dim
        v_o = 2 * s.num_v_heads * s.head_v_dim  # v read, o written
        return b * n * e * (qk + v_o + 2 * s.num_v_heads)


class Mamba2Model(_Model):
    key = "mamba2"
    verify_ops = {"tree": "mamba2_tree_verify", "chunked": "mamba2_tree_verify_chunked",
                  "staged": "mamba2_tree_verify_staged"}  # fmt: skip
    commit_op = "mamba2_replay_commit"
    chunked_max_nodes = 64

    def __init__(self, setup: Setup) -> None:
        from treecompile.ops.mamba2_tree import mamba2_payload_width

        super().__init__(setup)
        s = self.shape = setup.mamba2
        self.title = (f"Mamba2 ({s.model}: H={s.num_heads}, P={s.head_dim}, S_n={s.state_size}, "
                      f"G={s.n_groups})")  # fmt: skip
        self.model_layers = s.model_layers
        self.payload_width = mamba2_payload_width(s.num_heads, s.head_dim, s.n_groups, s.state_size)

    @property
    def state_shape(self) -> tuple[int, ...]:
        s = self.shape
        return (self.setup.batch, s.num_heads, s.head_dim, s.state_size)

    def inputs(self, n: int) -> dict:
        s, b, h = self.shape, self.setup.batch, self.shape.num_heads
        return {
            "x": self._randn(b, n, h, s.head_dim),
            "dt": self._randn(b, n, h),
            "A": -torch.exp(self._randn(h, dtype=torch.float32) * 0.5),  # -exp(A_log)
            "B": self._randn(b, n, s.n_groups, s.state_size),
            "C": self._randn(b, n, s.n_groups, s.state_size),
            "D": self._randn(h, dtype=torch.float32),
            "dt_bias": self._randn(h, dtype=torch.float32) * 0.5,
            "payload": self.payload(n),
        }

    def verify(self, kind, x, state, parents, buf=None):
        ops = torch.ops.treespec
        args = (x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["dt_bias"], state, parents)
        if kind == "tree":
            return lambda: ops.mamba2_tree_verify(*args, x["payload"])
        if kind == "chunked":
            return lambda: ops.mamba2_tree_verify_chunked(*args, x["payload"])
        if kind == "staged":
            return lambda: ops.mamba2_tree_verify_staged(*args, buf)
        raise ValueError(kind)

    def io_bytes(self, n: int) -> int:
        s, b = self.shape, self.setup.batch
        e = torch.empty((), dtype=self.setup.input_dtype).element_size()
        per_node = 2 * s.num_heads * s.head_dim + s.num_heads + 2 * s.n_groups * s.state_size  # x, y, dt, B, C
        return b * n * e * per_node + 3 * s.num_heads * 4  # A, D, dt_bias


MODELS = {"gdn": GdnModel, "mamba2": Mamba2Model}


# ---------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One timed variant: ``us`` per layer (None: failed or not built, ``note`` says which)."""

    key: str  # "<model>/<variant>_<size>"
    model: str
    label: str
    size: str  # "N=16" or "A=4"
    floor_bytes: int = 0
    floor_us: float | None = None  # floor_bytes over the measured copy bandwidth
    us: float | None = None
    note: str = ""


class LinearBench:
    """Holds the clock and the rows; each ``measure_*`` appends rows and never raises."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.clock = Clock(setup.device, setup.reps)
        self.rows: dict[str, Row] = {}
        self.trees: dict[str, dict[int, dict]] = {}
        self.broken_ops = import_optional_ops()

    def _row(self, model: _Model, name: str, label: str, size: str, floor_bytes: int = 0) -> Row:
        key = f"{model.key}/{name}"
        row = self.rows[key] = Row(key, model.key, label, size, floor_bytes)
        return row

    def _attempt(self, rows: list[Row], what: Callable[[], None]) -> bool:
        return attempt(rows, what, self.clock, untimed=lambda row: row.us is None, say=lambda row, msg: _say(
            f"{row.model} {row.label} {row.size}: {msg}"))

    def _timed(self, row: Row, fns: list[Callable[[], object]], calls_per_layer: int = 1) -> None:
        """One graph making every call of ``fns`` once, in order; microseconds per layer."""

        def all_layers():
            for fn in fns:
                fn()

        ms = self.clock.time(self.clock.capture(all_layers))
        row.us = ms * 1e3 * calls_per_layer / len(fns)
        _say(f"{row.model} {row.label} {row.size}: {row.us:.2f} us/layer")

    def _missing(self, op: str) -> str | None:
        """Why ``op`` cannot be timed ("not built", or its module's import failure), None when it can."""
        if op_available(op):
            return None
        return f"fail: {self.broken_ops[op]}" if op in self.broken_ops else "not built"

    # -- variants -------------------------------------------------------------------------------------------

    def measure_verify(self, model: _Model, states: list[torch.Tensor], n: int, tree: torch.Tensor) -> None:
        """Tree and chain verify over N nodes (and the chunked / staged ops where built), one input set."""
        s = self.setup
        op = model.verify_ops["tree"]
        chain = chain_parents(n, s.batch).to(s.device)
        variants = [("tree", "tree", tree, f"tree verify (`{op}`)"),
                    ("chain", "tree", chain, f"chain verify (`{op}`, parents t-1)")]  # fmt: skip
        if "chunked" in model.verify_ops and n <= model.chunked_max_nodes:
            chunked = model.verify_ops["chunked"]
            variants += [("chunked_tree", "chunked", tree, f"chunked tree verify (`{chunked}`)"),
                         ("chunked_chain", "chunked", chain, f"chunked chain verify (`{chunked}`)")]  # fmt: skip
        if "staged" in model.verify_ops:
            variants.append(("staged_tree", "staged", tree, f"staged tree verify (`{model.verify_ops['staged']}`)"))
        rows = []
        for name, kind, parents, label in variants:
            row = self._row(model, f"{name}_{n}", label, f"N={n}", model.verify_bytes(n, kind))
            missing = self._missing(model.verify_ops[kind])
            if missing is not None:
                row.note = missing
                _say(f"{model.key} {label} N={n}: {missing}")
                continue
            rows.append((row, kind, parents))
        if not rows:
            return
        inputs = []
        if not self._attempt([r for r, _, _ in rows], lambda: inputs.extend(model.inputs(n) for _ in states)):
            return
        for row, kind, parents in rows:
            scratch = []

            def measure(row=row, kind=kind, parents=parents, scratch=scratch):
                if kind == "staged":
                    scratch.extend(model.scratch(n) for _ in states)
                fns = [model.verify(kind, x, state, parents, scratch[i] if scratch else None)
                       for i, (x, state) in enumerate(zip(inputs, states))]  # fmt: skip
                self._timed(row, fns)

            self._attempt([row], measure)
            del scratch[:]
            self.clock.recover()

    def measure_decode(self, model: _Model, states: list[torch.Tensor]) -> None:
        """The verify op at N = 1, and a decode step: verify N = 1 then replay commit A = 1 per layer."""
        s = self.setup
        one = self._row(model, "decode_1", "1-token decode (verify N=1, no state write)", "N=1",
                        model.verify_bytes(1, "tree"))  # fmt: skip
        step = self._row(model, "decode_step", f"decode step (verify N=1 + `{model.commit_op}` A=1)", "N=1",
                         model.verify_bytes(1, "tree") + model.commit_bytes(1))  # fmt: skip
        parents = chain_parents(1, s.batch).to(s.device)
        path = torch.zeros((s.batch, 1), dtype=torch.int64, device=s.device)
        accept_len = torch.ones(s.batch, dtype=torch.int64, device=s.device)
        inputs = []
        if not self._attempt([one, step], lambda: inputs.extend(model.inputs(1) for _ in states)):
            return
        self._attempt([one], lambda: self._timed(one, [model.verify("tree", x, st, parents)
                                                       for x, st in zip(inputs, states)]))  # fmt: skip
        if "chunked" in model.verify_ops and self._missing(model.verify_ops["chunked"]) is None:
            op = model.verify_ops["chunked"]
            chunked = self._row(model, "decode_1_chunked", f"1-token decode, chunked op (`{op}`, N=1)", "N=1",
                                model.verify_bytes(1, "chunked"))  # fmt: skip
            self._attempt([chunked], lambda: self._timed(chunked, [model.verify("chunked", x, st, parents)
                                                                   for x, st in zip(inputs, states)]))  # fmt: skip
        fns = []
        for x, st in zip(inputs, states):
            fns += [model.verify("tree", x, st, parents), model.commit(st, x["payload"], path, accept_len)]
        self._attempt([step], lambda: self._timed(step, fns, calls_per_layer=2))

    def measure_commits(self, model: _Model, states: list[torch.Tensor]) -> None:
        """Replay commit and staged commit of A accepted nodes, over payload rows a chain verify wrote and
        scratch rows holding valid states (the staged copy moves the same bytes whatever they hold)."""
        s = self.setup
        width = max(s.accepts)
        path = torch.arange(width, dtype=torch.int64, device=s.device).expand(s.batch, width).contiguous()
        replay = {a: self._row(model, f"commit_{a}", f"replay commit (`{model.commit_op}`)", f"A={a}",
                               model.commit_bytes(a)) for a in s.accepts}  # fmt: skip
        staged = {a: self._row(model, f"staged_commit_{a}", "staged commit (`ssm_commit_staged`)", f"A={a}",
                               model.staged_commit_bytes()) for a in s.accepts}  # fmt: skip
        payloads, scratches = [], []

        def fill_payloads():
            parents = chain_parents(width, s.batch).to(s.device)
            for state in states:
                x = model.inputs(width)
                model.verify("tree", x, state, parents)()
                payloads.append(x["payload"])

        def fill_scratches():
            for state in states:
                scratches.append(state.unsqueeze(1).expand(-1, width, *state.shape[1:]).contiguous())

        if self._attempt(list(replay.values()), fill_payloads):
            for a, row in replay.items():
                accept_len = torch.full((s.batch,), a, dtype=torch.int64, device=s.device)
                self._attempt([row], lambda row=row, n=accept_len: self._timed(
                    row, [model.commit(st, p, path, n) for st, p in zip(states, payloads)]))  # fmt: skip
        del payloads[:]
        missing = self._missing("ssm_commit_staged")
        if missing is not None:
            for row in staged.values():
                row.note = missing
            return
        if self._attempt(list(staged.values()), fill_scratches):
            commit = torch.ops.treespec.ssm_commit_staged
            for a, row in staged.items():
                accept_len = torch.full((s.batch,), a, dtype=torch.int64, device=s.device)
                self._attempt([row], lambda row=row, n=accept_len: self._timed(
                    row, [lambda st=st, f=f, n=n: commit(st, f, path, n) for st, f in zip(states, scratches)]))
        del scratches[:]

    def run_model(self, model: _Model) -> None:
        s = self.setup
        _say(f"{model.title}: {s.layers} layers per graph, batch {s.batch}")
        states: list[torch.Tensor] = []
        if not self._attempt([], lambda: states.extend(model.new_state() for _ in range(s.layers))):
            _say(f"{model.key}: could not allocate the states; skipped")
            return
        trees = self.trees.setdefault(model.key, {})
        for n in s.nodes:
            parents, depth = eagle_tree(n, s.batch, seed=n)
            trees[n] = {"parents": parents.tolist(), "depth": [int(d) for d in depth.max(dim=1).values],
                        "branch_points": branch_points(parents)}  # fmt: skip
            _say(f"{model.key} tree N={n}: depth {trees[n]['depth']}, branch points {trees[n]['branch_points']}")
            self.measure_verify(model, states, n, parents.to(s.device))
        for a in s.accepts:  # the chain decode of A, where no tree size covered it
            if a > 1 and a not in s.nodes:
                self._measure_chain_only(model, states, a)
        self.measure_decode(model, states)
        self.measure_commits(model, states)
        if model.workspace_shared:
            model.workspace = None
        self.clock.recover()

    def _measure_chain_only(self, model: _Model, states: list[torch.Tensor], n: int) -> None:
        s, op = self.setup, model.verify_ops["tree"]
        row = self._row(model, f"chain_{n}", f"chain verify (`{op}`, parents t-1)", f"N={n}",
                        model.verify_bytes(n, "tree"))  # fmt: skip
        chain = chain_parents(n, s.batch).to(s.device)

        def measure():
            inputs = [model.inputs(n) for _ in states]
            self._timed(row, [model.verify("tree", x, st, chain) for x, st in zip(inputs, states)])

        self._attempt([row], measure)

    # -- the run --------------------------------------------------------------------------------------------

    def run(self) -> dict:
        s = self.setup
        t_start = time.time()
        bandwidth = measure_copy_bandwidth(s.device, s.copy_bytes)
        _say(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + written, {s.copy_bytes >> 20} MiB copy)")
        models = [MODELS[name](s) for name in s.models]
        for model in models:
            self.run_model(model)
        rows = list(self.rows.values())
        for row in rows:
            row.floor_us = row.floor_bytes / bandwidth * 1e6
        return {
            "device": torch.cuda.get_device_name() if s.device.type == "cuda" else str(s.device),
            "torch": torch.__version__,
            "triton": _triton_version(),
            "context": CONTEXT,
            "setup": {
                "smoke": s.smoke, "batch": s.batch, "layers_per_graph": s.layers, "reps": s.reps,
                "nodes": list(s.nodes), "accepts": list(s.accepts), "input_dtype": str(s.input_dtype),
                "state_dtype": "torch.float32", "cuda_graphs": s.graphs, "models": list(s.models),
                "gdn": dataclasses.asdict(s.gdn), "mamba2": dataclasses.asdict(s.mamba2),
            },  # fmt: skip
            "copy_bytes_per_s": bandwidth,
            "titles": {m.key: m.title for m in models},
            "trees": {k: {str(n): t for n, t in v.items()} for k, v in self.trees.items()},
            "rows": [dataclasses.asdict(r) for r in rows],
            "ratios": ratios(rows, s.nodes, s.accepts),
            "memory": memory(models, self.trees, s.nodes),
            "wall_s": time.time() - t_start,
        }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - optional on CPU
        return None


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def ratios(rows: list[Row], nodes, accepts) -> list[dict]:
    """The targets' ratios (``limit`` set) and the informative ones (``limit`` None)."""
    us = {r.key: r.us for r in rows}
    out = []

    def add(model, name, a, b, limit=None):
        if a in us or b in us:
            ratio = _ratio(us.get(a), us.get(b))
            met = None if ratio is None or limit is None else ratio <= limit
            out.append({"model": model, "name": name, "ratio": ratio, "limit": limit, "met": met})

    for model in sorted({r.model for r in rows}, key=lambda m: list(MODELS).index(m)):
        for n in nodes:
            add(model, f"tree / chain verify, N={n}", f"{model}/tree_{n}", f"{model}/chain_{n}", TREE_LIMIT)
        for n in nodes:
            if f"{model}/chunked_tree_{n}" in us:
                add(model, f"chunked tree / chunked chain, N={n}", f"{model}/chunked_tree_{n}",
                    f"{model}/chunked_chain_{n}", TREE_LIMIT)  # fmt: skip
                add(model, f"chunked tree / chain verify, N={n}", f"{model}/chunked_tree_{n}", f"{model}/chain_{n}")
                add(model, f"chunked tree / tree verify, N={n}", f"{model}/chunked_tree_{n}", f"{model}/tree_{n}")
        for n in nodes:
            add(model, f"staged tree / tree verify, N={n}", f"{model}/staged_tree_{n}", f"{model}/tree_{n}")
        for a in accepts:
            chain = f"{model}/chain_{a}" if a > 1 else f"{model}/decode_1"
            add(model, f"replay commit A={a} / chain verify N={a}", f"{model}/commit_{a}", chain, COMMIT_LIMIT)
            commit, step = us.get(f"{model}/commit_{a}"), us.get(f"{model}/decode_step")
            ratio = _ratio(commit, None if step is None else a * step)
            out.append({"model": model, "name": f"replay commit A={a} / ({a} x decode step)", "ratio": ratio,
                        "limit": COMMIT_LIMIT, "met": None if ratio is None else ratio <= COMMIT_LIMIT})  # fmt: skip
        for a in accepts:
            add(model, f"staged commit A={a} / replay commit A={a}", f"{model}/staged_commit_{a}",
                f"{model}/commit_{a}")  # fmt: skip
    return out


def memory(models: list[_Model], trees: dict, nodes) -> list[dict]:
    """Per model and tree size: the branch points the tree uses, the GDN workspace (shared by all layers; the
    part the branch points write), and per layer x the model's layers: the replay payload and the staged
    scratch."""
    out = []
    for model in models:
        per_request_state = model.state_bytes // model.setup.batch
        for n in nodes:
            points = trees.get(model.key, {}).get(n, {}).get("branch_points", [])
            payload = model.setup.batch * n * model.payload_width * 4
            scratch = model.state_bytes * n
            out.append({
                "model": model.key, "N": n, "branch_points": points, "layers": model.model_layers,
                "workspace_bytes": scratch if model.workspace_shared else 0,
                "workspace_written_bytes": sum(points) * per_request_state if model.workspace_shared else 0,
                "payload_layer_bytes": payload, "payload_model_bytes": payload * model.model_layers,
                "scratch_layer_bytes": scratch, "scratch_model_bytes": scratch * model.model_layers,
            })  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------

HEADER = (
    "| model | variant | size | us / layer | floor us | / floor | note |\n"
    "|---|---|---:|---:|---:|---:|---|"
)
RATIO_HEADER = "| model | ratio | value | target | verdict |\n|---|---|---:|---:|---|"
MEMORY_HEADER = (
    "| model | N | branch points | shared workspace (all layers) | written at branch points "
    "| replay payload / layer (x layers) | staged scratch / layer (x layers) |\n"
    "|---|---:|---|---:|---:|---:|---:|"
)


def _num(value) -> str:
    """Compact, always parseable as a float, never rounded to 0."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _bytes(n: int) -> str:
    if n == 0:
        return "0"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def format_report(result: dict) -> str:
    rows = sorted(result["rows"], key=_row_order)
    names = {"gdn": "GDN", "mamba2": "Mamba2"}
    lines = [HEADER]
    for r in rows:
        if r["us"] is None:
            cell = "not built" if r["note"] == "not built" else "fail"
        else:
            cell = _num(r["us"])
        lines.append(f"| {names[r['model']]} | {r['label']} | {r['size']} | {cell} | {_num(r['floor_us'])} "
                     f"| {_x(_ratio(r['us'], r['floor_us']))} | {r['note']} |")  # fmt: skip
    lines += ["", RATIO_HEADER]
    for t in result["ratios"]:
        if t["limit"] is None:
            target, verdict = "-", "info"
        else:
            target = f"<= {t['limit']:.2f}"
            verdict = "n/a (a variant failed or is not built)" if t["met"] is None else (
                "met" if t["met"] else "NOT met")  # fmt: skip
        lines.append(f"| {names[t['model']]} | {t['name']} | {_x(t['ratio'])} | {target} | {verdict} |")
    lines += ["", MEMORY_HEADER]
    for m in result["memory"]:
        ws = "none (replays ancestors)" if m["workspace_bytes"] == 0 else _bytes(m["workspace_bytes"])
        written = "-" if m["workspace_bytes"] == 0 else _bytes(m["workspace_written_bytes"])
        lines.append(
            f"| {names[m['model']]} | {m['N']} | {', '.join(map(str, m['branch_points']))} | {ws} | {written} "
            f"| {_bytes(m['payload_layer_bytes'])} (x {m['layers']} = {_bytes(m['payload_model_bytes'])}) "
            f"| {_bytes(m['scratch_layer_bytes'])} (x {m['layers']} = {_bytes(m['scratch_model_bytes'])}) |"
        )
    return "\n".join(lines)


_VARIANT_ORDER = ("tree_", "chain_", "chunked_tree_", "chunked_chain_", "staged_tree_", "decode_1", "decode_step",
                  "commit_", "staged_commit_")  # fmt: skip


def _row_order(row: dict) -> tuple[int, int, int, int]:
    """By model, then verify rows by N (tree, chain, chunked, staged), decode, commits by A (replay, staged)."""
    model_rank = list(MODELS).index(row["model"])
    name = row["key"].split("/", 1)[1]
    for rank, prefix in enumerate(_VARIANT_ORDER):
        if name.startswith(prefix) and (prefix.endswith("_") or name == prefix):
            rest = name[len(prefix):]
            size = int(rest) if rest.isdigit() else 0
            if rank < 5:
                return model_rank, 0, size, rank
            if rank < 7:
                return model_rank, 1, rank, 0
            return model_rank, 2, size, rank
    return model_rank, 3, 0, 0


def _int_list(flag: str, text: str, lo: int, hi: int) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(not lo <= v <= hi for v in values):
        raise ValueError(f"{flag}: expected a comma-separated list of ints in {lo}..{hi}, got {text!r}")
    return tuple(sorted(set(values)))


def _setup_from_args(args) -> Setup:
    models = tuple(dict.fromkeys(m.strip() for m in args.models.split(",") if m.strip()))
    if not models or any(m not in MODELS for m in models):
        raise ValueError(f"--models: expected a comma-separated subset of {','.join(MODELS)}, got {args.models!r}")
    nodes = args.nodes or ("8,16" if args.smoke else "8,16,32,64")
    common = dict(models=models, nodes=_int_list("--nodes", nodes, 1, 64),
                  accepts=_int_list("--accepts", args.accepts, 1, 64), batch=args.batch)  # fmt: skip
    if args.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Setup(device=device, gdn=GDN_SMOKE, mamba2=MAMBA2_SMOKE, layers=args.layers or 2,
                     reps=args.reps or 2, copy_bytes=8 << 20, smoke=True, **common)  # fmt: skip
    return Setup(device=torch.device("cuda"), layers=args.layers or 20, reps=args.reps or 20, **common)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treecompile.bench linear", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default=None, help="tree sizes verified (default 8,16,32,64; smoke 8,16)")
    parser.add_argument("--accepts", default="1,4,8", help="accepted lengths committed (default 1,4,8)")
    parser.add_argument("--batch", type=int, default=1, help="requests (default 1)")
    parser.add_argument("--layers", type=int, default=None, help="op calls per graph, each its own layer "
                        "(default 20; smoke 2)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=None, help="timed replays per variant (default 20; smoke 2)")
    parser.add_argument("--models", default="gdn,mamba2", help="which families (default gdn,mamba2)")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CI)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for flag, value in (("--batch", args.batch), ("--layers", args.layers), ("--reps", args.reps)):
        if value is not None and value < 1:
            parser.error(f"{flag}: expected a positive int, got {value}")
    try:
        setup = _setup_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.smoke and not torch.cuda.is_available():
        print("linear benchmark needs a CUDA device (or --smoke)")
        return 2

    mode = "CUDA graphs" if setup.graphs else "eager, no graphs"
    _say(f"device {setup.device} ({mode}), batch {setup.batch}, nodes {list(setup.nodes)}, accepts "
         f"{list(setup.accepts)}, {setup.layers} layers per graph, reps {setup.reps}"
         f"{', smoke' if setup.smoke else ''}")  # fmt: skip
    result = LinearBench(setup).run()
    print()
    print(
        f"device: {result['device']}; torch {result['torch']}; triton {result['triton']}; inputs "
        f"{setup.input_dtype}, state fp32; batch {setup.batch}; {'CUDA graphs' if setup.graphs else 'eager (no CUDA)'}"
        f", {setup.layers} layers (own tensors) per graph, median of {setup.reps} replays / layers; copy bandwidth "
        f"{result['copy_bytes_per_s'] / 1e12:.3f} TB/s; wall {result['wall_s']:.0f} s"
    )
    print(f"{CONTEXT}.")
    for key, title in result["titles"].items():
        print(f"{title}: " + "; ".join(
            f"N={n} depth {', '.join(map(str, t['depth']))} / branch points {', '.join(map(str, t['branch_points']))}"
            for n, t in result["trees"].get(key, {}).items()))  # fmt: skip
    print()
    print(format_report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0
