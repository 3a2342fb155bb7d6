"""TreeSpeculator: greedy draft-tree speculative decoding of an HF causal LM, lossless.

``TreeSpeculator(model, drafter, topk=4, steps=5, num_nodes=32).generate(input_ids, attention_mask=None,
max_new_tokens=..., eos_token_id=...)`` returns :class:`GenerateOutput` with ``sequences``
``[B, prompt + new]`` (HF layout: left padding kept, finished rows padded) and ``accept_lengths``
``int64 [rounds, B]`` (tokens each round emitted per request, bonus included; 0 once a request finished).
The tokens equal HF ``model.generate(do_sample=False)`` token for token.

One round (DESIGN.md, "Data flow of one round"), for B requests of committed length ``vc`` whose current
token (the root) sits at position ``vc``:

1. **Draft step 0** (the chain's): the drafter runs the pairs the last verify accepted (target hidden at
   p, token at p + 1; at most ``P = max depth + 1`` rows, padded rows write the dummy slot) and scores the
   root's children.
2. **Lanes** (steps 1..S-1): K rows per request at position ``vc - 1 + s`` over the draft cache's
   ``(S-1)K``-key lane window; ``DraftTree`` records and ranks. ``topk == 1`` runs the chain path: one lane
   per step, no DraftTree, no tree state (TreeSpec stays the chain).
3. **Verify**: ``DraftTree.select`` -> ``TreeSpec.set_tree``; one target forward over N nodes at positions
   ``vc + depth`` (``TreeSpec.load_step``), KV slots ``vc + i``; greedy walk (``verify_tree_greedy``).
4. **Compact**: ``compact_window_rows`` over every attention layer's K/V, ``TreeSpec.compact_rows`` over the
   target hidden rows (the next step-0 features); then commit ``vc += accept_len``, the bonus becomes the root,
   and linear-attention layers (GDN, Mamba2) commit their conv window and recurrent state along the accepted
   path (``TargetBinding.commit_linear_state``: replay of the payload rows, or the staged node state).

Prefill runs the prompt as chains of ``prefill_chunk`` rows through the same rewritten graph (padded rows
write the dummy slot; linear-attention state commits each chunk's valid rows) and fills the draft cache with
every prompt pair but the last, which step 0 of the first round takes. Requests that finished (EOS or
max_new_tokens) stop committing; their rows keep replaying the same round harmlessly until the batch is done.

Graph safety: every tensor a round reads or writes is allocated once per ``generate`` call (per batch) and
updated in place; rounds contain no host syncs. The loop reads one flag per round (is any request still
running?). With ``cuda_graphs=True`` (CUDA only) the draft round and the verify round (which ends with the
commit) are each captured once per batch size after an eager warm-up round and replayed
(``TREECOMPILE_ROUND_GRAPHS=1``: the whole round as one graph, measured no faster). Draft and verify
are idempotent over the committed state (they only overwrite scratch rows past ``vc``), so the side-stream
warm-up before the capture cannot corrupt a request; the commit is recorded, not run, by the capture. A
prefill chunk is captured too (``_prefill_graph``); it commits linear-attention state, so its capture undoes
what its warm-up runs committed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import time
from typing import Sequence

import torch

from treecompile.compiling import batch_key, compile_inference
from treecompile.draft_tree import DraftTree, LaneState
from treecompile.drafter import DraftContext
from treecompile.ops._common import MAX_NODES, env_switch
from treecompile.registry import resolve_tree_support
from treecompile.target import TargetBinding, TargetRunner, chain_mask
from treecompile.tree_spec import TreeSpec

logger = logging.getLogger(__name__)

__all__ = ["TreeSpeculator", "GenerateOutput"]

_SUPPORTED_DTYPES = {
    "cpu": (torch.float64, torch.float32, torch.bfloat16),
    "cuda": (torch.bfloat16, torch.float16, torch.float32),
}
_UNSET = object()
# EOS ids a request may name: they live in a bound buffer that the captured commit reads (-1 pads it).
MAX_EOS_IDS = 64


def _round_batch(spec, st) -> int:
    """A round function's compile key: its batch size (one code object each, see ``compile_inference``)."""
    return st["B"]


def _draft_hook(drafter, name: str, *args):
    return getattr(drafter, name)(*args)


class DraftHooks:
    """The drafter hooks a draft round calls (``draft_step0``, ``draft_lanes``, ``score_candidates``).

    With ``inductor`` each is compiled by Inductor (``dynamic=False``; graph breaks allowed, so a custom
    drafter with Python logic still runs): the midlayer's norms, RoPE, MLP glue and the LM head's softmax and
    top-k fuse around the treespec cache ops instead of running as dozens of small eager kernels per step
    (BENCHMARKS.md, "Rounds"). Each hook gets a private code object per speculator, batch size and draft step
    (``compile_inference(key=batch_key)``), so no shape ever queues behind another's guards or meets Dynamo's
    recompile limit (as :class:`treecompile.target.TargetRunner` does per shape).
    """

    NAMES = ("draft_step0", "draft_lanes", "score_candidates")

    def __init__(self, drafter, inductor: bool) -> None:
        self.inductor = bool(inductor)
        for name in self.NAMES:
            if not self.inductor:
                setattr(self, name, getattr(drafter, name))
                continue
            compiled = compile_inference(_draft_hook, f"_{name}_{id(self):x}", key=batch_key)
            setattr(self, name, functools.partial(compiled, drafter, name))


@dataclasses.dataclass
class GenerateOutput:
    """sequences: int64 [B, prompt_width + new]; accept_lengths: int64 [rounds, B] (bonus included)."""

    sequences: torch.Tensor
    accept_lengths: torch.Tensor


def _is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """bool like ``tokens``: the token is one of ``eos`` (int64 [E], -1 padded). A broadcast compare:
    ``torch.isin`` may pick a sort-based path, this never syncs or allocates by size."""
    return (tokens[..., None] == eos).any(-1)


def _greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` -> ``argmax [...]``: torch.argmax's index, on CUDA in two small kernels
    (``treespec::vocab_argmax``, ~3-5 us where torch's reduction took ~12 us on the H200)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.ops.treespec.vocab_argmax(flat).view(logits.shape[:-1])


COMPILED_COMMIT_ENV = "TREECOMPILE_COMPILED_COMMIT"
COMPILED_DRAFT_ENV = "TREECOMPILE_COMPILED_DRAFT"
# "2" (default): the draft and the verify (+ commit) are two captured graphs; "1": the round is one.
ROUND_GRAPHS_ENV = "TREECOMPILE_ROUND_GRAPHS"


def compiled_draft_from_env(device_type: str) -> bool:
    """Whether the draft round compiles as one Inductor region, from ``TREECOMPILE_COMPILED_DRAFT`` ("1" on,
    "0" off; unset: on for CUDA). Where the hooks use Inductor on CUDA it is the default: on the H200, SmolLM2
    batch 1, all 56 held-out prompts, both forms captured on one speculator with passes alternating, it read
    (4, 4, 16) 2516.6 -> 2578.4 tokens/s and (10, 6, 64) 2463.4 -> 2519.1 (+2.3-2.5%, twenty-ninth session,
    BENCHMARKS.md); 8B draft round 1.242 -> 1.220 ms (eighteenth). It costs ~8-15 s more warm-up (SmolLM2) and
    is not measured on CPU, where it stays off unless asked for."""
    raw = os.environ.get(COMPILED_DRAFT_ENV, "").strip()
    if raw == "":
        return device_type == "cuda"
    if raw not in ("0", "1"):
        raise ValueError(f"{COMPILED_DRAFT_ENV}={raw!r}: expected '0' (per-hook draft) or '1' (one compiled region)")
    return raw == "1"


DRAFT_INDUCTOR_ENV = "TREECOMPILE_DRAFT_INDUCTOR"


def draft_inductor_options_from_env() -> dict:
    """Inductor config for the compiled draft round only, from ``TREECOMPILE_DRAFT_INDUCTOR`` ("key=value,..."; keys
    as ``torch._inductor.config`` names them, e.g. ``test_configs.force_filter_reduction_configs=1``), each value
    read as its config's type (a bool takes 1/0/true/false). For A/B runs of the draft round's own kernels: a
    ``TORCHINDUCTOR_*`` variable would change the target's compile too. Unset or empty: ``{}``. An item without
    ``=``, a key this torch's Inductor does not have, or a value its type cannot take is a ValueError naming the
    variable, raised when the speculator is built."""
    raw = os.environ.get(DRAFT_INDUCTOR_ENV, "").strip()
    if not raw:
        return {}
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    options = {}
    for item in (part.strip() for part in raw.split(",")):
        key, eq, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not eq or not key:
            raise ValueError(f"{DRAFT_INDUCTOR_ENV}={raw!r}: expected key=value items separated by commas, got {item!r}")
        if key not in known:
            raise ValueError(f"{DRAFT_INDUCTOR_ENV}: {key!r} is not an Inductor config of this torch ({torch.__version__})")
        options[key] = _option_value(key, text, known[key])
    return options


def _option_value(key: str, text: str, default):
    """``text`` as the type of the config's current value ``default`` (text as given where that is None or other)."""
    bools = {"1": True, "true": True, "0": False, "false": False}
    try:
        if isinstance(default, bool):
            return bools[text.lower()]
        if isinstance(default, (int, float)):
            return type(default)(text)
    except (KeyError, ValueError):
        raise ValueError(f"{DRAFT_INDUCTOR_ENV}: {key}={text!r} is not a {type(default).__name__}") from None
    return text


def round_graphs_from_env() -> int:
    """Graphs a captured round is split into, from ``TREECOMPILE_ROUND_GRAPHS`` (default 2: the draft, then
    the verify + commit, which profiles them apart). One graph removes the graph boundary between the draft's
    last kernel and the verify's first; on the H200 it measured the same end to end (SmolLM2, batch 1, all 56
    held-out prompts, both forms on one speculator, passes alternating: plain +0.8%, trees (4, 4, 16) and
    (10, 6, 64) -0.2% / -0.3%; twenty-eighth session, BENCHMARKS.md), so it stays opt-in. Two graphs also let
    the lookahead send only the next draft ahead of the stop-flag read (``split_lookahead``: +1.5% at batch 1,
    thirty-second session), which one graph cannot."""
    raw = os.environ.get(ROUND_GRAPHS_ENV, "").strip()
    if raw in ("", "2"):
        return 2
    if raw == "1":
        return 1
    raise ValueError(f"{ROUND_GRAPHS_ENV}: must be 1 (one graph a round) or 2 (draft, verify), got {raw!r}")


def _commit_tokens(
    tree_tokens, path, alen, bonus, rows, eos, running, n_gen, max_new, out, emitted, history, dvc, pend_tok,
    pend_feat, pend_n, root, vc, aux, P: int, num_nodes: int,
):  # fmt: skip
    """A round's commit, in place on the request state (``[B, ..]`` tensors): emit the accepted tokens (EOS and
    ``max_new`` cut them) into ``out``/``history``, advance ``vc``/``n_gen``/the pending pairs of running
    requests, stop the finished ones. Returns the committed lengths ``[B]`` (0 for requests that were not
    running) for the linear-attention state. A plain function, so it is compiled whole where the hooks use
    Inductor (~30 small kernels a round become a few; ``TREECOMPILE_COMPILED_COMMIT=0`` keeps it eager)."""
    path_tokens = tree_tokens.gather(1, path.clamp(min=0))
    # Token after accepted node i: the next path node's token, the bonus after the last one.
    emit = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)
    emit = torch.where(rows[None, :] == (alen - 1)[:, None], bonus[:, None], emit)
    is_eos = _is_eos(emit, eos) & (rows[None, :] < alen[:, None])
    first_eos = torch.where(is_eos.any(1), is_eos.to(torch.int64).argmax(1), num_nodes)
    count = torch.minimum(torch.minimum(alen, first_eos + 1), max_new - n_gen)
    count = torch.where(running, count, 0)
    out.scatter_(1, n_gen[:, None] + rows[None, :], torch.where(running[:, None], emit, out.gather(
        1, n_gen[:, None] + rows[None, :])))
    emitted.copy_(count)
    n_gen += count
    cap = history.shape[1]
    idx = (vc[:, None] + 1 + rows[None, :]).clamp(max=cap - 1)
    keep = history.gather(1, idx)
    history.scatter_(1, idx, torch.where(running[:, None] & (rows[None, :] < alen[:, None]), emit, keep))
    dvc.copy_(torch.where(running, vc, dvc))
    pend_tok.copy_(torch.where(running[:, None], emit[:, :P], pend_tok))
    pend_feat.copy_(torch.where(running[:, None, None], aux[:, :P], pend_feat))
    pend_n.copy_(torch.where(running, alen, pend_n))
    root.copy_(torch.where(running, bonus, root))
    vc.copy_(torch.where(running, vc + alen, vc))
    committed = torch.where(running, alen, 0)
    finished = (first_eos < count) | (n_gen >= max_new)
    running &= ~finished
    return committed


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def fuse_projections_default(fuse_projections: bool | None, device: torch.device) -> bool:
    """``TreeSpeculator(fuse_projections=None)``: on for CUDA models (measured faster on the H200), off on CPU."""
    return device.type == "cuda" if fuse_projections is None else bool(fuse_projections)


def skinny_linears_default(skinny_linears: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """``TreeSpeculator(skinny_linears=None)``: on for 16-bit CUDA models, where the H200 sweep's table
    (``ops/skinny_linear.py``) picks Triton only for shapes it measured faster than cuBLAS (H200, same call:
    SmolLM2 plain decode 939 -> 990 tokens/s, 8B decode -74 us; BENCHMARKS.md, eleventh session; its speculator
    GPU tests passed in the thirteenth). Off elsewhere. True needs a 16-bit CUDA model (float32 keeps cuBLAS,
    see :mod:`treecompile.passes.skinny_linears`)."""
    if skinny_linears is None:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if not skinny_linears:
        return False
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"skinny_linears: runs 16-bit CUDA linears only (model: {dtype} on {device.type}); leave it unset or False"
        )
    return True


def packed_linears_default(
    packed_linears: bool | None, device: torch.device, dtype: torch.dtype, inductor: bool = False
) -> bool:
    """``TreeSpeculator(packed_linears=None)``: on for float32 CPU models run eagerly when oneDNN is available
    (a 24-row SmolLM2 forward 274 -> 209 ms on the 2-core CI VM), off otherwise. True is refused where it
    cannot apply (Inductor graphs do their own CPU weight packing)."""
    from treecompile.packed_linear import packing_available

    fits = device.type == "cpu" and dtype == torch.float32
    if packed_linears is None:
        return fits and not inductor and packing_available()
    if packed_linears and not fits:
        raise ValueError(f"packed_linears: only float32 CPU models have packed linears (model: {dtype} on {device.type})")
    if packed_linears and inductor:
        raise ValueError("packed_linears: packs eager graphs only; with inductor=True leave it unset or False")
    if packed_linears and not packing_available():
        raise ValueError("packed_linears: this torch build has no oneDNN (torch.backends.mkldnn) linear prepacking")
    return bool(packed_linears)


# The round buffers that hold one row per request (``_bind_buffers``): a batch shrink gathers them.
_REQUEST_BUFFERS = (
    "history", "vc", "dvc", "root", "pend_feat", "pend_tok", "pend_n", "lane_tokens", "tree_tokens", "prompt_len",
    "n_gen", "running", "emitted", "out", "pre_first", "pre_feat",
)


class TreeSpeculator:
    """Greedy tree speculation over an HF causal LM and an EAGLE-style drafter.

    Parameters
    ----------
    model : HF causal LM (Llama, Qwen2, Qwen3, Mistral; hybrid Qwen3-Next, Qwen3.5; Mamba2; SDPA attention),
        in eval mode.
    drafter : an :class:`~treecompile.drafter.EagleDrafter` (or anything with its round hooks).
    topk, steps, num_nodes : K candidates per step, S draft steps (step 0 included), N verify nodes.
        ``topk == 1`` is the chain: ``num_nodes`` becomes ``min(num_nodes, steps + 1)`` and
        ``steps = num_nodes - 1``. A batch verifies B x N rows a round and runs until its slowest request
        stops, so the tree that pays shrinks with the batch: SmolLM2-135M on the H200 with the shipped head
        (BENCHMARKS.md, thirty-sixth session) gains most from (8, 4, 32) at batch 1 (2.13-2.14x plain decode;
        (4, 4, 16) 2.06x, (12, 4, 48) 1.95x) and from (4, 4, 16) at batch 4 (2.02x; (8, 4, 32) 1.93x); at
        batch 16 (twenty-seventh session, an earlier head) from (2, 3, 6) with ``shrink_batch`` (1.26x;
        (4, 4, 16) 1.09x).
    max_batch_size : requests per generate call.
    max_seq_len : keys per request the caches hold; prompt + max_new_tokens + num_nodes must fit.
        Default ``min(max_position_embeddings, 4096)``.
    page_size : KV cache page size.
    prefill_chunk : prompt rows per prefill forward (<= 64); default ``num_nodes`` so prefill and verify
        share one compiled graph.
    inductor : compile the rewritten target and the drafter's round hooks with Inductor (default: on CUDA
        only).
    cuda_graphs : capture and replay the draft and verify (+ commit) rounds and the prefill chunk (default: on
        CUDA). Each batch size's graphs keep their own memory pools (the prefill one holds a chunk's
        activations and its ``[B, prefill_chunk, vocab]`` logits).
    do_sample : only greedy is supported; True is refused at startup by capability resolution.
    replay_ssm : linear-attention layers commit by replaying the accepted path's payload rows (default);
        False stages every node's recurrent state (one per-layer scratch) and commits the last accepted
        node's (GDN and Mamba2).
    ssm_state_dtype : dtype of the linear-attention recurrent state pools; default float32 (float64 for a
        float64 model on CPU). Anything else is refused at startup.
    gdn_chunked : GDN verify of 8..16-node trees in the chunked tree form (``gdn_tree_verify_chunked``)
        instead of the sequential tree kernel (default off: slower on the H200, BENCHMARKS.md "Linear").
    fuse_projections : run each decoder layer's q/k/v and gate/up projections as one linear each, the
        target's and the drafter's (``EagleDrafter.fuse_projections``); their weights are laid out once as
        one tensor that the model's own parameters then view (same values, no extra memory;
        ``model.to(...)`` afterwards is refused at the next ``generate``). Default: on CUDA yes (8B decode
        step 5.53 -> 4.92 ms and SmolLM2 plain decode 594 -> 730 tokens/s on the H200, BENCHMARKS.md); on CPU
        no (no measurable gain there, and the model's parameters keep their own storage).
    mamba2_chunked : Mamba2 forwards of >= 4 rows in the chunked tree form (``mamba2_tree_verify_chunked``,
        every node at once) instead of the sequential tree kernel; default: on CUDA yes, on CPU no
        (TargetBinding).
    packed_linears : run the target's and the drafter's float32 linears on oneDNN-packed weights
        (:mod:`treecompile.packed_linear`; the target's inside the rewritten graph only, so the model and HF's
        own ``generate`` are untouched). Default: on for float32 CPU models without Inductor (small-row GEMMs
        are where MKL is slow on the CPU; costs the weights' memory once more), off otherwise; True elsewhere
        is refused.
    skinny_linears : run the target's and the drafter's 16-bit CUDA linears of <= 256 rows (decode, verify
        trees, draft lanes) through ``treespec::skinny_linear``, Triton tiles instead of cuBLAS, for the shapes
        an H200 sweep measured faster (the rest stay on cuBLAS). Default: on for 16-bit CUDA models, off
        otherwise; True on a CPU or float32 model is refused.
    lookahead : with CUDA graphs, launch each round before reading the previous round's stop flags, so the
        GPU does not wait for the host between rounds. With two round graphs and a real draft only the next
        round's draft goes ahead of the read (its verify follows it), so after the last request stops one
        extra draft runs, which commits nothing; plain decoding runs one extra whole round. False reads the
        flags after every round (for A/B timing).
    shrink_batch : as requests of a batch stop, move the ones still running onto a smaller batch size that
        this speculator has already run (its compiled code and, with CUDA graphs, its captured rounds), so
        the tail of a batch stops paying for finished rows; nothing compiles or captures mid-request. Page
        tables and linear-attention state rows are permuted in place, not copied. Default on. It pays where
        a smaller size rounds much cheaper: SmolLM2 on the H200 at batch 16 (shrinking onto 4 and 1), tree
        (4, 4, 16) 12826 -> 14361 tokens/s, (2, 3, 6) 16053 -> 16571, same speculator and graphs
        (BENCHMARKS.md, twenty-seventh session); at batch 4 it is within noise (batch 1 rounds cost about
        what batch 4's do). Only sizes that ran before are used, so a speculator that only ever saw one
        batch size never shrinks: :meth:`warm_up` runs the sizes to shrink onto ahead of time.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        drafter,
        topk: int = 4,
        steps: int = 5,
        num_nodes: int = 32,
        *,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        page_size: int = 64,
        prefill_chunk: int | None = None,
        inductor: bool | None = None,
        cuda_graphs: bool | None = None,
        do_sample: bool = False,
        replay_ssm: bool = True,
        ssm_state_dtype: torch.dtype | None = None,
        gdn_chunked: bool = False,
        mamba2_chunked: bool | None = None,
        fuse_projections: bool | None = None,
        packed_linears: bool | None = None,
        skinny_linears: bool | None = None,
        lookahead: bool = True,
        shrink_batch: bool | None = None,
    ) -> None:
        topk = _positive_int("topk", topk)
        steps = _positive_int("steps", steps)
        num_nodes = _positive_int("num_nodes", num_nodes)
        max_batch_size = _positive_int("max_batch_size", max_batch_size)
        round_graphs = round_graphs_from_env()  # refused before the caches are bound
        compiled_draft_from_env("cuda")  # the same for a misspelt TREECOMPILE_COMPILED_DRAFT
        if num_nodes > MAX_NODES:
            raise ValueError(f"num_nodes: the tree must have 1..{MAX_NODES} nodes, got {num_nodes}")
        if topk == 1:  # the chain: N - 1 drafted tokens, one per step
            chain_nodes = min(num_nodes, steps + 1)
            chain_steps = max(chain_nodes - 1, 1)
            if (chain_nodes, chain_steps) != (num_nodes, steps):
                logger.info("topk=1 runs the chain: num_nodes %d -> %d, steps %d -> %d",
                            num_nodes, chain_nodes, steps, chain_steps)  # fmt: skip
            num_nodes, steps = chain_nodes, chain_steps
            self.tree = None
        else:
            self.tree = DraftTree(topk, steps, num_nodes)  # validates (S-1)K <= N and N-1 <= candidates
        self.topk, self.steps, self.num_nodes = topk, steps, num_nodes
        self.lane_window = (steps - 1) * topk
        self.pending_rows = min(steps, num_nodes - 1) + 1  # the deepest accept: max depth + root
        prefill_chunk = num_nodes if prefill_chunk is None else _positive_int("prefill_chunk", prefill_chunk)
        if prefill_chunk > MAX_NODES:
            raise ValueError(f"prefill_chunk: at most {MAX_NODES} rows per forward, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk

        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        allowed = _SUPPORTED_DTYPES.get(self.device.type, ())
        if self.dtype not in allowed:
            raise ValueError(f"model: dtype {self.dtype} on {self.device.type} is not supported (supported: {allowed})")
        if model.training:
            raise ValueError("model: is in training mode; call model.eval() (attention dropout would change outputs)")
        self._check_drafter(model, drafter)
        config = model.config
        if max_seq_len is None:
            max_seq_len = min(int(getattr(config, "max_position_embeddings", 4096) or 4096), 4096)
        self.max_seq_len = _positive_int("max_seq_len", max_seq_len)
        self.max_batch_size = max_batch_size

        resolved = resolve_tree_support(
            model, drafter, do_sample=do_sample, max_seq_len=self.max_seq_len, device=self.device, dtype=self.dtype,
            replay_ssm=replay_ssm, state_dtype=ssm_state_dtype,
        )  # fmt: skip
        self.model, self.drafter = model, drafter
        self.fuse_projections = fuse_projections_default(fuse_projections, self.device)
        self.packed_linears = packed_linears_default(packed_linears, self.device, self.dtype, inductor=inductor is True)
        self.skinny_linears = skinny_linears_default(skinny_linears, self.device, self.dtype)
        self.vocab_size = int(config.vocab_size)
        # Rows per forward. Linear-attention pools (payload rows, conv inputs, the GDN workspace: a state per
        # row) are sized by it, so hybrids bind only the rows they run; attention metadata is small.
        max_rows = max(num_nodes, prefill_chunk) if resolved.linear_layers else MAX_NODES
        self.binding = TargetBinding(
            model, max_batch_size, self.max_seq_len, max_rows=max_rows, page_size=page_size,
            layers=resolved.target_layers, linear_layers=resolved.linear_layers, replay_ssm=replay_ssm,
            state_dtype=ssm_state_dtype, gdn_chunked=gdn_chunked, mamba2_chunked=mamba2_chunked,
            fuse_projections=self.fuse_projections, packed_linears=self.packed_linears,
            skinny_linears=self.skinny_linears,
        )  # fmt: skip
        if self.fuse_projections and hasattr(drafter, "fuse_projections"):
            drafter.fuse_projections()
        if self.packed_linears and hasattr(drafter, "pack_linears"):
            drafter.pack_linears()
        if self.skinny_linears and hasattr(drafter, "skinny_linears"):
            drafter.skinny_linears()
        self.runner = TargetRunner(model, self.binding, aux_layers=drafter.aux_layers, inductor=inductor)
        self.draft_hooks = DraftHooks(drafter, self.device.type == "cuda" if inductor is None else inductor)
        self._commit_fn = _commit_tokens
        compiled_commit = env_switch(COMPILED_COMMIT_ENV, True)  # read (and a bad value refused) on every device
        if self.draft_hooks.inductor and compiled_commit:
            # One Inductor graph for the commit's ~30 small ops (in place on the state: Inductor writes the
            # mutated inputs back). H200, SmolLM2 batch 1 (sixteenth session): plain decode 1307.6 -> 1421.2
            # tokens/s, tree (8, 6, 64) 2263.5 -> 2387.3, tokens equal on the GPU tests.
            self._commit_fn = compile_inference(
                _commit_tokens, f"_commit_tokens_{id(self):x}", key=batch_key, fullgraph=True
            )  # fmt: skip
        self._draft_fn = self._draft_round
        if self.draft_hooks.inductor and self.num_nodes > 1 and compiled_draft_from_env(self.device.type):
            # The whole draft round as one compiled region: the eager glue between the hooks (positions,
            # slots, masks, the tree's bookkeeping: ~15 eager kernels of a SmolLM2 (4, 4, 16) round) fuses
            # with them; the hooks' own compiled functions are traced through. A plain decode drafts nothing.
            self._draft_fn = self._compiled_draft_round()
        elif draft_inductor_options_from_env():  # parsed (a bad item refused) here too, then unused
            logger.warning("%s is set but has no effect: this speculator's draft round is not one compiled region "
                           "(inductor=%s, num_nodes=%d, %s=%r, device %s)", DRAFT_INDUCTOR_ENV,
                           self.draft_hooks.inductor, self.num_nodes, COMPILED_DRAFT_ENV,
                           os.environ.get(COMPILED_DRAFT_ENV, ""), self.device.type)  # fmt: skip
        if self.tree is not None and self.draft_hooks.inductor:  # the ranking and numbering fuse too
            self.tree = DraftTree(topk, steps, num_nodes, inductor=True)
        if self.tree is not None:
            # Built before any trace: filled lazily inside the compiled draft round, the cache's emptiness was
            # a guard that failed on the next call and compiled the whole round a second time.
            self.tree._constants(self.device)
        self.draft_cache = drafter.new_cache(max_batch_size, self.max_seq_len, page_size=page_size, device=self.device)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs: needs the model on a CUDA device")
        self.cuda_graphs = cuda_graphs
        self.lookahead = bool(lookahead)
        self.shrink_batch = True if shrink_batch is None else bool(shrink_batch)
        self.shrinks = 0  # batch shrinks so far (all generate calls)
        # A shrink permutes page-table rows: a drafter whose cache is not a PagedKVCache keeps its batch.
        self._shrinkable = hasattr(self.draft_cache, "page_table") and hasattr(self.draft_cache, "lengths")
        self.round_graphs = round_graphs
        # With two round graphs and a real draft, the lookahead launches only the next round's draft before it
        # reads the stop flags, and its verify after: the host reads the flags while that draft runs (a batch-1
        # (4, 4, 16) SmolLM2 draft is ~0.19 ms on the H200, the host's read and launch tens of us), and the
        # round launched after the last request stops costs a draft, not a whole round. False: whole rounds
        # ahead (plain decoding always: its draft is one copy, too short to hide the host's read).
        self.split_lookahead = True
        self._graphs: dict[int, tuple] = {}
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._buffers: dict[int, dict] = {}
        self._state: dict | None = None

    def __repr__(self) -> str:
        return (f"TreeSpeculator(topk={self.topk}, steps={self.steps}, num_nodes={self.num_nodes}, "
                f"max_batch_size={self.max_batch_size}, max_seq_len={self.max_seq_len})")  # fmt: skip

    @staticmethod
    def _check_drafter(model, drafter) -> None:
        hidden = model.config.hidden_size
        target_hidden = getattr(drafter, "target_hidden_size", None)
        if target_hidden is not None and target_hidden != hidden:
            raise ValueError(
                f"drafter: built for target hidden size {target_hidden}, but the model's hidden size is {hidden}"
            )
        embed = getattr(drafter, "embed", None)
        if embed is not None and getattr(drafter, "hidden_size", hidden) != embed.embedding_dim:
            raise ValueError(
                f"drafter: hidden size {drafter.hidden_size} does not match its token embedding width "
                f"{embed.embedding_dim}"
            )
        for name in ("aux_layers", "draft_step0", "draft_lanes", "draft_prefill", "score_candidates", "new_cache"):
            if not hasattr(drafter, name):
                raise ValueError(f"drafter: {type(drafter).__name__} lacks {name!r} (see EagleDrafter)")
        layers = model.config.num_hidden_layers
        bad = [i for i in drafter.aux_layers if not 0 <= i < layers]
        if bad:
            raise ValueError(f"drafter: aux_layers {bad} are not hidden-state indices 0..{layers - 1} of the target")
        drafter_param = next(drafter.parameters(), None)
        target_param = next(model.parameters())
        if drafter_param is not None and (drafter_param.dtype, drafter_param.device) != (target_param.dtype, target_param.device):
            raise ValueError(
                f"drafter: is {drafter_param.dtype} on {drafter_param.device}, the model {target_param.dtype} on "
                f"{target_param.device}; move it with .to()"
            )

    # ---------------------------------------------------------------------------------------------------
    # Input validation (host side, before any device work)
    # ---------------------------------------------------------------------------------------------------

    def _prompts(self, input_ids, attention_mask) -> tuple[torch.Tensor, list[int], list[list[int]]]:
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"input_ids: expected a tensor, got {type(input_ids).__name__}")
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
            attention_mask = attention_mask.unsqueeze(0) if isinstance(attention_mask, torch.Tensor) else attention_mask
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected int64 [B, L], got {input_ids.dtype} {tuple(input_ids.shape)}")
        B, width = input_ids.shape
        if B < 1 or width < 1:
            raise ValueError(f"input_ids: empty prompt (shape {tuple(input_ids.shape)})")
        if B > self.max_batch_size:
            raise ValueError(f"input_ids: batch {B} exceeds max_batch_size {self.max_batch_size}")
        ids = input_ids.detach().to("cpu", torch.int64)
        if attention_mask is None:
            mask = torch.ones_like(ids)
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask: expected a tensor of shape {tuple(input_ids.shape)}, got "
                    f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}"
                )
            mask = attention_mask.detach().to("cpu", torch.int64)
            if bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError("attention_mask: values must be 0 or 1")
            if bool((mask[:, 1:] < mask[:, :-1]).any()):
                raise ValueError("attention_mask: expected left padding (zeros before the prompt), like HF decoder-only generate")
        lengths = mask.sum(1).tolist()
        if min(lengths) < 1:
            raise ValueError(f"input_ids: request {lengths.index(min(lengths))} has an empty prompt")
        prompts = [ids[b, width - lengths[b]:].tolist() for b in range(B)]
        flat = [t for p in prompts for t in p]
        if min(flat) < 0 or max(flat) >= self.vocab_size:
            raise ValueError(f"input_ids: token ids must be in [0, {self.vocab_size}), got [{min(flat)}, {max(flat)}]")
        return input_ids, lengths, prompts

    def _eos_ids(self, eos_token_id) -> list[int]:
        if eos_token_id is _UNSET or eos_token_id is None:
            eos_token_id = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is None:
            return []
        if isinstance(eos_token_id, torch.Tensor):
            eos_token_id = eos_token_id.flatten().tolist()
        if isinstance(eos_token_id, (int,)) and not isinstance(eos_token_id, bool):
            eos_token_id = [eos_token_id]
        if not isinstance(eos_token_id, Sequence) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in eos_token_id
        ):
            raise ValueError(f"eos_token_id: expected None, an int or a list of ints, got {eos_token_id!r}")
        bad = [t for t in eos_token_id if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"eos_token_id: ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        eos = list(dict.fromkeys(eos_token_id))  # order kept: the first id is the default pad, as in HF
        if len(eos) > MAX_EOS_IDS:
            raise ValueError(f"eos_token_id: at most {MAX_EOS_IDS} distinct ids, got {len(eos)}")
        return eos

    def _pad_id(self, pad_token_id, eos: list[int]) -> int:
        if pad_token_id is None:
            pad_token_id = getattr(getattr(self.model, "generation_config", None), "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
            raise ValueError(f"pad_token_id: expected an int, got {pad_token_id!r}")
        return pad_token_id

    # ---------------------------------------------------------------------------------------------------
    # generate
    # ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        eos_token_id=_UNSET,
        pad_token_id: int | None = None,
    ) -> GenerateOutput:
        """Greedy-decode up to ``max_new_tokens`` per request with tree speculation.

        ``eos_token_id``: an int or a list of ints (any of them stops a request; the EOS is kept and the
        row is padded after it); ``None`` or omitted uses ``model.generation_config.eos_token_id``.
        ``pad_token_id`` defaults to the generation config's, else the first EOS id, else 0.
        """
        max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        self.binding.check_projections()
        input_ids, lengths, prompts = self._prompts(input_ids, attention_mask)
        eos = self._eos_ids(eos_token_id)
        pad = self._pad_id(pad_token_id, eos)
        need = max(lengths) + max_new_tokens + self.num_nodes
        capacity = min(self.binding.capacity, self.draft_cache.capacity, self.max_seq_len)
        if need > capacity:
            raise ValueError(
                f"input_ids: the longest prompt ({max(lengths)}) + max_new_tokens ({max_new_tokens}) + one verify "
                f"window (num_nodes {self.num_nodes}) = {need} keys exceeds the cache capacity max_seq_len="
                f"{self.max_seq_len}"
            )
        B = len(lengths)
        st = self._new_state(B, lengths, prompts, eos, max_new_tokens)
        self._prefill(st, max(lengths))
        st, accept_lengths = self._run_rounds(st)
        n_gen, out = self._results(st, B)
        new = out.shape[1]
        col = torch.arange(new)
        out = torch.where(col[None, :] < n_gen[:, None], out, torch.full_like(out, pad))
        sequences = torch.cat([input_ids.detach().to("cpu", torch.int64), out], dim=1).to(input_ids.device)
        accepted = torch.zeros(len(accept_lengths), B, dtype=torch.int64)
        r = 0
        for requests, phase in itertools.groupby(accept_lengths, key=lambda item: item[1]):  # one batch size each
            counts = torch.stack([emitted for emitted, _ in phase]).cpu()  # one copy a phase, not one a round
            accepted[r : r + len(counts), requests] = counts
            r += len(counts)
        self._state = None
        return GenerateOutput(sequences=sequences, accept_lengths=accepted)

    def warm_up(self, batch_sizes=(1,), prompt_len: int = 8) -> list[int]:
        """Compile (and, with CUDA graphs, capture) everything a request of each of ``batch_sizes`` runs,
        before any real request: one short ``generate`` per size, smallest first, on a dummy prompt of
        ``prompt_len`` tokens with no EOS, long enough for a prefill chunk and at least two rounds. Then the
        first real request pays no compile, and a batch can shrink onto every warmed size below its own
        (``shrink_batch``: it only ever moves onto sizes that already ran). Nothing of the dummy requests
        stays in the caches. With Inductor on the H200 host a size takes ~40-70 s the first time (the
        compile cache makes later processes faster). Returns the sizes warmed, in order."""
        if isinstance(batch_sizes, int) and not isinstance(batch_sizes, bool):
            batch_sizes = (batch_sizes,)
        try:
            sizes = sorted(dict.fromkeys(_positive_int("batch_sizes", b) for b in batch_sizes))
        except TypeError:
            raise ValueError(f"batch_sizes: expected an int or a sequence of positive ints, got {batch_sizes!r}") from None
        if not sizes:
            raise ValueError("batch_sizes: expected at least one batch size, got none")
        if sizes[-1] > self.max_batch_size:
            raise ValueError(f"batch_sizes: {sizes[-1]} exceeds max_batch_size {self.max_batch_size}")
        prompt_len = _positive_int("prompt_len", prompt_len)
        new_tokens = 2 * (self.steps + 1) + 1  # a round emits at most steps + 1 tokens: >= 2 rounds
        capacity = min(self.binding.capacity, self.draft_cache.capacity, self.max_seq_len)
        if prompt_len + new_tokens + self.num_nodes > capacity:
            raise ValueError(f"prompt_len: {prompt_len} + {new_tokens} warm-up tokens + num_nodes {self.num_nodes} "
                             f"exceeds the cache capacity max_seq_len={self.max_seq_len}")
        ids = (torch.arange(prompt_len, device=self.device) % self.vocab_size).repeat(sizes[-1], 1)
        shrink, self.shrink_batch = self.shrink_batch, False  # each size runs its own rounds to the end
        try:
            for b in sizes:
                t0 = time.perf_counter()
                # eos_token_id=[]: no EOS, so no dummy request stops before the rounds ran
                self.generate(ids[:b], max_new_tokens=new_tokens, eos_token_id=[])
                logger.info("warm_up: batch %d ready in %.1f s", b, time.perf_counter() - t0)
        finally:
            self.shrink_batch = shrink
        return sizes

    def _results(self, st, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Generated counts ``[B]`` and tokens ``[B, max count]`` (host) by original request: the rows still
        in the state, and those a batch shrink left behind (saved when it did)."""
        n_gen = torch.zeros(B, dtype=torch.int64)
        here, left = st["requests"], st["left"]
        n_gen[here] = st["n_gen"].cpu()
        for request, (n, _) in left.items():
            n_gen[request] = n.cpu()
        new = int(n_gen.max())
        out = torch.zeros(B, new, dtype=torch.int64)
        out[here] = st["out"][:, :new].cpu()
        for request, (_, row) in left.items():
            out[request] = row[:new].cpu()
        return n_gen, out

    # ---------------------------------------------------------------------------------------------------
    # State, prefill, rounds
    # ---------------------------------------------------------------------------------------------------

    def _new_state(self, B, lengths, prompts, eos, max_new_tokens) -> dict:
        """The state of one generate call. Round buffers are bound once per batch size (captured graphs
        read them) and reset in place here; everything else is fresh: nothing of an earlier request leaks."""
        bound = self._buffers.get(B)
        if bound is None:
            bound = self._buffers[B] = self._bind_buffers(B)
        # One multi-tensor launch per dtype, not one zero_ per buffer (~30; each a few us of host launch on a
        # request's fixed cost). "history" is overwritten whole below.
        torch._foreach_zero_([
            t for name, t in bound.items()
            if isinstance(t, torch.Tensor) and name != "history" and not name.startswith(("rows_", "chain_"))
        ])  # fmt: skip
        bound["pend_n"].fill_(1)
        bound.pop("round", None)  # a verify's outputs never outlive their commit
        bound["spec"].reset_chain()
        bound["spec"].positions.zero_()
        history = torch.zeros(B, self.max_seq_len, dtype=torch.int64)
        for b, p in enumerate(prompts):
            history[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        bound["history"].copy_(history)
        self.binding.reset_linear_state()
        bound["prompt_len"].copy_(torch.tensor(lengths, dtype=torch.int64))
        bound["running"].fill_(True)
        bound["max_new"].fill_(max_new_tokens)
        bound["eos"].copy_(torch.tensor(eos + [-1] * (MAX_EOS_IDS - len(eos)), dtype=torch.int64))
        st = dict(bound)
        st.update(B=B, requests=list(range(B)), left={})
        self._state = st
        return st

    def _bind_buffers(self, B: int) -> dict:
        """Round buffers for batch size B, allocated once (fixed addresses for captured rounds)."""
        dev, N, P, K = self.device, self.num_nodes, self.pending_rows, self.topk
        feat = len(self.drafter.aux_layers) * self.model.config.hidden_size
        return {
            "history": torch.zeros(B, self.max_seq_len, dtype=torch.int64, device=dev),
            "vc": torch.zeros(B, dtype=torch.int64, device=dev),
            "dvc": torch.zeros(B, dtype=torch.int64, device=dev),
            "root": torch.zeros(B, dtype=torch.int64, device=dev),
            "pend_feat": torch.zeros(B, P, feat, dtype=self.dtype, device=dev),
            "pend_tok": torch.zeros(B, P, dtype=torch.int64, device=dev),
            "pend_n": torch.ones(B, dtype=torch.int64, device=dev),
            "lane_tokens": torch.zeros(B, max(self.lane_window, 1), dtype=torch.int64, device=dev),
            # The verify tree, bound once: the chain (topk == 1) is never rewritten.
            "spec": TreeSpec(B, N, device=dev),
            "tree_tokens": torch.zeros(B, N, dtype=torch.int64, device=dev),
            # Per-request progress, bound too: the captured verify round commits into them.
            "prompt_len": torch.zeros(B, dtype=torch.int64, device=dev),
            "n_gen": torch.zeros(B, dtype=torch.int64, device=dev),
            "running": torch.zeros(B, dtype=torch.bool, device=dev),
            "emitted": torch.zeros(B, dtype=torch.int64, device=dev),
            "out": torch.zeros(B, self.max_seq_len + N + 1, dtype=torch.int64, device=dev),
            "max_new": torch.zeros((), dtype=torch.int64, device=dev),
            "eos": torch.full((MAX_EOS_IDS,), -1, dtype=torch.int64, device=dev),  # -1: no id (tokens are >= 0)
            "rows_p": torch.arange(P, device=dev),
            "rows_n": torch.arange(N, device=dev),
            "rows_k": torch.arange(K, device=dev),
            # Lane window column j holds step j // K + 1's lane j % K, at position vc + j // K (slot vc + j).
            "rows_w": torch.arange(max(self.lane_window, 1), device=dev),
            "rows_ws": torch.arange(max(self.lane_window, 1), device=dev) // K,
            "chain_p": chain_mask(P, device=dev),
            # Prefill: the chunk's first row (the host writes it before each chunk), its rows and chain mask,
            # and the first token / last feature row collected over the chunks.
            "pre_start": torch.zeros((), dtype=torch.int64, device=dev),
            "rows_c": torch.arange(self.prefill_chunk, device=dev),
            "chain_c": chain_mask(self.prefill_chunk, device=dev),
            "pre_first": torch.zeros(B, dtype=torch.int64, device=dev),
            "pre_feat": torch.zeros(B, feat, dtype=self.dtype, device=dev),
        }

    def _prefill(self, st, longest: int) -> None:
        """Prompt as chains of ``prefill_chunk`` rows; the draft cache gets every prompt pair but the last.

        With CUDA graphs a chunk is one replay of a graph captured once per batch size (``_prefill_graph``):
        eager, a 64-row chunk of a rewritten SmolLM2-135M costs ~40 ms of host time (the attention ops' Python
        dispatch, ~450 kernel launches) for ~1 ms of GPU work on the H200: as long as ~30 plain decode rounds
        (``tests/gpu/request_probe.py``)."""
        C = self.prefill_chunk
        graph = self._prefill_graph(st) if self.cuda_graphs else None
        for start in range(0, longest, C):
            st["pre_start"].fill_(start)
            if graph is not None:
                graph.replay()
            else:
                self._prefill_chunk(st)
        L, first = st["prompt_len"], st["pre_first"]
        st["history"].scatter_(1, L[:, None], first[:, None])
        st["vc"].copy_(L)
        st["dvc"].copy_(L - 1)
        st["root"].copy_(first)
        st["pend_feat"][:, 0].copy_(st["pre_feat"])
        st["pend_tok"][:, 0].copy_(first)
        st["pend_n"].fill_(1)
        st["out"][:, 0].copy_(first)
        st["n_gen"].fill_(1)
        done = _is_eos(first, st["eos"]) | (st["n_gen"] >= st["max_new"])
        st["running"].copy_(~done)

    def _prefill_chunk(self, st) -> None:
        """The prompt rows ``[pre_start, pre_start + C)`` of every request: target forward as a chain (padded
        rows write the dummy slot), linear-attention commit of the valid rows, the draft cache's pairs, and
        the first token / last feature row once a request's last prompt row is in the chunk (``pre_first``
        ``[B]``, ``pre_feat`` ``[B, feat]``). Reads only bound buffers, so one capture serves every chunk."""
        B, C = st["B"], self.prefill_chunk
        L, start, rows = st["prompt_len"], st["pre_start"], st["rows_c"]
        cap = st["history"].shape[1]
        feat = st["pend_feat"].shape[2]
        starts = start.expand(B)
        pos = start + rows.expand(B, C)
        valid = pos < L[:, None]
        ids = torch.where(valid, st["history"].gather(1, pos.clamp(max=cap - 1)), 0)
        self.binding.load(torch.minimum(starts, L), torch.where(valid, st["chain_c"], 0), valid)
        logits, aux = self.runner(ids, torch.where(valid, pos, 0))
        # Linear-attention state takes each request's valid rows of the chunk (a chain: rows 0..n-1).
        self.binding.commit_linear_state(rows.expand(B, C), (L - start).clamp(0, C))
        has_last = (L - 1 >= start) & (L - 1 < start + C)
        row = (L - 1 - start).clamp(0, C - 1)
        last_logits = logits.gather(1, row.view(B, 1, 1).expand(B, 1, logits.shape[-1])).squeeze(1)
        # exact as on float32 (see _verify_round)
        st["pre_first"].copy_(torch.where(has_last, _greedy_tokens(last_logits), st["pre_first"]))
        row_feat = aux.gather(1, row.view(B, 1, 1).expand(B, 1, feat)).squeeze(1)
        st["pre_feat"].copy_(torch.where(has_last[:, None], row_feat, st["pre_feat"]))
        # Draft pairs (hidden at p, token at p + 1) for p < L - 1.
        dvalid = pos < (L - 1)[:, None]
        dtok = torch.where(dvalid, st["history"].gather(1, (pos + 1).clamp(max=cap - 1)), 0)
        dslots = torch.where(dvalid, self.draft_cache.slots(pos), self.draft_cache.dummy_slot)
        self.drafter.draft_prefill(
            self.draft_cache, aux, dtok, torch.where(dvalid, pos, 0), dslots, torch.minimum(starts, L - 1),
            torch.where(dvalid, st["chain_c"], 0),
        )  # fmt: skip

    def _prefill_graph(self, st):
        """The prefill chunk captured for this batch size (once; later requests replay it).

        A chunk is not idempotent: it commits linear-attention state. So chunk 0 runs eagerly (compiles) and
        once more on a side stream (as capture wants), then what those two runs committed is undone (linear
        state and the first-token buffers zeroed, as a fresh request has them; the K/V rows they wrote are
        rewritten identically by the replay) and the capture, which runs nothing, records the chunk."""
        B = st["B"]
        graph = self._prefill_graphs.get(B)
        if graph is not None:
            return graph
        st["pre_start"].fill_(0)
        self._prefill_chunk(st)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._prefill_chunk(st)
        torch.cuda.current_stream().wait_stream(stream)
        self.binding.reset_linear_state()
        st["pre_first"].zero_()
        st["pre_feat"].zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._prefill_chunk(st)
        self._prefill_graphs[B] = graph
        logger.info("captured the prefill chunk (%d rows) for batch %d", self.prefill_chunk, B)
        return graph

    def _run_rounds(self, st) -> tuple[dict, list]:
        """Rounds until no request runs; returns the final state (a batch shrink replaces it) and each round's
        emitted counts with the original requests of its rows: ``[(emitted [B_round], requests), ...]``.

        Eager rounds read ``running`` on the host after each round. Once the rounds replay as CUDA graphs
        (``lookahead``), the host launches round r + 1 before it waits for round r's ``running`` flags
        (copied to pinned memory behind round r on the stream), so the GPU never idles while the host reads
        a flag and launches the next replays (H200, SmolLM2 shapes: tree (4, 6, 32) 2.091 -> 1.963 ms a round;
        plain decode and tree (8, 6, 64) within 1%). With two round graphs only round r + 1's draft goes ahead
        of the read (``split_lookahead``). The one round (or draft) launched after the last request finished
        commits nothing (every request is stopped, as finished requests of a batch already are) and its
        all-zero counts are dropped. Where the flags allow a smaller batch (``shrink_batch``), the round in
        flight lands first, then the running requests move (``_shrink``) and the rounds go on there.
        """
        accepted: list[tuple[torch.Tensor, list[int]]] = []
        while True:
            running = self._rounds_until_shrink(st, accepted)
            if running is None:
                return st, accepted
            st = self._shrink(st, running)

    def _rounds_until_shrink(self, st, accepted: list) -> list[bool] | None:
        """Rounds at this batch size; None once no request runs, else the host's ``running`` flags at the
        point where a smaller batch size would do."""
        B = st["B"]
        while True:  # eager rounds (and the one that captures): one host read each
            running = st["running"].tolist()
            if not any(running):
                return None
            if self._shrink_size(B, sum(running)) is not None:
                return running
            if self.lookahead and B in self._graphs:
                break
            self._round(st)
            accepted.append((st["emitted"].clone(), st["requests"]))
        flags, done = self._flag_buffers(B)
        graphs = self._graphs[B]
        split = self.split_lookahead and len(graphs) == 2 and self.num_nodes > 1

        def launch(r: int, verify_only: bool = False) -> None:
            for graph in graphs[1:] if verify_only else graphs:
                graph.replay()
            accepted.append((st["emitted"].clone(), st["requests"]))
            flags[r % 2].copy_(st["running"], non_blocking=True)
            done[r % 2].record()

        r = 0
        launch(r)
        while True:
            # Ahead of the flag read below: round r + 1's draft alone (split: its verify waits for the flags), or
            # the whole round.
            if split:
                graphs[0].replay()
            else:
                launch(r + 1)
            done[r % 2].synchronize()
            running = flags[r % 2].tolist()
            if not any(running):  # round r finished every request: what went ahead ran for nothing
                if not split:
                    accepted.pop()
                return None
            if split:
                launch(r + 1, verify_only=True)
            if self._shrink_size(B, sum(running)) is not None:  # round r + 1 ran for real: let it land
                done[(r + 1) % 2].synchronize()
                running = flags[(r + 1) % 2].tolist()
                return running if any(running) else None
            r += 1

    def _flag_buffers(self, B: int) -> tuple[torch.Tensor, list]:
        """Round r's ``running`` flags land in row ``r % 2`` of a pinned ``[2, B]`` bool buffer, behind event
        ``r % 2`` (the CPU tests of the lookahead's host logic replace both)."""
        return torch.empty(2, B, dtype=torch.bool, pin_memory=True), [torch.cuda.Event(), torch.cuda.Event()]

    def _shrink_size(self, B: int, running: int) -> int | None:
        """The smallest batch size below B that holds ``running`` requests and has already run here (its
        graphs captured, with CUDA graphs; its buffers bound, without), or None."""
        if not self.shrink_batch or running >= B or not self._shrinkable:
            return None
        ready = self._graphs if self.cuda_graphs else self._buffers
        sizes = [b for b in ready if running <= b < B]
        return min(sizes) if sizes else None

    def _shrink(self, st, running: list[bool]) -> dict:
        """Move the running requests onto the smaller batch size ``_shrink_size`` picks: the first B' rows of
        the target's and the draft's page tables and of the linear-attention state become theirs (a row
        permutation in place: no K/V moves), their round buffers are gathered into that size's bound ones,
        and the requests left behind keep their tokens in ``st["left"]`` for ``_results``."""
        B = st["B"]
        B2 = self._shrink_size(B, sum(running))
        keep = [b for b in range(B) if running[b]]
        keep += [b for b in range(B) if not running[b]][: B2 - len(keep)]  # stopped rows pad to B2
        perm = keep + [b for b in range(B) if b not in keep]
        idx = torch.tensor(perm, dtype=torch.int64, device=self.device)
        for b in perm[B2:]:
            st["left"][st["requests"][b]] = (st["n_gen"][b].clone(), st["out"][b].clone())
        for cache in (self.binding.cache, self.draft_cache):
            if cache is not None:
                cache.page_table[:B] = cache.page_table[:B][idx]
                cache.lengths[:B] = cache.lengths[:B][idx]
        for t in self.binding.conv_state + self.binding.ssm_state:
            t[:B] = t[:B][idx]
        bound = self._buffers[B2]  # B2 ran before (``_shrink_size``): its buffers are bound
        rows = idx[:B2]
        for name in _REQUEST_BUFFERS:
            bound[name].copy_(st[name].index_select(0, rows))
        for name in ("max_new", "eos"):
            bound[name].copy_(st[name])
        bound.pop("round", None)
        bound["spec"].reset_chain()  # a tree is set each round; the chain (topk == 1) is this
        bound["spec"].positions.zero_()
        new = dict(bound)
        new.update(B=B2, requests=[st["requests"][b] for b in keep], left=st["left"])
        self._state = new
        self.shrinks += 1
        logger.debug("batch %d -> %d (%d running)", B, B2, sum(running))
        return new

    def _round(self, st) -> None:
        B = st["B"]
        graphs = self._graphs.get(B) if self.cuda_graphs else None
        if graphs is not None:  # the draft's and the verify's launches (one, ``round_graphs=1``)
            for graph in graphs:
                graph.replay()
            return
        self._draft_fn(st)
        self._verify_round(st)
        self._commit(st)
        if self.cuda_graphs:  # after an eager commit: every kernel the capture records has run once
            self._capture(st)

    def _compiled_draft_round(self):
        """``_draft_round`` as one Inductor-compiled region bound to this speculator (the hooks traced through)."""
        options = draft_inductor_options_from_env()  # TREECOMPILE_DRAFT_INDUCTOR: A/B runs of this region alone
        if options:  # compile_inference lays them over treecompile's own patches (PDL, combo kernels)
            logger.info("compiled draft round: Inductor options %s", options)
        extra = {"options": options} if options else {}
        compiled = compile_inference(type(self)._draft_round, f"_draft_round_{id(self):x}", key=_round_batch, **extra)
        return functools.partial(compiled, self)

    def _draft_round(self, st) -> None:
        """Step 0 and the lanes; leaves the selected tree in the TreeSpec and ``tree_tokens``. A one-node tree
        (``num_nodes=1``: plain decoding through the same runtime) is just the root, the last verify's bonus
        token: nothing to draft, so the head does not run."""
        if self.num_nodes == 1:
            st["tree_tokens"].copy_(st["root"][:, None])
            return
        B, K, S = st["B"], self.topk, self.steps
        cache, drafter = self.draft_cache, self.draft_hooks
        vc, dvc = st["vc"], st["dvc"]
        context = DraftContext(history=st["history"], vc=vc, lane_tokens=st["lane_tokens"], step=0)
        pos0 = dvc[:, None] + st["rows_p"]
        valid0 = st["rows_p"] < st["pend_n"][:, None]
        slots0 = torch.where(valid0, cache.slots(pos0), cache.dummy_slot)
        hidden, logits = drafter.draft_step0(
            cache, st["pend_feat"], st["pend_tok"], torch.where(valid0, pos0, 0), slots0, dvc,
            torch.where(valid0, st["chain_p"], 0), st["pend_n"] - 1, context,
        )  # fmt: skip
        logp, tokens = drafter.score_candidates(logits, K)  # [B, K]
        if self.tree is not None:
            lanes = self.tree.begin(logp, tokens)
        else:
            lanes = LaneState(tokens=tokens, scores=logp, mask=torch.ones_like(tokens), candidate=torch.zeros_like(tokens),
                              parent_lane=torch.zeros_like(tokens), step=1)  # fmt: skip
            chain = [tokens[:, 0]]
        hidden = hidden[:, None, :]  # [B, 1, H]: the one step-0 row every step-1 lane continues
        H = hidden.shape[-1]
        if S > 1:
            # Every lane step's positions and draft-cache slots at once: two kernels a round where each step
            # launched ~5 (adds, a copy, the slot lookup; ~1 us each on the H200). Step s reads its K columns.
            lane_pos = vc[:, None] + st["rows_ws"]  # [B, (S-1)K]: vc - 1 + s
            lane_slots = cache.slots(vc[:, None] + st["rows_w"])  # [B, (S-1)K]
        fill_context = getattr(self.drafter, "reads_draft_context", True)  # an unknown drafter may read it
        gather_inside = getattr(self.drafter, "gathers_parents", False)
        for s in range(1, S):
            cols = slice((s - 1) * K, s * K)
            if fill_context:
                st["lane_tokens"][:, cols].copy_(lanes.tokens)
            context = DraftContext(history=st["history"], vc=vc, lane_tokens=st["lane_tokens"], step=s)
            args = (lane_pos[:, cols], lane_slots[:, cols], vc, lanes.mask, self.lane_window, context)
            if gather_inside:  # the parents' gather fuses into the compiled step
                hidden, logits = drafter.draft_lanes(cache, hidden, lanes.tokens, *args, lanes.parent_lane)
            else:
                parent = hidden.gather(1, lanes.parent_lane[:, :, None].expand(B, K, H))
                hidden, logits = drafter.draft_lanes(cache, parent, lanes.tokens, *args)
            logp, tokens = drafter.score_candidates(logits, K)  # [B, K, K]
            if self.tree is not None:
                lanes = self.tree.expand(lanes, logp, tokens)
            else:
                chain.append(tokens[:, 0, 0])
                mask = lanes.mask | (1 << s)
                lanes = LaneState(tokens=tokens[:, :, 0], scores=logp[:, :, 0], mask=mask,
                                  candidate=lanes.candidate, parent_lane=lanes.parent_lane, step=s + 1)  # fmt: skip
        spec = st["spec"]
        if self.tree is not None:
            tree = self.tree.select(st["root"])
            spec.set_tree(tree)
            st["tree_tokens"].copy_(tree.tokens)
        else:
            drafted = torch.stack(chain, dim=1)[:, : self.num_nodes - 1]
            st["tree_tokens"].copy_(torch.cat([st["root"][:, None], drafted], dim=1))

    def _verify_round(self, st) -> None:
        """One target forward over the tree, the greedy walk, KV and hidden-row compaction."""
        B, N = st["B"], self.num_nodes
        spec, vc = st["spec"], st["vc"]
        positions = spec.load_step(vc)
        self.binding.load(vc, spec.ancestor_mask, parents=spec.parents)
        logits, aux = self.runner(st["tree_tokens"], positions)
        # HF's greedy argmax runs on float32 logits; widening bf16 / fp16 to float32 is exact, so the argmax of
        # the logits themselves is the same index (first maximum) without a float32 copy of [B, N, vocab].
        target_tokens = _greedy_tokens(logits)
        path, accept_len, bonus = torch.ops.treespec.verify_tree_greedy(spec.parents, st["tree_tokens"], target_tokens)
        kv = self.binding.kv_buffers()
        if kv:  # a pure Mamba2 target has no KV cache
            torch.ops.treespec.compact_window_rows(kv, self.binding.window_slots(B, N), path, accept_len)
        spec.compact_rows(aux, path, accept_len, vc)  # aux is this forward's own tensor: compacted in place
        # The round's outputs go to the commit by reference, not copied into bound buffers (four kernels a
        # round): the commit runs right after, in the same captured graph, and nothing else reads them.
        st["round"] = (path, accept_len, bonus, aux)

    def _commit(self, st) -> None:
        """Emit the accepted tokens (EOS and max_new_tokens cut them), then commit running requests."""
        path, accept_len, bonus, aux = st.pop("round")
        committed = self._commit_fn(
            st["tree_tokens"], path, accept_len, bonus, st["rows_n"], st["eos"], st["running"],
            st["n_gen"], st["max_new"], st["out"], st["emitted"], st["history"], st["dvc"], st["pend_tok"],
            st["pend_feat"], st["pend_n"], st["root"], st["vc"], aux, self.pending_rows, self.num_nodes,
        )  # fmt: skip
        # Linear-attention state follows the accepted path; finished requests keep theirs (length 0).
        self.binding.commit_linear_state(path, committed)

    # ---------------------------------------------------------------------------------------------------
    # CUDA graphs
    # ---------------------------------------------------------------------------------------------------

    def _capture(self, st) -> None:
        """Capture the round for this batch size, after the eager warm-up round committed: the draft and the
        verify (+ commit) as two graphs, or with ``round_graphs=1`` all three as one. The side-stream
        warm-up recomputes the next round's draft and verify from the committed state (idempotent: the first
        replay recomputes the same); the capture itself runs nothing."""
        B = st["B"]
        if B in self._graphs:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # a second idempotent warm-up on a side stream, as capture wants
            self._draft_fn(st)
            self._verify_round(st)
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        graphs = tuple(torch.cuda.CUDAGraph() for _ in range(self.round_graphs))
        # The commit is ~30 small kernels: eager, their launches cost more host time than a small target's
        # whole verify (0.5-0.7 ms a round at SmolLM2 shapes on the H200); captured, the GPU runs them back to
        # back. In one graph no graph boundary sits between the draft's last kernel and the verify's first.
        with torch.cuda.graph(graphs[0], pool=pool):
            self._draft_fn(st)
            if len(graphs) == 1:
                self._verify_round(st)
                self._commit(st)
        if len(graphs) == 2:
            with torch.cuda.graph(graphs[1], pool=pool):
                self._verify_round(st)
                self._commit(st)
        self._graphs[B] = graphs
        logger.info("captured the round for batch %d (%d graph%s)", B, len(graphs), "s" * (len(graphs) > 1))
